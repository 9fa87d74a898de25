"""The transition-kernel seam: the model's profile chooses the kernel, the session steps
through it alone, and a strategy paired with a kernel it does not support is refused when
the decoder is built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dloom
from dloom.decode import transition
from dloom.decode.kernel import KernelStep
from dloom.errors import ConfigurationError, ModelError
from dloom.hooks.registry import get_registry
from dloom.model.profiles import ModelProfile


class CountingKernel(KernelStep):
    """The absorbing kernel under another name, counting the session's calls."""

    calls: list[str] = []

    def __call__(self, block, logits, advance):
        CountingKernel.calls.append("step")
        return super().__call__(block, logits, advance)

    def settle(self, block):
        CountingKernel.calls.append("settle")
        return super().settle(block)


def test_every_profile_names_a_kernel_dloom_has():
    for profile in (*(family.profile for family in get_registry().families), ModelProfile("x", "x")):
        assert profile.kernel in transition.KERNELS


def test_the_session_steps_with_the_kernel_the_model_names(sharp_adapter, monkeypatch):
    monkeypatch.setitem(transition.KERNELS, "counting", CountingKernel)
    monkeypatch.setattr(CountingKernel, "calls", [])
    prompts = [[5, 6, 7], [8, 9]]
    reference = dloom.DiffusionDecoder(sharp_adapter, "threshold", gen_length=8, block_length=4).generate(prompts)
    assert CountingKernel.calls == []
    counting = dataclasses.replace(sharp_adapter, kernel="counting")
    registry = dloom.hooks.registry.get_registry()
    threshold = registry.get("threshold")
    supported = dataclasses.replace(threshold.registration, kernels=("absorbing", "counting"))
    monkeypatch.setitem(registry.strategies, "threshold", dataclasses.replace(threshold, registration=supported))
    result = dloom.DiffusionDecoder(counting, "threshold", gen_length=8, block_length=4).generate(prompts)
    assert torch.equal(result.sequences, reference.sequences) and torch.equal(result.nfe, reference.nfe)
    assert CountingKernel.calls.count("step") == int(result.forwards)
    assert CountingKernel.calls.count("settle") == int(result.forwards)


def test_a_strategy_is_refused_on_a_kernel_it_does_not_support(sharp_adapter, monkeypatch):
    monkeypatch.setitem(transition.KERNELS, "counting", CountingKernel)
    counting = dataclasses.replace(sharp_adapter, kernel="counting")
    with pytest.raises(ConfigurationError, match="strategy 'threshold' supports the 'absorbing', 'revisable' kernel.*not the model's 'counting'"):
        dloom.DiffusionDecoder(counting, "threshold", gen_length=8, block_length=4)


def test_a_kernel_dloom_does_not_have_is_refused_naming_the_ones_it_has(sharp_adapter):
    unknown = dataclasses.replace(sharp_adapter, kernel="levenshtein")
    with pytest.raises(ModelError, match="decodes with the 'levenshtein' kernel; dloom has absorbing, revisable, uniform"):
        dloom.DiffusionDecoder(unknown, "quota", gen_length=8, block_length=4)


def test_a_loaded_model_carries_its_profiles_kernel(tiny_model_dir):
    assert dloom.load_model(tiny_model_dir).kernel == "absorbing"
