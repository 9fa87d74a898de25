"""KV caching (prefix and dual) and the block-causal attention mask.

The mechanism: a forward over part of the sequence that reads the other positions' keys and
values from a ``transformers`` cache gives the full forward's logits for that part whenever
the cached entries are exact. On a bidirectional model they are exact only at block start,
so cached decoding drifts; the drift is reported here and measured on the toy model by
``benchmarks/bench_cache.py``. Exactness on block-causal models is in
``proofs_tests/test_cache_exact.py``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache
from typer.testing import CliRunner

from conftest import EOS_ID, MASK_ID, PAD_ID, sharpen, tiny_model
from dloom import DiffusionDecoder, ModelAdapter
from dloom.cli.commands import app
from dloom.decode import session as running_batch
from dloom.decode.speculation import packed_layout, rows_layout
from dloom.errors import ConfigurationError, ModelError
from dloom.model.attention import block_causal_mask, block_ids, model_mask
from dloom.model.cache_policy import BUILTIN_CACHE_MODES as CACHE_MODES
from dloom.model.runner import BlockForward, settling_cache_modes

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18]]


def padded_state(prompts, gen_length: int, seed: int = 0):
    """Left-padded ``(B, L)`` tokens (prompt + a random partly-decoded region), mask, positions."""
    width = max(len(p) for p in prompts)
    generator = torch.Generator().manual_seed(seed)
    region = torch.randint(3, MASK_ID, (len(prompts), gen_length), generator=generator)
    region[torch.rand(region.shape, generator=generator) < 0.5] = MASK_ID
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    tokens = torch.cat([ids, region], dim=1)
    mask = torch.cat([(ids != PAD_ID).long(), torch.ones_like(region)], dim=1)
    return tokens, mask, (mask.cumsum(-1) - 1).clamp(min=0), width


def shifted(adapter: ModelAdapter) -> ModelAdapter:
    return ModelAdapter(
        adapter.model, mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        shift_logits=True, max_context=96, name="shifted",
    )


# --- the mechanism ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("prompts", [PROMPTS, [[5, 6, 7], [8, 9, 10]]], ids=["padded", "unpadded"])
def test_cached_forward_of_a_window_equals_the_full_forward(tiny_adapter, mode, prompts):
    """transformers' bidirectional mask with a cache covers cached and new keys: with exact
    cached entries, the window's logits are the full forward's, with or without padding."""
    model = tiny_adapter.model
    tokens, mask, positions, width = padded_state(prompts, 12)
    if mask.all():
        mask = None  # what the decoder passes for an unpadded batch
    length, start, end = tokens.shape[1], width + 4, width + 8
    cache = DynamicCache()
    with torch.no_grad():
        full = model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True).logits
        if mode == "prefix":
            cache.crop(-(length - start))
            window, key_order = slice(start, length), torch.arange(length)
        else:
            keep = lambda s: torch.cat([s[:, :, :start], s[:, :, end:]], dim=2)
            cache = DynamicCache(ddp_cache_data=[(keep(layer.keys), keep(layer.values)) for layer in cache.layers])
            window = slice(start, end)
            key_order = torch.cat([torch.arange(start), torch.arange(end, length), torch.arange(start, end)])
        part = model(
            input_ids=tokens[:, window], attention_mask=None if mask is None else mask[:, key_order],
            position_ids=positions[:, window], cache=cache, use_cache=True,
        ).logits
    torch.testing.assert_close(part, full[:, window], rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", CACHE_MODES)
@pytest.mark.parametrize("shift", [False, True])
def test_block_forward_on_an_unchanged_state_repeats_the_full_forward(tiny_adapter, mode, shift):
    adapter = shifted(tiny_adapter) if shift else tiny_adapter
    tokens, mask, positions, width = padded_state(PROMPTS, 12)
    start, end = width + 4, width + 8
    reference = adapter.logits(tokens, mask, positions)[:, start:end]
    forward = BlockForward(adapter, mode, mask, positions, start, end - start)
    first = forward(tokens)
    assert torch.equal(first, reference)  # the block-start forward is the uncached forward
    assert forward.query_positions == tokens.shape[1]
    again = forward(tokens)
    torch.testing.assert_close(again, reference, rtol=0, atol=1e-12)
    recomputed = {"none": tokens.shape[1], "prefix": tokens.shape[1] - start, "dual": end - start}
    assert forward.query_positions == recomputed[mode] + (shift and mode != "none")


def frozen_kv_forward(model, tokens, mask, positions, block_start_tokens, frozen):
    """An independent definition of a cached step: a full forward on ``tokens`` in which the
    key and value projections of the ``frozen`` positions, in every layer, are those of the
    forward on ``block_start_tokens``."""
    projections = [
        (index, name, getattr(layer.self_attn, name))
        for index, layer in enumerate(model.model.layers) for name in ("k_proj", "v_proj")
    ]
    stale = {}
    hooks = [
        module.register_forward_hook(lambda m, i, out, key=(index, name): stale.__setitem__(key, out))
        for index, name, module in projections
    ]
    with torch.no_grad():
        model(input_ids=block_start_tokens, attention_mask=mask, position_ids=positions)
    for hook in hooks:
        hook.remove()
    hooks = [
        module.register_forward_hook(
            lambda m, i, out, key=(index, name): torch.where(frozen[None, :, None], stale[key], out)
        )
        for index, name, module in projections
    ]
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits
    for hook in hooks:
        hook.remove()
    return logits


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_steps_on_a_bidirectional_model_use_block_start_keys_and_values(sharp_adapter, mode):
    """What the approximation is, exactly: a cached step equals a full forward whose cached
    positions keep the keys and values of the block-start state (and not the fresh forward)."""
    tokens, mask, positions, width = padded_state(PROMPTS, 12)
    length, start, end = tokens.shape[1], width + 4, width + 8
    forward = BlockForward(sharp_adapter, mode, mask, positions, start, end - start)
    forward(tokens)
    committed = tokens.clone()
    committed[:, start : start + 2] = 7
    frozen = torch.arange(length) < start
    if mode == "dual":
        frozen |= torch.arange(length) >= end
    reference = frozen_kv_forward(sharp_adapter.model, committed, mask, positions, tokens, frozen)
    cached = forward(committed)
    torch.testing.assert_close(cached, reference[:, start:end], rtol=0, atol=1e-12)
    assert not torch.allclose(cached, sharp_adapter.logits(committed, mask, positions)[:, start:end])


def test_cached_step_sees_the_committed_block(sharp_adapter):
    """After a commit the block's logits change, and the cache is not grown by the step."""
    tokens, mask, positions, width = padded_state(PROMPTS, 12)
    start, end = width + 4, width + 8
    for mode in ("prefix", "dual"):
        forward = BlockForward(sharp_adapter, mode, mask, positions, start, end - start)
        first = forward(tokens)
        committed = tokens.clone()
        committed[:, start] = 7
        changed = forward(committed)
        assert not torch.allclose(changed, first)
        assert all(keys.shape[2] == tokens.shape[1] for keys, _ in forward._store)
        torch.testing.assert_close(forward(committed), changed, rtol=0, atol=1e-12)


