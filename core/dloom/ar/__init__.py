"""Speculation against an autoregressive target: a dLLM drafts token chains, the target verifies.

* :mod:`dloom.ar.target`: :class:`~dloom.ar.target.ARTarget`, a causal LM with its KV cache.
* :mod:`dloom.ar.decoder`: :class:`~dloom.ar.decoder.ARTargetDecoder`, the decode loop.
* :mod:`dloom.ar.chains`: sampling the target, laying chains out for one target forward,
  greedy-match verification.
* :mod:`dloom.ar.result`: what one AR-target generation returns.
"""


def __getattr__(name: str) -> object:
    """A name of the old module ``dloom.ar`` (now :mod:`dloom.ar.target`), found here for one release
    with a ``DeprecationWarning`` (:func:`dloom.old_paths.old_attribute`)."""
    from dloom.old_paths import old_attribute

    return old_attribute(__name__, name)
