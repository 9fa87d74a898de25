"""Commit-time log-probabilities (:mod:`dloom.decode.logprobs`) on the shipped toy-dllm:
recording them changes no token and no NFE, and each recorded value is ``log_softmax`` of
the very forward that committed the token (checked against the step observer's logits),
also for rows that join a running batch wider than theirs."""

from __future__ import annotations

import pytest
import torch

import dloom
from dloom.decode.session import DecodeSession, StepRecord
from dloom.errors import ConfigurationError

BLOCK = 8
FIRST = ["add 40 20", "copy eezej spmk"]
JOINING = ["sort 29796252137 and a longer prompt", "rev iprmgsqepy4rxu"]


@pytest.fixture(scope="module")
def model():
    return dloom.load_model("toy-dllm")


def decode(model, strategy, logprobs, observer=None, **settings):
    """Rows of ``FIRST`` from the start, rows of ``JOINING`` joining after two steps: each
    row's (generated tokens, nfe, generated-region logprobs or None) by row id."""
    decoder = dloom.DiffusionDecoder(model, strategy, block_length=BLOCK, **settings)
    session = DecodeSession(decoder, observer, logprobs=logprobs)
    session.admit(model.encode(FIRST))
    out, steps = {}, 0
    while session.size:
        done = session.step()
        steps += 1
        if steps == 2:
            session.admit(model.encode(JOINING), row_offset=[2, 3])
        if done is None:
            continue
        width = done.prompt_width
        for i, row in enumerate(done.rows.tolist()):
            values = None if done.logprobs is None else (
                done.logprobs.token[i, width:], done.logprobs.top_ids[i, width:], done.logprobs.top_values[i, width:]
            )
            out[row] = (done.generated[i].tolist(), int(done.nfe[i]), values)
    return out


@pytest.mark.parametrize("strategy, settings", [
    ("quota", {}), ("threshold", {"cache": "dual"}), ("quota", {"temperature": 0.8, "seed": 3}),
])
def test_recording_logprobs_changes_no_token_and_no_nfe(model, strategy, settings):
    plain = decode(model, strategy, None, **settings)
    recorded = decode(model, strategy, 3, **settings)
    assert sorted(plain) == sorted(recorded) == [0, 1, 2, 3]
    for row in plain:
        assert plain[row][:2] == recorded[row][:2]


def test_a_committed_token_logprob_is_log_softmax_of_the_forward_that_committed_it(model):
    mask = model.mask_token_id
    expected: dict[int, dict[int, float]] = {}
    top: dict[int, dict[int, list[int]]] = {}

    def observe(step: StepRecord) -> None:
        logits = step.logits.double()
        logits[..., mask] = -torch.inf
        log_probs = torch.log_softmax(logits, dim=-1)
        for b, row in enumerate(step.rows.tolist()):
            for k in range(BLOCK):
                if step.before[b, k] == mask and step.after[b, k] != mask:
                    position = int(step.block[b]) * BLOCK + k
                    expected.setdefault(row, {})[position] = float(log_probs[b, k, step.after[b, k]])
                    top.setdefault(row, {})[position] = torch.topk(log_probs[b, k], 2).indices.tolist()

    out = decode(model, "quota", 2, observe)
    for row, (tokens, _, values) in out.items():
        token, top_ids, top_values = values
        committed = {p for p, t in enumerate(tokens) if t != mask}
        assert set(expected[row]) == committed
        for position, value in expected[row].items():
            assert float(token[position]) == pytest.approx(value, abs=1e-5)
            assert top_ids[position].tolist() == top[row][position]
            # greedy: the committed token is the most likely one
            assert float(top_values[position, 0]) == pytest.approx(value, abs=1e-5)
        untouched = [p for p in range(len(tokens)) if p not in committed]
        assert torch.isnan(token[untouched]).all()


def test_a_speculative_strategy_refuses_to_record_logprobs(model):
    decoder = dloom.DiffusionDecoder(model, "spiffy+quota", budget=2, block_length=BLOCK)
    with pytest.raises(ConfigurationError, match="speculates; commit-time log-probabilities"):
        DecodeSession(decoder, logprobs=0)
    # at no drafts (``auto`` on an uncalibrated graph) it takes the rule's plain steps: recorded
    plain = dloom.DiffusionDecoder(model, "spiffy+quota", block_length=BLOCK)
    assert plain.speculative_step is None
    assert DecodeSession(plain, logprobs=0).logprobs is not None