# --- decoding with a cache -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("strategy", ["quota", "threshold"])
def test_cached_decoding_of_padded_batches_is_valid(sharp_adapter, mode, strategy):
    decoder = DiffusionDecoder(sharp_adapter, strategy, gen_length=16, block_length=4, cache=mode)
    batch = decoder.generate(PROMPTS)
    assert batch.config["cache"] == mode
    for index, prompt in enumerate(PROMPTS):
        tokens = batch.token_lists[index]
        assert 1 <= len(tokens) <= 16 and MASK_ID not in tokens
        assert 1 <= int(batch.nfe[index]) <= 16
        alone = decoder.generate([prompt])  # padding and batching do not change a row
        assert alone.token_lists[0] == tokens
        assert int(alone.nfe[0]) == int(batch.nfe[index])


def test_first_step_of_every_block_is_the_uncached_forward(monkeypatch, sharp_adapter):
    """Spy on every row's full forward: its logits are the uncached forward's on that state,
    and the other steps of the block recompute the window only."""
    starts, widths = [], []

    class Spy(BlockForward):
        def _full_forward(self, tokens, rows, every, keep=None):
            logits = super()._full_forward(tokens, rows, every, keep)
            pick = slice(None) if every else rows
            mask = None if self._full_mask is None else self._full_mask[pick]
            starts.append((tokens[pick].clone(), mask, self.position_ids[pick], self.block_columns[pick], logits))
            return logits

        def _count(self, tokens):
            super()._count(tokens)
            widths.append(self.query_positions)

    monkeypatch.setattr(running_batch, "BlockForward", Spy)
    decoder = DiffusionDecoder(sharp_adapter, "quota", gen_length=16, block_length=4, cache="prefix")
    result = decoder.generate(PROMPTS)
    assert len(starts) == 4 and len(widths) == result.forwards == 16
    for tokens, mask, positions, columns, logits in starts:
        full = sharp_adapter.logits(tokens, mask, positions)
        assert torch.equal(logits, torch.take_along_dim(full, columns.unsqueeze(-1), dim=1))
    length = 6 + 16
    assert widths == [w for block in range(4) for w in [length] + [length - 6 - 4 * block] * 3]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_a_full_forward_of_every_row_frees_the_old_record_first(monkeypatch, tiny_adapter, mode):
    """The record a full forward of every row replaces is dropped before that forward runs,
    so the peak holds one record, not two (at batch 1, the old one was as large as the
    forward's own activations: 1.63x a bare forward's peak on random-512x8 before)."""
    import weakref

    records, alive_during = [], []

    class Spy(BlockForward):
        def _run(self, tokens, attention_mask, position_ids, cache, keep=None):
            if isinstance(cache, DynamicCache) and not cache.get_seq_length():  # a full forward
                alive_during.append([ref() is not None for ref in records])
            return super()._run(tokens, attention_mask, position_ids, cache, keep)

        def _record(self, *args):
            raw = super()._record(*args)
            records.append(weakref.ref(self._store[0][0]))
            return raw

    monkeypatch.setattr(running_batch, "BlockForward", Spy)
    DiffusionDecoder(tiny_adapter, "quota", gen_length=16, block_length=4, cache=mode).generate([[5, 6, 7]])
    assert len(alive_during) == 4  # one full forward a block
    assert alive_during == [[False] * block for block in range(4)]  # no earlier record alive


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_drift_on_a_bidirectional_model_is_reported(sharp_adapter, mode):
    """Caching is approximate for a bidirectional model: report how far it drifts. (On this
    random tiny model the drift is large; the toy model's is in the benchmark.)"""
    uncached = DiffusionDecoder(sharp_adapter, "quota", gen_length=16, block_length=4).generate(PROMPTS)
    cached = DiffusionDecoder(sharp_adapter, "quota", gen_length=16, block_length=4, cache=mode).generate(PROMPTS)
    differ = sum(a != b for a, b in zip(cached.token_lists, uncached.token_lists)) / len(PROMPTS)
    agree = float((cached.generated == uncached.generated).double().mean())
    print(f"cache={mode}: {differ:.0%} of outputs differ, {agree:.0%} of tokens agree")
    assert cached.forwards == uncached.forwards  # one token per step either way
    assert agree > 0.25  # far above chance (1 in 38)


