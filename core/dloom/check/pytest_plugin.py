"""dloom's pytest plugin, for plugin authors' test suites (entry point ``pytest11: dloom``).

Installed with dloom and active in every pytest run; it only defines fixtures, all prefixed
``dloom_``, and imports nothing heavy until a fixture is used:

* ``dloom_tiny_dllm``: a tiny random bidirectional dLLM in float64 (vocabulary 16; pad 0,
  mask 1, EOS 2), the model of ``dloom check``'s greedy test when the toy zoo is missing;
* ``dloom_enumerable_dllm``: a tiny dLLM small enough for exact enumeration (vocabulary 6);
* ``dloom_tiny_ar``: a tiny random causal next-token model (an AR target, no mask token);
* ``dloom_zoo_model``: a loader of the toy zoo's models in float64
  (``dloom_zoo_model("toy-ar-small")``), which skips the test when the model's weights are
  not installed; ``dloom_zoo_dllm`` and ``dloom_zoo_ar`` are ``toy-dllm`` and ``toy-ar``.

The assertion helpers are plain functions, importable from here or from :mod:`dloom.check`::

    from dloom.check import assert_lossless, assert_sound

    def test_my_rule_is_lossless():
        assert_lossless("my-rule", against="quota", samples=10_000)
"""

from __future__ import annotations

from typing import Any

import pytest

_HELPERS = ("assert_lossless", "assert_sound", "check_lossless", "check_soundness", "check_strategy")


def __getattr__(name: str) -> Any:  # lazy re-export: importing the plugin stays cheap
    if name in _HELPERS:
        import dloom.check

        return getattr(dloom.check, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@pytest.fixture
def dloom_tiny_dllm():
    """A float64 tiny random bidirectional dLLM (:class:`dloom.ModelAdapter`, vocab 16)."""
    from dloom.check.report import TINY_GREEDY
    from dloom.check.tiny import tiny_dllm

    return tiny_dllm(0, **TINY_GREEDY)


@pytest.fixture
def dloom_enumerable_dllm():
    """A float64 tiny dLLM with vocabulary 6, for :func:`dloom.check.enumerate.exact_distribution`."""
    from dloom.check.tiny import tiny_dllm

    return tiny_dllm(0)


@pytest.fixture
def dloom_tiny_ar():
    """A float64 tiny random causal model (no mask token; EOS 2, pad 0)."""
    from dloom.check.tiny import tiny_ar

    return tiny_ar(0)


@pytest.fixture
def dloom_zoo_model():
    """``load(name)``: the toy zoo's model ``name`` (:data:`dloom.zoo.MODEL_NAMES`) as a float64
    :class:`dloom.ModelAdapter`; skips the test when its weights are not installed."""
    from dloom import load_model
    from dloom.check.tiny import zoo_installed

    def load(name: str):
        if not zoo_installed(name):
            pytest.skip(f"{name} weights are not installed")
        return load_model(name, dtype="float64", require_mask=False)

    return load


@pytest.fixture
def dloom_zoo_dllm(dloom_zoo_model):
    """The toy zoo's ``toy-dllm`` in float64; skips the test when its weights are missing."""
    return dloom_zoo_model("toy-dllm")


@pytest.fixture
def dloom_zoo_ar(dloom_zoo_model):
    """The toy zoo's ``toy-ar`` (an AR target) in float64; skips the test when its weights are
    missing."""
    return dloom_zoo_model("toy-ar")
