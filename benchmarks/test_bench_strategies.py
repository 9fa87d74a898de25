"""pytest-benchmark suites: per-hook micro-benchmarks and end-to-end decoding per strategy.

Run (not part of the default test run)::

    python -m pytest benchmarks/test_bench_strategies.py --benchmark-json benchmarks/results/bench.json
    python -m pytest benchmarks/test_bench_strategies.py --benchmark-compare   # against the last saved run

End-to-end benchmarks decode the toy zoo's ``toy-dllm`` when its weights are present, else a
tiny random model; each records NFE and tokens per forward in ``extra_info`` so a JSON report
carries them next to the timings.
"""

from __future__ import annotations

import pytest
import torch

from dloom import BlockSchedule, DiffusionDecoder, ModelAdapter, load_model
from dloom.registry import get_registry
from dloom.zoo import model_path
from dloom.zoo.tasks import held_out

COMMIT_RULES = ["quota", "threshold", "factor", "frechet"]


def commit_rule(name: str):
    return get_registry().get(name).build(
        **{p.name: p.default for p in get_registry().get(name).parameters}
    )


@pytest.mark.parametrize("name", COMMIT_RULES)
def test_select_commit(benchmark, name):
    """One ``dloom_select_commit`` call on a (64, 32) block of random confidences."""
    generator = torch.Generator().manual_seed(0)
    confidence = torch.rand(64, 32, dtype=torch.float64, generator=generator)
    selectable = torch.rand(64, 32, generator=generator) < 0.7
    schedule = BlockSchedule(0, 32, selectable.sum(-1))
    rule = commit_rule(name)
    commit = benchmark(rule.dloom_select_commit, confidence=confidence, selectable=selectable, schedule=schedule)
    assert (commit & ~selectable).sum() == 0


@pytest.fixture(scope="module")
def model() -> ModelAdapter:
    if (model_path("toy-dllm") / "config.json").exists():
        return load_model("toy-dllm")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=57, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, is_causal=False,
                         initializer_range=0.5, max_position_embeddings=128)
    return ModelAdapter(LlamaForCausalLM(config).eval(), mask_token_id=1, eos_token_ids=(2,),
                        pad_token_id=0, default_gen_length=32, name="tiny-random")


@pytest.mark.parametrize("name", COMMIT_RULES)
def test_decode(benchmark, model, name):
    """Decode 32 held-out prompts (or random ids without a tokenizer) with each rule."""
    examples = held_out(32)
    prompts = [e.prompt for e in examples] if model.tokenizer is not None else [[5, 6, 7, 8]] * 32
    decoder = DiffusionDecoder(model, name)
    result = benchmark.pedantic(decoder.generate, args=(prompts,), rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(
        model=model.name, nfe_mean=float(result.nfe.double().mean()), tpf=result.tpf,
        hook_share=result.hook_share,
    )
