"""The reference diffusion decoder against an independent plain LLaDA loop, batching,
per-row early stop and metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import EOS_ID, MASK_ID, PAD_ID
from dloom import DiffusionDecoder, ModelAdapter
from dloom.decode.kernel import RowStreams
from dloom.errors import ConfigurationError


def llada_generate(model, prompt, *, steps, gen_length, block_length, temperature, remasking, generator):
    """A plain transcription of LLaDA's reference ``generate`` loop (batch of one).

    Differences, matching dloom's documented conventions: Gumbel noise and ``random``
    remasking draws cover the active block only and come from ``generator``, a
    :class:`dloom.decode.kernel.RowStreams` (draw ``n`` at the ``n``-th step, the Gumbel noise
    tagged 0 and the random confidences 1), and the mask token is never a candidate.
    """
    x = torch.full((1, len(prompt) + gen_length), MASK_ID, dtype=torch.long)
    x[0, : len(prompt)] = torch.tensor(prompt)
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for b in range(num_blocks):
        start = len(prompt) + b * block_length
        end = start + block_length
        block_mask = x[:, start:end] == MASK_ID
        mask_num = block_mask.sum(dim=1, keepdim=True)
        num_transfer = torch.zeros(1, steps_per_block, dtype=torch.long) + mask_num // steps_per_block
        for i in range(int((mask_num % steps_per_block)[0, 0])):
            num_transfer[0, i] += 1
        for i in range(steps_per_block):
            mask_index = x == MASK_ID
            with torch.no_grad():
                logits = model(input_ids=x).logits[:, start:end].to(torch.float64)
            logits[..., MASK_ID] = -torch.inf
            if temperature > 0:
                noise = generator.uniform(tuple(logits.shape), 0)
                x0 = torch.argmax(logits.exp() / (-torch.log(noise)) ** temperature, dim=-1)
            else:
                x0 = torch.argmax(logits, dim=-1)
            if remasking == "low_confidence":
                p = F.softmax(logits, dim=-1)
                x0_p = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
            else:
                x0_p = generator.uniform(tuple(x0.shape), 1)
            block_masked = mask_index[:, start:end]
            x0 = torch.where(block_masked, x0, x[:, start:end])
            confidence = torch.where(block_masked, x0_p, torch.tensor(-torch.inf, dtype=torch.float64))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            _, select = torch.topk(confidence[0], k=int(num_transfer[0, i]))
            transfer[0, select] = True
            x[:, start:end][transfer] = x0[transfer]
            if generator is not None:
                generator.advance(torch.tensor([True]))
    return x[0, len(prompt):].tolist()


def until_eos(tokens):
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


@pytest.mark.parametrize(
    "temperature,remasking,steps",
    [(0.0, "low_confidence", 16), (0.0, "low_confidence", 8), (1.0, "low_confidence", 16),
     (0.7, "random", 8), (0.0, "random", 16)],
)
def test_quota_reproduces_plain_llada_loop(tiny_adapter, temperature, remasking, steps):
    for seed, prompt in enumerate([[5, 6, 7], [11, 12, 13, 14, 15], [20]]):
        decoder = DiffusionDecoder(
            tiny_adapter, "quota", gen_length=16, block_length=4, steps=steps,
            temperature=temperature, remasking=remasking, seed=seed,
        )
        ours = decoder.generate([prompt]).token_lists[0]
        reference = llada_generate(
            tiny_adapter.model, prompt, steps=steps, gen_length=16, block_length=4,
            temperature=temperature, remasking=remasking,
            generator=RowStreams(seed, torch.tensor([0])),
        )
        assert ours == until_eos(reference)


def test_reference_test_detects_a_different_schedule(tiny_adapter):
    """Negative control: the comparison above is sensitive (two tokens per step differs)."""
    prompt = [5, 6, 7]
    reference = llada_generate(
        tiny_adapter.model, prompt, steps=16, gen_length=16, block_length=4,
        temperature=0.0, remasking="low_confidence", generator=None,
    )
    fewer_steps = DiffusionDecoder(tiny_adapter, "quota", gen_length=16, block_length=4, steps=4)
    assert fewer_steps.generate([prompt]).token_lists[0] != until_eos(reference)


@pytest.mark.parametrize("strategy", ["quota", "threshold", "factor"])
def test_batch_rows_equal_single_decodes(sharp_adapter, strategy):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18]]
    decoder = DiffusionDecoder(sharp_adapter, strategy, gen_length=16, block_length=8)
    batch = decoder.generate(prompts)
    for index, prompt in enumerate(prompts):
        alone = decoder.generate([prompt])
        assert batch.token_lists[index] == alone.token_lists[0]
        assert int(batch.nfe[index]) == int(alone.nfe[0])


def test_padded_tensor_input_equals_lists(sharp_adapter):
    decoder = DiffusionDecoder(sharp_adapter, "threshold", gen_length=8, block_length=8)
    ids = torch.tensor([[PAD_ID, PAD_ID, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    from_tensor = decoder.generate(ids, attention_mask=mask)
    from_lists = decoder.generate([[5, 6], [7, 8, 9, 10]])
    assert from_tensor.token_lists == from_lists.token_lists


class ScriptedModel(torch.nn.Module):
    """Fixed position-dependent logits; offsets 0 and 1 are confident, and rows whose prompt
    starts with 7 put a near-certain EOS at offset 2. Records every forward's batch size."""

    def __init__(self, prompt_len: int, vocab: int = 40) -> None:
        super().__init__()
        self.prompt_len = prompt_len
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        generator = torch.Generator().manual_seed(0)
        self.table = torch.randn(64, vocab, generator=generator, dtype=torch.float64)
        self.table[:, EOS_ID] = -10.0
        self.table[prompt_len : prompt_len + 2, 4] = 20.0  # offsets 0 and 1 are confident
        self.batch_sizes: list[int] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        self.batch_sizes.append(input_ids.shape[0])
        logits = self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1).clone()
        early = input_ids[:, 0] == 7
        logits[early, self.prompt_len + 2, EOS_ID] = 50.0
        return SimpleNamespace(logits=logits)


