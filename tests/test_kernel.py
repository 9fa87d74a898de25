"""The kernel's candidate and confidence computation."""

from __future__ import annotations

import pytest
import torch

from dloom.kernel import apply_commit, propose

MASK = 4


def test_greedy_candidates_never_the_mask_token():
    logits = torch.tensor([[[0.0, 1.0, 2.0, 0.5, 9.0]]])
    candidates, confidence = propose(logits, 0.0, "low_confidence", None, MASK)
    assert candidates.tolist() == [[2]]
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 0.5], dtype=torch.float64), -1)[2]
    assert confidence.dtype == torch.float64
    assert confidence.item() == pytest.approx(expected.item())


def test_margin_and_entropy():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2, 1e-30, 1e-30]]], dtype=torch.float64))
    _, margin = propose(logits, 0.0, "margin", None, MASK)
    assert margin.item() == pytest.approx(0.2, abs=1e-9)
    _, entropy = propose(logits, 0.0, "entropy", None, MASK)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert entropy.item() == pytest.approx(float((p * p.log()).sum()), abs=1e-9)


def test_sampling_matches_softmax_frequencies():
    logits = torch.log(torch.tensor([[[0.6, 0.3, 0.1, 0.0, 0.0]]], dtype=torch.float64).clamp_min(1e-300))
    logits = logits.expand(1, 20000, 5).contiguous()
    generator = torch.Generator().manual_seed(0)
    candidates, _ = propose(logits, 1.0, "low_confidence", generator, MASK)
    freq = torch.bincount(candidates.flatten(), minlength=5).double() / candidates.numel()
    assert freq[:3].tolist() == pytest.approx([0.6, 0.3, 0.1], abs=0.015)


def test_temperature_sharpens_sampling():
    logits = torch.log(torch.tensor([[[0.6, 0.4, 1e-30, 1e-30, 1e-30]]], dtype=torch.float64)).expand(1, 20000, 5)
    generator = torch.Generator().manual_seed(1)
    candidates, _ = propose(logits, 0.5, "low_confidence", generator, MASK)
    share = (candidates == 0).double().mean().item()
    assert share == pytest.approx(0.36 / (0.36 + 0.16), abs=0.015)  # softmax(logits / 0.5)


def test_random_remasking_draws_uniform_confidence():
    logits = torch.zeros(2, 3, 5)
    generator = torch.Generator().manual_seed(0)
    _, confidence = propose(logits, 0.0, "random", generator, MASK)
    assert confidence.shape == (2, 3) and ((confidence > 0) & (confidence < 1)).all()


def test_apply_commit():
    block = torch.tensor([[MASK, MASK, 7]])
    out = apply_commit(block, torch.tensor([[1, 2, 3]]), torch.tensor([[True, False, False]]))
    assert out.tolist() == [[1, MASK, 7]]