def test_early_stop_and_compaction_with_a_cache():
    """A row that finishes is dropped at the next block; the cache is built for the rows left,
    and the other rows decode as they would alone."""
    model = sharpen(tiny_model(seed=0, initializer_range=0.5))
    with torch.no_grad():
        model.lm_head.weight[EOS_ID].mul_(1.5)  # EOS comes early
    adapter = ModelAdapter(model, mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID)
    batch_sizes = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    for mode in ("prefix", "dual"):
        decoder = DiffusionDecoder(adapter, "threshold", gen_length=16, block_length=4, cache=mode)
        batch_sizes.clear()
        result = decoder.generate(PROMPTS)
        assert min(result.generated_lengths.tolist()) <= 4  # a row finished in the first block
        assert batch_sizes[0] == 4 and batch_sizes[-1] < 4
        for index, prompt in enumerate(PROMPTS):
            assert decoder.generate([prompt]).token_lists[0] == result.token_lists[index]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_refresh_rebuilds_the_cache_every_k_forwards(tiny_adapter, mode):
    """``refresh=3``: forwards 0, 3, 6 of the block are full forwards (the uncached logits of
    their state), the others recompute the window only."""
    tokens, mask, positions, width = padded_state(PROMPTS, 12)
    start, end = width + 4, width + 8
    forward = BlockForward(tiny_adapter, mode, mask, positions, start, end - start, refresh=3)
    generator = torch.Generator().manual_seed(1)
    widths = []
    for call in range(7):
        tokens[:, start + call % 4] = torch.randint(3, MASK_ID, (len(PROMPTS),), generator=generator)
        logits = forward(tokens)
        widths.append(forward.query_positions)
        if call % 3 == 0:
            assert torch.equal(logits, tiny_adapter.logits(tokens, mask, positions)[:, start:end])
    window = tokens.shape[1] - start if mode == "prefix" else end - start
    full = tokens.shape[1]
    assert widths == [full, window, window, full, window, window, full]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_refresh_every_forward_decodes_as_uncached(sharp_adapter, mode):
    """``cache_refresh=1`` makes every forward a full one: the tokens are the uncached ones
    (the negative control: the same cache without refresh drifts on this model)."""
    settings = {"gen_length": 16, "block_length": 8}
    uncached = DiffusionDecoder(sharp_adapter, "quota", **settings).generate(PROMPTS)
    refreshed = DiffusionDecoder(sharp_adapter, "quota", cache=mode, cache_refresh=1, **settings)
    assert refreshed.config["cache_refresh"] == 1
    assert refreshed.generate(PROMPTS).token_lists == uncached.token_lists
    stale = DiffusionDecoder(sharp_adapter, "quota", cache=mode, **settings).generate(PROMPTS)
    assert stale.token_lists != uncached.token_lists


