"""The hook timer: dloom's own ``wrapper=True`` plugin that adds up each decoding hook's
wall time (a result's ``hook_seconds`` and ``hook_share``).

Timings are host wall-clock; on an asynchronous device (CUDA) a hook's time is the time to
launch its work unless the decoder synchronizes (``sync_timing=True``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from dloom.hooks.specs import DECODING_HOOKS, PROJECT_NAME, hookimpl


class HookTimer:
    """A ``wrapper=True`` plugin that adds up the wall time of every decoding hook call, by
    the hook's name without its ``dloom_`` prefix (one wrapper per
    :data:`dloom.hooks.specs.DECODING_HOOKS`)."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._synchronize = synchronize or (lambda: None)

    def reset(self) -> None:
        """Forget the seconds added up so far."""
        self.seconds.clear()

    def _timed(self, name: str):  # generator used by each wrapper
        self._synchronize()
        start = time.perf_counter()
        try:
            result = yield
        finally:
            self._synchronize()
            self.seconds[name] += time.perf_counter() - start
        return result


def _timing_wrapper(hook: str) -> Callable[[HookTimer], Any]:
    name = hook.removeprefix(f"{PROJECT_NAME}_")

    def wrapper(self: HookTimer):
        return (yield from self._timed(name))

    wrapper.__name__ = wrapper.__qualname__ = hook
    return hookimpl(wrapper=True)(wrapper)


for _hook in DECODING_HOOKS:
    setattr(HookTimer, _hook, _timing_wrapper(_hook))
