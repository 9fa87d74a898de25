"""Continuous batching in the engine: rows join a running :class:`DecodeSession` between
forwards, and leave when they finish or are cancelled.

Batch invariance is checked row by row: a row that joined a batch mid-run (of other rows in
other blocks, with shorter and longer prompts, so that the batch is widened) has the tokens
and the NFE of decoding its prompt alone with :meth:`DiffusionDecoder.generate`, for every
commit rule, every cache mode, bidirectional and block-causal models (both block
alignments) and Spiffy; a seeded sampling row draws what ``generate`` of its own prompt
with that seed and stream draws. Two deliberately broken joins (no prefill; the running rows'
record out of line after a widening) are caught by the same comparison.
"""

from __future__ import annotations

import pytest

from conftest import EOS_ID, MASK_ID, PAD_ID, sharpen, staggered, tiny_model
from dloom import DiffusionDecoder, ModelAdapter
from dloom.decode.session import DecodeSession
from dloom.errors import ConfigurationError, ModelError
from dloom.model.runner import BlockForward

GEN, BLOCK = 16, 4
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16], [17, 18, 19, 20], [21, 22], [23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]]
# the step before which each prompt joins: later prompts arrive while earlier rows are mid-block
SCHEDULE = {0: [0], 2: [1, 2], 5: [3], 9: [4, 5]}


def adapter(**overrides) -> ModelAdapter:
    values = dict(
        model=sharpen(tiny_model(seed=1, initializer_range=0.5)), mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,),
        pad_token_id=PAD_ID, max_context=96, name="sharp",
    )
    values.update(overrides)
    return ModelAdapter(**values)


MODELS = {
    "bidirectional": {},
    "block-causal": {"attention": "block-causal"},
    "block-causal-absolute": {"attention": "block-causal", "block_alignment": "absolute"},
}


def alone(decoder: DiffusionDecoder, prompt: list[int], stream: int = 0) -> tuple[list[int], int]:
    result = decoder.generate([prompt], row_offset=stream)
    return result.token_lists[0], int(result.nfe[0])


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("strategy, params", [("quota", {}), ("threshold", {"tau": 0.5}), ("frechet", {})])
def test_rows_joining_mid_run_decode_as_they_do_alone(model, cache, strategy, params):
    decoder = DiffusionDecoder(adapter(**MODELS[model]), strategy, gen_length=GEN, block_length=BLOCK, cache=cache, params=params)
    out, steps, session = staggered(decoder, PROMPTS, SCHEDULE)
    expected = {i: alone(decoder, prompt) for i, prompt in enumerate(PROMPTS)}
    assert out == expected
    # the batch's composition changed while rows were decoding: a row that joined late shared
    # forwards with a row admitted before it, so the batch ran fewer forwards than the rows alone
    assert any(rows & {0, 1, 2} and rows & {3, 4, 5} for rows in steps)
    assert session.forwards < sum(nfe for _, nfe in expected.values())
    assert session.size == 0


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_spiffy_rows_joining_mid_run_decode_as_they_do_alone(cache):
    with pytest.warns(UserWarning, match="uncalibrated default graph"):
        decoder = DiffusionDecoder(adapter(), "spiffy+quota", gen_length=GEN, block_length=BLOCK, cache=cache,
                                   budget=10)
    out, _, session = staggered(decoder, PROMPTS, SCHEDULE)
    assert out == {i: alone(decoder, prompt) for i, prompt in enumerate(PROMPTS)}
    assert session.speculation["accepted_drafts"] > 0  # drafts were verified, so speculation ran


@pytest.mark.parametrize("strategy", ["quota", "threshold"])
def test_seeded_rows_joining_mid_run_draw_what_generate_draws(strategy):
    decoder = DiffusionDecoder(adapter(), strategy, gen_length=GEN, block_length=BLOCK, temperature=1.5, seed=3)
    streams = {0: 0, 1: 2, 2: 0, 3: 1, 4: 5, 5: 0}  # each prompt's index in its own request
    out, _, _ = staggered(decoder, PROMPTS, SCHEDULE, streams=streams)
    assert out == {i: alone(decoder, prompt, streams[i]) for i, prompt in enumerate(PROMPTS)}
    other = DiffusionDecoder(adapter(), strategy, gen_length=GEN, block_length=BLOCK, temperature=1.5, seed=4)
    assert any(alone(other, p)[0] != alone(decoder, p)[0] for p in PROMPTS)  # the seed matters


JOIN = BlockForward.join


def no_prefill(self, padding_mask, position_ids, start, block_ids, widened):
    """A broken join: the joining rows read an empty record instead of a full first forward."""
    JOIN(self, padding_mask, position_ids, start, block_ids, widened)
    self._needs_full[-len(start):] = False