# --- configuration -----------------------------------------------------------------------


def test_unknown_cache_mode_lists_the_modes(tiny_adapter):
    with pytest.raises(ConfigurationError, match="cache is 'full'; allowed: none, prefix, dual"):
        DiffusionDecoder(tiny_adapter, "quota", cache="full")
    with pytest.raises(ConfigurationError, match="cache is 'full'; allowed: none, prefix, dual"):
        BlockForward(tiny_adapter, "full", None, torch.zeros(1, 4, dtype=torch.long), 2, 4)


@pytest.mark.parametrize("refresh, cache, message", [
    (0, "dual", "cache_refresh is 0; allowed: an int >= 1, or None"),
    ("2", "prefix", "cache_refresh is '2'; allowed: an int >= 1, or None"),
    (2, "none", "cache_refresh=2 needs cache='prefix' or 'dual'"),
])
def test_bad_cache_refresh_is_refused(tiny_adapter, refresh, cache, message):
    with pytest.raises(ConfigurationError, match=message):
        DiffusionDecoder(tiny_adapter, "quota", cache=cache, cache_refresh=refresh)


def test_speculation_refuses_cache_refresh(tiny_adapter):
    with pytest.raises(ConfigurationError, match="cache_refresh=4 applies to plain steps.*spiffy"):
        DiffusionDecoder(tiny_adapter, "spiffy+quota", gen_length=8, block_length=4, cache="dual", cache_refresh=4)


def test_cache_needs_a_model_that_takes_one():
    class NoCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask=None, position_ids=None):
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 40))

    adapter = ModelAdapter(NoCache(), mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID)
    assert adapter.cache_argument is None
    assert DiffusionDecoder(adapter, "quota", gen_length=4).config["cache"] == "none"
    with pytest.raises(ModelError, match="takes no"):
        DiffusionDecoder(adapter, "quota", gen_length=4, cache="prefix")
    with pytest.raises(ModelError, match="does not take a KV cache"):
        BlockForward(adapter, "dual", None, torch.zeros(1, 4, dtype=torch.long), 2, 4)