def test_early_stop_freezes_row_and_stops_its_nfe():
    model = ScriptedModel(prompt_len=3)
    adapter = ModelAdapter(model, mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID)
    decoder = DiffusionDecoder(adapter, "quota", gen_length=16, block_length=8)
    result = decoder.generate([[7, 1, 1], [8, 1, 1]])
    # Row 0 commits EOS at offset 2 first, then offsets 0 and 1: finished after 3 forwards.
    assert result.nfe.tolist() == [3, 16]
    assert result.generated_lengths.tolist() == [3, 16]
    assert result.token_lists[0][-1] == EOS_ID and len(result.token_lists[0]) == 3
    # Its remaining positions were never decoded, and it left the batch at once (not at the
    # end of its block): no forward was spent on it after its third.
    assert (result.generated[0, 3:] == MASK_ID).all()
    assert model.batch_sizes == [2] * 3 + [1] * 13
    assert result.forwards == 16 and result.row_forwards == 19 == int(result.nfe.sum())
    # Decoding the finished row alone gives the same tokens.
    alone = decoder.generate([[7, 1, 1]])
    assert alone.token_lists[0] == result.token_lists[0] and alone.forwards == 3


def test_metrics_and_config(sharp_adapter):
    decoder = DiffusionDecoder(sharp_adapter, "threshold", tau=0.5, gen_length=16, block_length=8, seed=1)
    result = decoder.generate([[5, 6, 7], [8, 9]])
    summary = result.summary()
    assert summary["n"] == 2
    assert result.tpf == pytest.approx(result.total_generated / int(result.nfe.sum()))
    assert result.tps > 0 and result.wall_seconds > 0
    assert set(result.hook_seconds) >= {"forward", "select_commit"}
    assert 0 < sum(result.hook_share.values()) <= 1.0 + 1e-9
    assert summary["config"]["strategy"] == "threshold"
    assert summary["config"]["params"] == {"threshold": {"tau": 0.5}}
    row = result.row(0)
    assert set(row) == {"text", "tokens", "nfe", "tpf", "tps", "speculation", "config"}


