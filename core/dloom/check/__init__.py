"""``dloom check``: test the claim a strategy declares (lossless, a bound) empirically.

* :func:`check_strategy` tests the declared :class:`~dloom.Claim` and returns a
  :class:`CheckReport` (what ``dloom check`` prints);
* :func:`check_lossless` / :func:`assert_lossless`: greedy token identity plus the exact
  sampling test against a reference (a strategy, :data:`KERNEL` or an AR :data:`TARGET`),
  declared or not;
* :func:`check_soundness` / :func:`assert_sound`: a commit rule's bound on random and
  adversarial joint distributions.

Building blocks: :mod:`dloom.check.enumerate` (exact output distributions of the kernel),
:mod:`dloom.check.tiny` (tiny random models), :mod:`dloom.check.greedy`,
:mod:`dloom.check.sampling`, :mod:`dloom.check.target` (AR targets), :mod:`dloom.check.bounds`,
:mod:`dloom.check.joints`, :mod:`dloom.check.stats`, :mod:`dloom.check.kernel_claims` and
:mod:`dloom.check.uniform_claims` (the claims a transition kernel brings, tested on decodes); :mod:`dloom.check.pytest_plugin` gives plugin authors fixtures.
"""

from dloom.check.report import (
    EXIT_CODES,
    TARGET,
    CheckReport,
    assert_lossless,
    assert_sound,
    check_lossless,
    check_soundness,
    check_strategy,
)
from dloom.check.resolve import KERNEL

__all__ = [
    "EXIT_CODES",
    "KERNEL",
    "TARGET",
    "CheckReport",
    "assert_lossless",
    "assert_sound",
    "check_lossless",
    "check_soundness",
    "check_strategy",
]