def test_cli_records_the_cache_mode(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [5, 6, 7]}\n{"input_ids": [8, 9]}\n')
    base = ["generate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--json",
            "--gen-length", "8", "--block-length", "4"]
    result = CliRunner().invoke(app, base + ["--cache", "dual"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2 and {row["config"]["cache"] for row in rows} == {"dual"}
    refreshed = CliRunner().invoke(app, base + ["--cache", "prefix", "--cache-refresh", "2"])
    assert refreshed.exit_code == 0, refreshed.output
    assert {json.loads(line)["config"]["cache_refresh"] for line in refreshed.stdout.splitlines()} == {2}
    bad = CliRunner().invoke(app, base + ["--cache", "full"])
    assert bad.exit_code == 2 and "allowed: none, prefix, dual" in " ".join(bad.stderr.split())


# --- the block-causal mask -----------------------------------------------------------------


def test_block_causal_mask_layout():
    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    assert block_ids(7, 3, 2, torch.device("cpu")).tolist() == [-1, -1, -1, 0, 0, 1, 1]
    mask = block_causal_mask(padding, prompt_len=3, block_length=2)
    assert mask.shape == (2, 1, 7, 7) and mask.dtype == torch.bool
    expected = torch.tensor([
        [1, 1, 1, 0, 0, 0, 0],  # the prompt sees the prompt
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],  # block 0 sees the prompt and itself
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],  # block 1 sees everything before it and itself
        [1, 1, 1, 1, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask[1, 0], expected)
    without_pad = expected.clone()
    without_pad[:, 0] = False  # padding is never seen
    assert torch.equal(mask[0, 0], without_pad)


def test_model_mask_matches_the_attention_implementation(tiny_adapter):
    mask = block_causal_mask(torch.ones(1, 5, dtype=torch.long), 2, 3)
    assert model_mask(mask, tiny_adapter.model) is mask  # sdpa takes bool
    eager = tiny_model(attn_implementation="eager")
    additive = model_mask(mask, eager)
    assert additive.dtype == torch.float64
    assert torch.equal(additive == 0, mask) and (additive[~mask] == torch.finfo(torch.float64).min).all()
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(ModelError, match="cannot take a block-causal"):
        model_mask(mask, flash)


def test_decoder_uses_the_block_causal_mask(tiny_adapter):
    """For a block-causal model every forward gets the 4-D mask, and a block's logits do not
    depend on the tokens after it (they do for the bidirectional model)."""
    block_causal = ModelAdapter(
        tiny_adapter.model, mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        attention="block-causal",
    )
    masks = []
    hook = tiny_adapter.model.register_forward_pre_hook(
        lambda _, args, kwargs: masks.append(kwargs["attention_mask"]), with_kwargs=True
    )
    DiffusionDecoder(block_causal, "quota", gen_length=8, block_length=4).generate(PROMPTS)
    hook.remove()
    assert masks and all(m is not None and m.dim() == 4 for m in masks)

    tokens, padding, positions, width = padded_state(PROMPTS, 12)
    start, end = width, width + 4
    later = tokens.clone()
    later[:, end:] = 7
    layout = block_ids(tokens.shape[1], width, 4, tokens.device).expand(len(PROMPTS), -1)
    for adapter, ids, independent in ((block_causal, layout, True), (tiny_adapter, None, False)):
        before = BlockForward(adapter, "none", padding, positions, start, 4, block_ids=ids)(tokens)
        after = BlockForward(adapter, "none", padding, positions, start, 4, block_ids=ids)(later)
        assert torch.equal(before, after) is independent


def test_cache_benchmark_reports_every_mode_against_none(tmp_path):
    """``benchmarks/bench_cache.py`` on an untrained toy model: one row per mode, drift and
    ratios measured against ``none`` in the same run, fewer recomputed positions when cached."""
    from benchmarks import bench_cache as bench

    out = tmp_path / "cache.json"
    result = bench.main(["--model", "random", "-n", "3", "--repeats", "1", "--lengths", "short",
                         "--batch-size", "3", "--threads", "1", "--refresh", "1", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    rows = {row["cache"]: row for row in result["rows"]}
    assert list(rows) == [*CACHE_MODES, "prefix/1", "dual/1"] and result["lengths"] == ["short"]
    for mode in ("prefix", "dual"):  # a full forward every forward: the uncached outputs
        assert rows[f"{mode}/1"]["drift_vs_none"] == 0 and rows[f"{mode}/1"]["cache_refresh"] == 1
    assert rows["none"]["drift_vs_none"] == 0 and rows["none"]["query_positions_ratio_vs_none"] == 1
    assert rows["dual"]["query_positions_per_forward"] < rows["prefix"]["query_positions_per_forward"] \
        < rows["none"]["query_positions_per_forward"]
    with pytest.raises(SystemExit):
        bench.main(["--lengths", "medium"])


# --- block alignment (block-causal families) -----------------------------------------------


def aligned(adapter: ModelAdapter, alignment: str) -> ModelAdapter:
    return ModelAdapter(
        adapter.model, mask_token_id=MASK_ID, eos_token_ids=(), pad_token_id=PAD_ID,
        attention="block-causal", block_alignment=alignment, max_context=96, name=alignment,
    )


def sdar_style_generate(model, prompt, *, gen_length, block_length, tau):
    """An independent transcription of SDAR's ``block_diffusion_generate`` layout: blocks of
    ``block_length`` at multiples of it from position 0, prompt included, the last block
    completed (the sequence is rounded up to whole blocks); the block-causal mask is
    ``tril(ones(nb, nb))`` repeated over each block's positions; the first block decoded is
    the one holding the prompt's end. Greedy, commit rule: every masked position with
    confidence > ``tau``, else the most confident one; full forwards, no early stop."""
    k = block_length
    blocks = -(-(len(prompt) + gen_length) // k)
    length = blocks * k
    x = torch.full((1, length), MASK_ID, dtype=torch.long)
    x[0, : len(prompt)] = torch.tensor(prompt)
    mask = torch.tril(torch.ones(blocks, blocks)).repeat_interleave(k, 0).repeat_interleave(k, 1)
    mask = mask.bool()[None, None]
    for block in range(len(prompt) // k, blocks):
        window = slice(block * k, (block + 1) * k)
        while (x[0, window] == MASK_ID).any():
            with torch.no_grad():
                logits = model(input_ids=x, attention_mask=mask, position_ids=torch.arange(length)[None]).logits
            logits = logits[0, window].to(torch.float64)
            logits[:, MASK_ID] = -torch.inf
            confidence, candidate = torch.softmax(logits, -1).max(-1)
            masked = x[0, window] == MASK_ID
            confidence = torch.where(masked, confidence, -torch.inf)
            commit = masked & (confidence > tau)
            if not commit.any():
                commit[confidence.argmax()] = True
            x[0, window] = torch.where(commit, candidate, x[0, window])
    return x[0, len(prompt):].tolist()


ALIGNMENT_PROMPTS = [[5], [5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22]]


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_absolute_alignment_decodes_like_sdars_own_layout(sharp_adapter, mode):
    """``block_alignment="absolute"``: each prompt, alone and in a left-padded batch of
    mixed lengths (prompt length mod 4 = 1, 3, 0, 2, 1), decodes exactly as the SDAR-style
    reference loop; prefix and dual caches stay exact."""
    adapter = aligned(sharp_adapter, "absolute")
    decoder = DiffusionDecoder(adapter, "threshold", tau=0.7, gen_length=8, block_length=4, cache=mode)
    batch = decoder.generate(ALIGNMENT_PROMPTS)
    for index, prompt in enumerate(ALIGNMENT_PROMPTS):
        reference = sdar_style_generate(sharp_adapter.model, prompt, gen_length=8, block_length=4, tau=0.7)
        assert len(reference) == 8 + (-len(prompt)) % 4  # the last block is completed
        assert batch.token_lists[index] == reference, index
        alone = decoder.generate([prompt])
        assert alone.token_lists[0] == reference and int(alone.nfe[0]) == int(batch.nfe[index])


def test_absolute_alignment_puts_the_prompts_last_partial_block_first(sharp_adapter):
    """The first block decoded holds the prompt's last ``len % K`` tokens; with
    ``"prompt"`` alignment it starts after the prompt, and the decodes differ from SDAR's."""
    first_blocks = []
    decoder = DiffusionDecoder(aligned(sharp_adapter, "absolute"), "quota", gen_length=8, block_length=4)
    decoder.generate([[12, 13, 14, 15, 16, 17]], observer=lambda r: first_blocks.append(r.before[0].tolist()))
    assert first_blocks[0] == [16, 17, MASK_ID, MASK_ID]
    prompt_aligned = DiffusionDecoder(aligned(sharp_adapter, "prompt"), "threshold", tau=0.7, gen_length=8, block_length=4)
    differs = [
        prompt_aligned.generate([p]).token_lists[0]
        != sdar_style_generate(sharp_adapter.model, p, gen_length=8, block_length=4, tau=0.7)
        for p in ALIGNMENT_PROMPTS if len(p) % 4
    ]
    assert any(differs)


def test_block_alignment_must_be_known(sharp_adapter):
    with pytest.raises(ModelError, match="block_alignment 'zero' is not supported; allowed: prompt, absolute"):
        aligned(sharp_adapter, "zero")


# --- the record view: cached forwards read the record without copying it ----------------


def _recorded(adapter, tokens, mask, positions):
    """A full forward's record, per layer ``(B, H, L, D)`` keys and values."""
    cache = DynamicCache()
    full_mask = model_mask(mask.bool()[:, None, None, :].expand(-1, 1, tokens.shape[1], -1), adapter.model)
    adapter.raw_logits(tokens, full_mask, positions, cache=cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("rows", [None, [0, 0, 1, 3, 3, 3, 2]], ids=["every-row", "repeated-rows"])
def test_record_view_gives_a_copied_caches_logits_bit_for_bit_and_keeps_nothing(tiny_adapter, rows):
    """A window forward reading the record through :func:`record_view` gives exactly the
    logits of one reading a ``DynamicCache`` copy of the rows' record; the record is left
    untouched, and the view holds no per-row copy once the forward returns (a
    ``DynamicCache`` keeps every layer's concatenation with the window: the negative
    control)."""
    from dloom.model.runner import record_view

    tokens, mask, positions, width = padded_state(PROMPTS, 12)
    store = _recorded(tiny_adapter, tokens, mask, positions)
    before = [(k.clone(), v.clone()) for k, v in store]
    index = None if rows is None else torch.tensor(rows)
    pick = (lambda t: t) if index is None else (lambda t: t[index])
    start, window = width + 4, 4
    columns = torch.arange(start, start + window)
    keys = pick(mask).bool()
    length = tokens.shape[1]
    attend = torch.cat([keys & ((torch.arange(length) < start) | (torch.arange(length) >= start + window)),
                        torch.ones(keys.shape[0], window, dtype=torch.bool)], dim=1)
    attend = model_mask(attend[:, None, None, :].expand(-1, 1, window, -1), tiny_adapter.model)
    inputs = (pick(tokens)[:, columns], attend, pick(positions)[:, columns])
    view = record_view(store, index)
    copied = DynamicCache(ddp_cache_data=[(pick(k), pick(v)) for k, v in store])
    through_view = tiny_adapter.raw_logits(*inputs, cache=view)
    through_copy = tiny_adapter.raw_logits(*inputs, cache=copied)
    assert torch.equal(through_view, through_copy)
    for (keys_now, values_now), (keys_then, values_then), layer in zip(store, before, view.layers):
        assert torch.equal(keys_now, keys_then) and torch.equal(values_now, values_then)
        assert layer.keys is keys_now and layer.values is values_now  # no copy kept
    assert all(layer.keys.shape[-2] == length + window for layer in copied.layers)


def test_cached_decoding_reads_the_record_through_views(monkeypatch, tiny_adapter):
    """Every cached forward of a decode (plain and verification) reads the record through a
    :func:`record_view`, never a copied ``DynamicCache``."""
    from dloom.model import runner as cache_module

    views = []
    original = cache_module.record_view

    def counted(store, rows):
        views.append(rows is None or rows.shape[0])
        return original(store, rows)

    monkeypatch.setattr(cache_module, "record_view", counted)
    with pytest.warns(UserWarning, match="uncalibrated default graph"):
        decoder = DiffusionDecoder(tiny_adapter, "spiffy", gen_length=16, block_length=8, cache="dual", budget=10)
    result = decoder.generate(PROMPTS)
    assert result.verification_forwards > 0 and len(views) >= result.verification_forwards


# --- settled columns (FailFast's drafter) -----------------------------------------------------


@pytest.mark.parametrize("shift", [False, True])
def test_settled_columns_keep_the_keys_and_values_of_the_forward_they_settled_in(tiny_adapter, shift):
    """After ``settle(c)`` the next forward keeps the keys and values of the columns before
    ``c - shift``; a later forward recomputes only the columns after them, attending to the
    kept entries: a full forward on the new state with those columns' key and value
    projections frozen at the old state's (``frozen_kv_forward``). The record only grows."""
    adapter = shifted(tiny_adapter) if shift else tiny_adapter
    tokens, mask, positions, width = padded_state(PROMPTS, 12)
    length, start, block = tokens.shape[1], width + 4, 4
    forward = BlockForward(adapter, "prefix", mask, positions, start, block)
    forward.settle(start)
    window = slice(start - shift, start - shift + block)
    first = forward(tokens)
    torch.testing.assert_close(first, adapter.raw_logits(tokens, mask, positions)[:, window], rtol=0, atol=1e-12)
    assert forward.query_positions == length
    changed = tokens.clone()
    changed[:, start:start + 2] = 7  # committed in the block
    changed[:, -1] = 8  # and after it
    kept = start - shift
    frozen = torch.arange(length) < kept
    expected = frozen_kv_forward(adapter.model, changed, mask, positions, tokens, frozen)[:, window]
    second = forward(changed)
    torch.testing.assert_close(second, expected, rtol=0, atol=1e-12)
    assert forward.query_positions == length - kept
    fresh = adapter.raw_logits(changed, mask, positions)[:, window]
    assert not torch.allclose(second, fresh, rtol=0, atol=1e-6)  # the kept entries are the old state's
    forward.settle(start - 2)
    for _ in range(2):
        torch.testing.assert_close(forward(changed), second, rtol=0, atol=1e-12)
        assert forward.query_positions == length - kept


@pytest.mark.parametrize("shift", [False, True])
def test_verification_over_settled_columns_reads_them_rows_and_packed_alike(tiny_adapter, shift):
    """A rows layout of each row's current window gives the plain forward's block logits; a
    packed layout of two spans gives each span what a rows layout of it alone gives."""
    adapter = shifted(tiny_adapter) if shift else tiny_adapter
    tokens, mask, positions, width = padded_state(PROMPTS, 12)
    start, block = width + 4, 4
    forward = BlockForward(adapter, "prefix", mask, positions, start, block)
    forward.settle(start)
    forward(tokens)  # settles the columns before the block
    plain = forward(tokens)
    span = block + shift
    assert forward.query_width(0) == tokens.shape[1] - (start - shift)
    root = tokens[:, start - shift:start - shift + span]
    draft = torch.where(root == MASK_ID, 7, root)
    evaluated = torch.ones(len(PROMPTS), 1, dtype=torch.bool)
    rows = forward.evaluate(tokens, rows_layout(root[:, None], evaluated), 0)
    torch.testing.assert_close(rows[:, :block], plain, rtol=0, atol=1e-12)
    alone = forward.evaluate(tokens, rows_layout(draft[:, None], evaluated), 0)
    packed = forward.evaluate(tokens, packed_layout(torch.stack([root, draft], 1), evaluated.repeat(1, 2)), 0)
    assert packed.shape[1] == 2 * span
    torch.testing.assert_close(packed[:, :span], rows, rtol=0, atol=1e-12)
    torch.testing.assert_close(packed[:, span:], alone, rtol=0, atol=1e-12)
    assert not torch.allclose(alone, rows)


@pytest.mark.parametrize("mode, static", [("none", None), ("dual", None), ("prefix", 8)])
def test_settling_needs_a_cache_that_records_and_recomputes_the_rest(tiny_adapter, mode, static):
    tokens, mask, positions, width = padded_state(PROMPTS, 12)
    forward = BlockForward(tiny_adapter, mode, mask, positions, width + 4, 4, static_width=static)
    with pytest.raises(ConfigurationError, match=f"got cache='{mode}'.*allowed: cache='prefix'"):
        forward.settle(width)
    assert settling_cache_modes() == ("prefix",)