def test_threshold_needs_fewer_forwards_than_one_token_per_step(sharp_adapter):
    prompts = [[5, 6, 7], [8, 9, 10]]
    quota = DiffusionDecoder(sharp_adapter, "quota", gen_length=16, block_length=8).generate(prompts)
    fast = DiffusionDecoder(sharp_adapter, "threshold", tau=0.5, gen_length=16, block_length=8).generate(prompts)
    assert int(quota.nfe.sum()) == 32
    assert int(fast.nfe.sum()) < 32


def test_seeded_sampling_is_reproducible(tiny_adapter):
    def run(seed):
        decoder = DiffusionDecoder(tiny_adapter, "quota", gen_length=8, block_length=8, temperature=1.0, seed=seed)
        return decoder.generate([[5, 6, 7], [9, 9]]).token_lists

    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.parametrize("remasking", ["margin", "entropy"])
def test_dream_confidences_decode(tiny_adapter, remasking):
    decoder = DiffusionDecoder(tiny_adapter, "quota", gen_length=8, block_length=4, remasking=remasking)
    result = decoder.generate([[5, 6, 7]])
    assert len(result.token_lists[0]) >= 1 and MASK_ID not in result.token_lists[0]


def test_shifted_logits_use_previous_position(tiny_adapter):
    shifted = ModelAdapter(
        tiny_adapter.model, mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        shift_logits=True,
    )
    ids = torch.tensor([[5, 6, 7, MASK_ID]])
    plain = tiny_adapter.logits(ids)
    moved = shifted.logits(ids)
    assert torch.equal(moved[:, 1:], plain[:, :-1])


# --- per-row block progression ------------------------------------------------------------

MIXED = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18], [19, 20, 21, 22, 23, 24, 25, 26, 27]]


def eos_prone(seed: int = 1, eos: float = 1.3) -> ModelAdapter:
    """A sharpened float64 tiny model with EOS made likely: rows stop at different times."""
    from conftest import sharpen, tiny_model

    model = sharpen(tiny_model(seed=seed, initializer_range=0.5))
    with torch.no_grad():
        model.lm_head.weight[EOS_ID].mul_(eos)
    return ModelAdapter(
        model, mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        max_context=96, name=f"eos-prone-{seed}",
    )


def assert_rows_equal_alone(decoder, prompts, batch):
    for index, prompt in enumerate(prompts):
        alone = decoder.generate([prompt])
        assert batch.token_lists[index] == alone.token_lists[0], index
        assert int(batch.nfe[index]) == int(alone.nfe[0]), index


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize(
    "strategy, params",
    [("quota", {"steps": 8}), ("threshold", {"tau": 0.6}), ("factor", {}), ("frechet", {})],
)
def test_rows_advance_through_blocks_on_their_own(strategy, params, cache):
    """Mixed prompt lengths and a rule whose steps per block differ per row: every row of the
    batch decodes as it does alone (tokens and NFE), rows are seen in different blocks in
    one forward, and no row-forward is spent on a row that takes no step."""
    adapter = eos_prone()
    steps = params.pop("steps", None)
    decoder = DiffusionDecoder(
        adapter, strategy, gen_length=16, block_length=4, steps=steps, cache=cache, params=params
    )
    blocks_seen = []
    batch = decoder.generate(MIXED, observer=lambda record: blocks_seen.append(record.block.tolist()))
    assert_rows_equal_alone(decoder, MIXED, batch)
    assert batch.row_forwards == int(batch.nfe.sum())  # no idle row in any forward
    if strategy != "quota":
        assert any(len(set(blocks)) > 1 for blocks in blocks_seen)  # rows in different blocks
    assert batch.forwards == max(batch.nfe.tolist())  # the batch takes its slowest row's steps


