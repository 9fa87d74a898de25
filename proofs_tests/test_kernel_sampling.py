"""The kernel samples exactly from softmax(logits / T).

Claim (``docs/concepts.md``, "The decode loop"): at temperature T > 0 the candidate of every
position is a draw from ``softmax(logits / T)`` with the mask token excluded; dloom's
log-space Gumbel-max equals LLaDA's ``argmax(exp(l) / (-log u) ** T)`` draw for draw. The
decoder's counter-based per-prompt streams (:class:`dloom.decode.kernel.RowStreams`) are such a
source of uniforms across a block's positions, across rows (prompts) and across the steps of
one prompt.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dloom.decode.kernel import RowStreams, propose

SAMPLES = 20_000
ALPHA = 1e-4  # per example; examples are derandomized, so the run is deterministic


def draw(logits: torch.Tensor, temperature: float, seed: int) -> np.ndarray:
    """``SAMPLES`` candidates for one position with the given ``(V,)`` logits."""
    batch = logits.to(torch.float64).expand(1, SAMPLES, -1).contiguous()
    generator = torch.Generator().manual_seed(seed)
    candidates, _ = propose(batch, temperature, "low_confidence", generator, mask_token_id=0)
    return np.bincount(candidates.flatten().numpy(), minlength=logits.shape[0])


def stream_draw(logits: torch.Tensor, temperature: float, seed: int, across: str) -> np.ndarray:
    """``SAMPLES`` candidates from the decoder's streams: one row's positions, one position of
    ``SAMPLES`` rows, or one position of one prompt at ``SAMPLES`` successive steps."""
    if across == "positions":
        batch = logits.to(torch.float64).expand(1, SAMPLES, -1).contiguous()
        streams = RowStreams(seed, torch.tensor([0]))
    else:
        batch = logits.to(torch.float64).expand(SAMPLES, 1, -1).contiguous()
        rows = torch.arange(SAMPLES)
        streams = RowStreams(seed, rows if across == "rows" else torch.zeros_like(rows))
        if across == "steps":
            streams.draws = rows  # row n holds the prompt's n-th step
    candidates, _ = propose(batch, temperature, "low_confidence", streams, mask_token_id=0)
    return np.bincount(candidates.flatten().numpy(), minlength=logits.shape[0])


def target(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """softmax(logits / T) over the non-mask tokens (mask id 0 gets probability 0)."""
    scaled = logits.to(torch.float64) / temperature
    scaled[0] = -torch.inf
    return torch.softmax(scaled, dim=-1).numpy()


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a zero-probability token (the mask) was sampled"
    expected = probs[keep] * counts.sum()
    return stats.chisquare(counts[keep], expected).pvalue


logit_vectors = st.lists(
    st.floats(min_value=-3.0, max_value=3.0, allow_nan=False), min_size=3, max_size=7
).map(lambda xs: torch.tensor(xs, dtype=torch.float64))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(logits=logit_vectors, temperature=st.floats(0.3, 2.0), seed=st.integers(0, 2**31 - 1))
def test_gumbel_max_samples_the_tempered_softmax(logits, temperature, seed):
    counts = draw(logits, temperature, seed)
    assert chi_square_p(counts, target(logits, temperature)) > ALPHA


@settings(max_examples=25, deadline=None, derandomize=True)
@given(logits=logit_vectors, temperature=st.floats(0.3, 2.0), seed=st.integers(0, 2**31 - 1))
def test_log_space_draws_equal_lladas_formula(logits, temperature, seed):
    batch = logits.expand(1, 64, -1).contiguous()
    ours, _ = propose(batch, temperature, "low_confidence", torch.Generator().manual_seed(seed), 0)
    uniform = torch.rand(batch.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    masked = batch.clone()
    masked[..., 0] = -torch.inf
    llada = torch.argmax(masked.exp() / (-torch.log(uniform)) ** temperature, dim=-1)
    assert torch.equal(ours, llada)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    logits=logit_vectors, temperature=st.floats(0.3, 2.0), seed=st.integers(0, 2**62),
    across=st.sampled_from(["positions", "rows", "steps"]),
)
def test_per_prompt_streams_sample_the_tempered_softmax(logits, temperature, seed, across):
    counts = stream_draw(logits, temperature, seed, across)
    assert chi_square_p(counts, target(logits, temperature)) > ALPHA


def test_negative_control_a_stream_that_does_not_advance_is_detected():
    """Steps that reuse one draw (the counter never advances) repeat one candidate."""
    logits = torch.tensor([0.0, 1.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    batch = logits.expand(SAMPLES, 1, -1).contiguous()
    stuck = RowStreams(7, torch.zeros(SAMPLES, dtype=torch.long))
    candidates, _ = propose(batch, 1.0, "low_confidence", stuck, mask_token_id=0)
    counts = np.bincount(candidates.flatten().numpy(), minlength=5)
    assert chi_square_p(counts, target(logits, 1.0)) < ALPHA


def test_negative_control_untempered_sampler_is_detected():
    """Sampling softmax(logits) while claiming T = 0.5 is rejected by the same test."""
    logits = torch.tensor([0.0, 1.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    counts = draw(logits, 1.0, seed=7)  # a sampler that forgot the temperature
    assert chi_square_p(counts, target(logits, 0.5)) < ALPHA
