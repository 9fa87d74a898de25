"""The kernel's candidate and confidence computation."""

from __future__ import annotations

import pytest
import torch

from dloom.decode.kernel import apply_commit, propose

MASK = 4


def test_greedy_candidates_never_the_mask_token():
    logits = torch.tensor([[[0.0, 1.0, 2.0, 0.5, 9.0]]])
    candidates, confidence = propose(logits, 0.0, "low_confidence", None, MASK)
    assert candidates.tolist() == [[2]]
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 0.5], dtype=torch.float64), -1)[2]
    assert confidence.dtype == torch.float32  # the float32 pass (float32 logits, greedy)
    assert confidence.item() == pytest.approx(expected.item(), abs=1e-6)
    candidates, confidence = propose(logits.double(), 0.0, "low_confidence", None, MASK)
    assert candidates.tolist() == [[2]] and confidence.dtype == torch.float64
    assert confidence.item() == expected.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_the_float32_pass_matches_the_float64_kernel(dtype, remasking):
    """Greedy on lower-precision logits: the float32 pass gives the float64 kernel's
    candidates and confidences within 1e-6, the mask token excluded even where it is the
    largest logit, without a float64 copy of the logits."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 8, 500, generator=generator) * 4).to(dtype)
    logits[0, :, MASK] = 50.0  # the mask dominates these positions
    ours, ours_conf = propose(logits, 0.0, remasking, torch.Generator().manual_seed(1), MASK)
    reference, reference_conf = propose(logits.double(), 0.0, remasking, torch.Generator().manual_seed(1), MASK)
    assert torch.equal(ours, reference) and MASK not in ours.flatten().tolist()
    assert (ours_conf.double() - reference_conf).abs().max() < 1e-6


def test_non_finite_logits_reach_the_confidences():
    """The decoder's NaN check reads ``(B, K)``: a NaN or +inf anywhere in a position's
    vocabulary makes that position's confidence or candidate logit non-finite."""
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(2, 3, 50)
        logits[1, 2, 17] = bad
        candidates, confidence = propose(logits, 0.0, "low_confidence", None, MASK)
        picked = torch.gather(logits, -1, candidates.unsqueeze(-1)).squeeze(-1)
        finite = torch.isfinite(confidence) & torch.isfinite(picked)
        assert finite.tolist() == [[True] * 3, [True, True, False]]


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