def misaligned_record(self, padding_mask, position_ids, start, block_ids, widened):
    """A broken join: when the batch is widened, the running rows' recorded keys and values
    get the new columns on the right instead of the left (out of line with their tokens)."""
    JOIN(self, padding_mask, position_ids, start, block_ids, widened)
    if widened and self._store is not None:
        self._store = [(keys.roll(-widened, dims=2), values.roll(-widened, dims=2)) for keys, values in self._store]


@pytest.mark.parametrize("broken, cache", [(no_prefill, "prefix"), (no_prefill, "dual"), (misaligned_record, "prefix"), (misaligned_record, "dual")])
def test_a_broken_join_is_caught(monkeypatch, broken, cache):
    decoder = DiffusionDecoder(adapter(), "quota", gen_length=GEN, block_length=BLOCK, cache=cache)
    expected = {i: alone(decoder, prompt) for i, prompt in enumerate(PROMPTS)}
    monkeypatch.setattr(BlockForward, "join", broken)
    out, _, _ = staggered(decoder, PROMPTS, SCHEDULE)
    assert out != expected


def test_a_cancelled_row_leaves_before_its_batch_ends():
    decoder = DiffusionDecoder(adapter(eos_token_ids=()), "quota", gen_length=GEN, block_length=BLOCK, cache="prefix")
    session = DecodeSession(decoder)
    rows = session.admit(PROMPTS[:3])
    for _ in range(3):
        assert session.step() is None  # no EOS: every row runs all 16 steps
    session.cancel([rows[1]])
    assert session.size == 2  # withdrawn at once, before the next forward
    finished = []
    while session.size:
        done = session.step()
        if done is not None:
            finished.extend(zip(done.rows.tolist(), done.token_lists(), done.nfe.tolist()))
    assert [row for row, _, _ in finished] == [0, 2]  # the cancelled row is never reported
    assert [(tokens, nfe) for _, tokens, nfe in finished] == [alone(decoder, PROMPTS[0]), alone(decoder, PROMPTS[2])]
    assert session.row_forwards == 3 * 3 + 2 * 13  # it took no forward after its cancellation


def test_an_emptied_session_starts_again_at_its_next_rows_width():
    decoder = DiffusionDecoder(adapter(), "threshold", gen_length=GEN, block_length=BLOCK)
    session = DecodeSession(decoder)
    session.admit([PROMPTS[5]])
    session.cancel([0])
    assert session.step() is None and session.size == 0
    (row,) = session.admit([PROMPTS[2]])
    assert row == 1 and session.width == len(PROMPTS[2])
    done = None
    while session.size:
        done = session.step() or done
    assert (done.token_lists()[0], int(done.nfe[0])) == alone(decoder, PROMPTS[2])


def test_bad_admissions_and_cancellations_are_refused_before_any_change():
    decoder = DiffusionDecoder(adapter(), "quota", gen_length=GEN, block_length=BLOCK)
    session = DecodeSession(decoder)
    session.admit([PROMPTS[0]])
    with pytest.raises(ConfigurationError, match="row_offset has 1 stream indices for 2 prompts"):
        session.admit([PROMPTS[1], PROMPTS[2]], row_offset=[0])
    with pytest.raises(ModelError, match="exceeds the model's context of 96 tokens"):
        session.admit([[5] * 90])
    with pytest.raises(ConfigurationError, match=r"cannot cancel rows \[3\]: this session's rows are 0..0"):
        session.cancel([3])
    assert session.size == 1 and session.width == len(PROMPTS[0])


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_a_join_costs_two_host_syncs_and_a_step_one(monkeypatch, cache):
    """The counts of the module docstring: one sync per step, and per admission one for the
    padding check and one for the next forward's plan (``tests/decode/test_host_sync.py``'s counter)."""
    from test_host_sync import SyncCounter

    decoder = DiffusionDecoder(adapter(eos_token_ids=()), "threshold", gen_length=GEN, block_length=BLOCK, cache=cache)
    staggered(decoder, PROMPTS, SCHEDULE)  # warm-up outside the count
    session = DecodeSession(decoder)
    with SyncCounter().counting(monkeypatch) as counter:
        session.admit([PROMPTS[0]])
        for _ in range(3):
            session.step()
        session.admit([PROMPTS[1], PROMPTS[5]])  # longer prompts: the batch is widened
        while session.size:
            session.step()
    assert session.forwards > 6
    assert sum(counter.decoder.values()) == session.forwards + 2 * 2, dict(counter.decoder)
    assert not counter.model
