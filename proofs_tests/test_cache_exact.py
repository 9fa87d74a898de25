"""Prefix and dual KV caching are exact for block-causal models.

Claim (``docs/concepts.md``, "KV caching"): in a block-causal dLLM (full attention inside
a block, causal across blocks, the prompt seen by all) nothing before the active block
attends to it and the block attends to nothing after it. So the keys and values the
block-start forward computes for the positions before the block are the ones every later
step of the block would compute, and those after the block are never read by the block:
prefix-cached and dual-cached decoding give the uncached tokens, bit for bit in float64
(greedy), and the same draws under seeded sampling. Negative controls: a cache whose prefix
is never refreshed across blocks, and one that feeds positions off by one, are caught by
the same comparison.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from dloom import DiffusionDecoder, ModelAdapter
from dloom.decode import session as running_batch
from dloom.model.runner import BlockForward

VOCAB, MASK_ID, EOS_ID, PAD_ID = 40, 39, 2, 0
GEN_LENGTH = 16
# Tiny forwards run fastest on one thread, and do not stall when the machine is busy.
torch.set_num_threads(1)

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18], [20, 21, 22, 23, 24, 25, 26, 27]]


@cache
def block_causal_model(seed: int, attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    """A tiny float64 Llama without causal masking; its output head is sharpened and EOS is
    made likely, so that confidences spread out and rows stop early (row compaction)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
        initializer_range=0.5, is_causal=False, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, attn_implementation=attn_implementation,
    )
    model = LlamaForCausalLM(config).eval().to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
        model.lm_head.weight[EOS_ID].mul_(1.5)
    return model


def adapter(seed: int = 0, *, shift: bool = False, attn_implementation: str = "sdpa") -> ModelAdapter:
    return ModelAdapter(
        block_causal_model(seed, attn_implementation), mask_token_id=MASK_ID,
        eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID, shift_logits=shift,
        attention="block-causal", max_context=96, name=f"block-causal-{seed}",
    )


def decode(model: ModelAdapter, mode: str, prompts, **options):
    options = {"gen_length": GEN_LENGTH, "block_length": 4, **options}
    return DiffusionDecoder(model, cache=mode, **options).generate(prompts)


def assert_same(cached, uncached) -> None:
    assert cached.token_lists == uncached.token_lists
    assert torch.equal(cached.sequences, uncached.sequences)
    assert cached.nfe.tolist() == uncached.nfe.tolist()
    assert cached.forwards == uncached.forwards


@pytest.mark.parametrize("strategy", ["quota", "threshold"])
@pytest.mark.parametrize("block_length", [2, 4, 16])
def test_cached_decoding_is_token_identical(strategy, block_length):
    early_stops = 0
    for seed in range(3):
        model = adapter(seed)
        uncached = decode(model, "none", PROMPTS, strategy=strategy, block_length=block_length)
        for mode in ("prefix", "dual"):
            cached = decode(model, mode, PROMPTS, strategy=strategy, block_length=block_length)
            assert_same(cached, uncached)
        early_stops += int((uncached.generated_lengths < GEN_LENGTH).sum())
    assert early_stops > 0  # rows finished early, so blocks ran on compacted batches


def test_exact_with_several_tokens_per_step_and_sampling():
    model = adapter(1)
    for options in (
        {"strategy": "quota", "steps": 8},
        {"strategy": "factor"},
        {"strategy": "quota", "temperature": 1.0, "seed": 7},
        {"strategy": "threshold", "temperature": 0.7, "seed": 3, "tau": 0.5},
    ):
        uncached = decode(model, "none", PROMPTS, **options)
        for mode in ("prefix", "dual"):
            assert_same(decode(model, mode, PROMPTS, **options), uncached)


def test_exact_for_shifted_logits_and_eager_attention():
    for model in (adapter(2, shift=True), adapter(2, attn_implementation="eager")):
        uncached = decode(model, "none", PROMPTS, strategy="threshold")
        for mode in ("prefix", "dual"):
            assert_same(decode(model, mode, PROMPTS, strategy="threshold"), uncached)


def test_eager_and_sdpa_masks_agree():
    """The eager (additive) form of the block-causal mask decodes like the SDPA (bool) form."""
    sdpa, eager = adapter(0), adapter(0, attn_implementation="eager")
    assert decode(sdpa, "prefix", PROMPTS).token_lists == decode(eager, "prefix", PROMPTS).token_lists


prompt_lists = st.lists(
    st.lists(st.integers(3, VOCAB - 2), min_size=1, max_size=9), min_size=1, max_size=5
)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    prompts=prompt_lists, seed=st.integers(0, 2), block_length=st.sampled_from([2, 4, 8]),
    strategy=st.sampled_from(["quota", "threshold", "factor"]), mode=st.sampled_from(["prefix", "dual"]),
)
def test_cached_decoding_is_token_identical_for_any_prompts(prompts, seed, block_length, strategy, mode):
    model = adapter(seed)
    uncached = decode(model, "none", prompts, strategy=strategy, block_length=block_length)
    assert_same(decode(model, mode, prompts, strategy=strategy, block_length=block_length), uncached)


# --- negative controls: broken caches are caught by the same comparison -------------------


def never_refreshed(prompt_len: int) -> type[BlockForward]:
    """A cache whose keys and values are those of the all-masks state of the first block: the
    block-start forward still gives the right first step, but the decoded blocks before the
    active one are never written into the cache."""

    class NeverRefreshed(BlockForward):
        def _full_forward(self, tokens, rows, every, keep=None):
            logits = super()._full_forward(tokens, rows, every, keep)
            stale = tokens.clone()
            stale[:, prompt_len:] = MASK_ID
            super()._full_forward(stale, rows, every, keep)
            return logits

    return NeverRefreshed


class OffByOnePositions(BlockForward):
    """Cached steps feed the recomputed window position ids one too high."""

    def _window_forward(self, tokens, rows, first_window):
        correct = self.position_ids
        self.position_ids = correct + 1
        try:
            return super()._window_forward(tokens, rows, first_window)
        finally:
            self.position_ids = correct


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("broken", ["never_refreshed", "off_by_one"])
def test_broken_caches_are_detected(monkeypatch, mode, broken):
    width = max(len(p) for p in PROMPTS)
    variant = never_refreshed(width) if broken == "never_refreshed" else OffByOnePositions
    differs = []
    for seed in range(3):
        model = adapter(seed)
        uncached = decode(model, "none", PROMPTS, strategy="quota")
        with monkeypatch.context() as patch:
            patch.setattr(running_batch, "BlockForward", variant)
            cached = decode(model, mode, PROMPTS, strategy="quota")
        differs.append(cached.token_lists != uncached.token_lists)
    assert any(differs)