def test_a_finished_row_leaves_the_batch_before_its_block_ends():
    """One block of 16, one token per step: rows that finish early leave at once, so each
    forward's batch holds exactly the rows still decoding."""
    adapter = eos_prone(eos=1.8)
    sizes = []
    adapter.model.register_forward_pre_hook(
        lambda _, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    decoder = DiffusionDecoder(adapter, "quota", gen_length=16, block_length=16)
    batch = decoder.generate(MIXED)
    assert any(n < 16 for n in batch.nfe.tolist())  # some row left in the middle of its block
    assert sizes == [sum(1 for n in batch.nfe.tolist() if n > step) for step in range(16)]


@pytest.mark.parametrize("cache, layout", [("none", "rows"), ("prefix", "rows"), ("dual", "packed")])
def test_spiffy_rows_draft_and_verify_on_their_own_blocks(cache, layout):
    """Spiffy over threshold with per-row blocks: every row equals its own plain threshold
    decoding (lossless), in the batch and alone."""
    adapter = eos_prone()
    settings = dict(gen_length=16, block_length=4, cache=cache)
    with pytest.warns(UserWarning, match="uncalibrated default graph"):
        spiffy = DiffusionDecoder(adapter, "spiffy+threshold", layout=layout, tau=0.6, budget=10, **settings)
    plain = DiffusionDecoder(adapter, "threshold", tau=0.6, **settings)
    batch = spiffy.generate(MIXED)
    assert batch.accepted_drafts > 0
    reference = plain.generate(MIXED)
    assert batch.token_lists == reference.token_lists
    for index, prompt in enumerate(MIXED):
        assert spiffy.generate([prompt]).token_lists[0] == batch.token_lists[index]


# --- per-prompt random streams -------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["quota", "threshold"])
def test_a_seeded_sample_does_not_depend_on_the_batch_size(tiny_adapter, strategy):
    """Eight prompts (four distinct, each twice) decoded in batches of 1, 3 and 8 with
    ``row_offset`` set to each batch's first index: the same samples whatever the batching;
    two copies of a prompt take different samples (their streams differ)."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]] * 2
    decoder = DiffusionDecoder(
        tiny_adapter, strategy, gen_length=8, block_length=4, temperature=1.0, seed=11
    )

    def in_batches(size):
        out = []
        for first in range(0, len(prompts), size):
            out += decoder.generate(prompts[first : first + size], row_offset=first).token_lists
        return out

    whole = in_batches(8)
    assert in_batches(1) == whole and in_batches(3) == whole
    assert whole[:4] != whole[4:]  # copies of a prompt are independent samples
    same_prompt = decoder.generate([[5, 6, 7]] * 8).token_lists
    assert len({tuple(t) for t in same_prompt}) > 4
    other_seed = DiffusionDecoder(tiny_adapter, strategy, gen_length=8, block_length=4, temperature=1.0, seed=12)
    assert other_seed.generate(prompts).token_lists != whole


def test_row_offset_gives_each_prompt_its_own_stream(tiny_adapter):
    """A sequence of stream indices, one per prompt: ``generate([a, b], row_offset=[5, 2])``
    samples ``a`` from stream 5 and ``b`` from stream 2, as decoding each alone does (the
    server batches prompts of different requests this way); the int form would differ."""
    a, b = [5, 6, 7], [8, 9]
    decoder = DiffusionDecoder(tiny_adapter, "quota", gen_length=8, block_length=4, temperature=1.0, seed=11)
    together = decoder.generate([a, b], row_offset=[5, 2]).token_lists
    alone = [decoder.generate([a], row_offset=5).token_lists[0], decoder.generate([b], row_offset=2).token_lists[0]]
    assert together == alone
    assert decoder.generate([a, b], row_offset=torch.tensor([5, 2])).token_lists == alone
    assert decoder.generate([a, b], row_offset=5).token_lists[1] != alone[1]  # stream 6, not 2
    assert decoder.generate([a], row_offset=4).token_lists[0] != alone[0]  # the index matters


@pytest.mark.parametrize("row_offset, message", [
    ([1], "row_offset has 1 stream indices for 2 prompts"),
    ([1, 2, 3], "row_offset has 3 stream indices for 2 prompts"),
    ([0, -1], r"row_offset \[0, -1\] has a negative stream index"),
    (-1, "row_offset is -1; allowed: an int >= 0"),
    ([0.5, 1.0], r"row_offset is \[0.5, 1.0\]; allowed"),
    ([[0, 1]], r"row_offset is \[\[0, 1\]\]; allowed"),
])
def test_a_bad_row_offset_is_refused(tiny_adapter, row_offset, message):
    decoder = DiffusionDecoder(tiny_adapter, "quota", gen_length=8, block_length=4, temperature=1.0, seed=11)
    with pytest.raises(ConfigurationError, match=message):
        decoder.generate([[5, 6, 7], [8, 9]], row_offset=row_offset)


def test_row_streams_are_distinct_and_reproducible():
    streams = RowStreams(3, torch.arange(4))
    first = streams.uniform((4, 2, 50), 0)
    assert torch.equal(first, RowStreams(3, torch.arange(4)).uniform((4, 2, 50), 0))
    assert first.min() > 0 and first.max() < 1 and first.dtype == torch.float64
    assert not torch.equal(first[0], first[1])  # rows
    assert not torch.equal(first, streams.uniform((4, 2, 50), 1))  # tags
    streams.advance(torch.tensor([True, False, False, False]))
    after = streams.uniform((4, 2, 50), 0)
    assert not torch.equal(after[0], first[0]) and torch.equal(after[1:], first[1:])
    streams.select(torch.tensor([2]))
    assert torch.equal(streams.uniform((1, 2, 50), 0), first[2:3])
    assert not torch.equal(RowStreams(4, torch.arange(4)).uniform((4, 2, 50), 0), first)  # seeds


def test_engine_benchmark_measures_every_figure(tmp_path):
    """``benchmarks/bench_engine.py`` on a tiny grid: overhead, wasted share (none: rows
    leave and advance on their own), syncs per forward, and the hand-written loop."""
    import json

    from benchmarks import bench_engine as bench

    out = tmp_path / "engine.json"
    rows = bench.main([
        "--strategies", "threshold", "spiffy+threshold", "--caches", "none", "dual", "--batch", "4",
        "--gen", "16", "--block", "8", "--prompts", "4", "--json", str(out),
    ])
    assert len(rows) == 4 and json.loads(out.read_text())["rows"] == rows
    plain = [r for r in rows if r["strategy"] == "threshold"]
    assert all(r["wasted"] == 0 and r["overhead"] > 1 and r["syncs_per_forward"] >= 1 for r in plain)
    assert "vs_hand_loop" in plain[0] and plain[0]["hand_loop_steps"] >= plain[0]["steps"]
    # peaks of tiny shapes inside pytest (freed heap memory reused): recorded, not compared
    assert all(r["memory_mib"] is None or r["memory_mib"] >= 0 for r in rows)  # None off Linux
    assert all(r["memory_rows"] >= 1 and len(r["memory_shape"]) == 2 for r in rows)
    table = bench.markdown(rows, rows).splitlines()
    assert len(table) == 2 + len(rows) and "0.0% → 0.0%" in table[2]
    # --model random-WxN: a seeded random bidirectional Llama of that shape, toy-dllm's conventions
    wide = bench.bench_model("random-128x2")
    config = wide.model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 2, 2)
    assert not config.is_causal and wide.tokenizer is not None and wide.mask_token_id == 1
    again = bench.bench_model("random-128x2")
    assert all(torch.equal(a, b) for a, b in zip(wide.model.parameters(), again.model.parameters()))
    with pytest.raises(SystemExit, match="multiple of 64"):
        bench.bench_model("random-100x2")
