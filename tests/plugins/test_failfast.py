"""FailFast (dLLM drafter, AR target): errors, length policies, cropping the target's KV cache,
batches, the strategy's registration and the CLI. Losslessness is in proofs_tests/test_failfast_lossless.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dloom import ModelAdapter
from dloom.check.target import target_greedy
from dloom.check.tiny import tiny_ar, tiny_dllm
from dloom.cli.commands import app
from dloom.errors import ConfigurationError, ModelError, UnknownStrategyError
from dloom.hooks.registry import get_registry
from dloom.hooks.specs import SPECULATION_HOOKS
from dloom_plugins.failfast import (
    FailFastDecoder,
    FailFastSettings,
    check_shared_tokenizer,
    proposal_length,
)

PAIR = dict(vocab=16, hidden=32, layers=2, init=0.8, context=128)
PROMPT = [5, 6, 7, 8]  # the tiny target's greedy continuation: 47 tokens (no 15), then EOS
SCRIPT_MASK = 15


@pytest.fixture(scope="module")
def target() -> ModelAdapter:
    return tiny_ar(0, **PAIR)


@pytest.fixture(scope="module")
def drafter() -> ModelAdapter:
    return tiny_dllm(0, **PAIR)


@pytest.fixture(scope="module")
def continuation(target) -> list[int]:
    tokens = target_greedy(target, [PROMPT], 60)[0]
    assert len(tokens) == 48 and SCRIPT_MASK not in tokens
    return tokens


class ScriptedDrafter(torch.nn.Module):
    """A stand-in dLLM: generated position ``i`` (position id ``prompt_len + i``) always gets
    probability ``confidence[i]`` on ``tokens[i]`` (the rest spread over the other tokens,
    none on the mask), whatever the context. Counts its forwards."""

    def __init__(self, tokens: list[int], confidence: list[float], prompt_len: int, vocab: int = 16) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab)
        self.anchor = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.prompt_len = prompt_len
        probs = torch.zeros(len(tokens), vocab, dtype=torch.float64)
        for i, (token, c) in enumerate(zip(tokens, confidence)):
            probs[i] = (1 - c) / (vocab - 2)
            probs[i, token] = c
        logits = torch.log(probs)
        logits[:, SCRIPT_MASK] = -1e4
        self.register_buffer("table", logits)
        self.calls = 0

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        self.calls += 1
        index = (position_ids - self.prompt_len).clamp(0, self.table.shape[0] - 1)
        return SimpleNamespace(logits=self.table[index])


def scripted(tokens: list[int], confidence: list[float]) -> ModelAdapter:
    return ModelAdapter(
        ScriptedDrafter(tokens, confidence, len(PROMPT)), mask_token_id=SCRIPT_MASK,
        eos_token_ids=(2,), pad_token_id=0, attention="bidirectional", name="scripted",
    )


# --- errors ----------------------------------------------------------------------------------


def _with_tokenizer(adapter: ModelAdapter, swap: tuple[str, str] | None = None) -> ModelAdapter:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from dloom.zoo import tokenizer as tok

    vocab = tok.vocab()
    if swap:
        a, b = swap
        vocab[a], vocab[b] = vocab[b], vocab[a]
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=None)))
    return ModelAdapter(
        adapter.model, adapter.mask_token_id, adapter.eos_token_ids, adapter.pad_token_id,
        attention=adapter.attention, tokenizer=fast, name=adapter.name + "+tok",
    )


def test_tokenizers_must_match_and_the_error_names_both_models_and_the_token(target, drafter):
    check_shared_tokenizer(_with_tokenizer(target), _with_tokenizer(drafter))
    with pytest.raises(ModelError) as raised:
        FailFastDecoder(_with_tokenizer(target), _with_tokenizer(drafter, swap=("a", "b")))
    message = str(raised.value)
    assert "tiny-dllm" in message and "tiny-ar" in message
    assert "token id 3 is 'b' in the drafter and 'a' in the target" in message


def test_a_drafter_may_add_its_mask_token_to_the_vocabulary(target, drafter):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(6)}
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=None)))
    masked = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({**vocab, "[MASK]": 6}, unk_token=None))
    )
    ar = ModelAdapter(target.model, None, (2,), 0, attention="causal", tokenizer=plain, name="ar")
    dllm = ModelAdapter(drafter.model, 6, (2,), 0, tokenizer=masked, name="dllm")
    check_shared_tokenizer(ar, dllm)
    other = ModelAdapter(drafter.model, 1, (2,), 0, tokenizer=masked, name="dllm-mask-1")
    with pytest.raises(ModelError, match="token id 6 is '\\[MASK\\]' in the drafter and None in the target"):
        check_shared_tokenizer(ar, other)


def test_tokenizer_less_models_need_equal_vocabularies(target):
    with pytest.raises(ModelError, match="vocab_size 6 vs 16"):
        FailFastDecoder(target, tiny_dllm(0, vocab=6))
    with pytest.raises(ModelError, match="has no tokenizer, so dloom cannot check"):
        FailFastDecoder(target, _with_tokenizer(tiny_dllm(0, **PAIR)))


def test_ratio_verification_with_an_out_of_order_drafter_is_refused(target, drafter):
    with pytest.raises(ConfigurationError) as raised:
        FailFastDecoder(target, drafter, verification="ratio")
    message = str(raised.value)
    assert "strictly left to right" in message and "small_block is 8" in message
    assert "biased" in message and "verification='match'" in message
    FailFastDecoder(target, drafter, verification="ratio", small_block=1)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"tau": 1.5}, "parameter 'tau' of strategy 'failfast' is 1.5; allowed: [0, 1]"),
        ({"n": 0}, "parameter 'n' of strategy 'failfast' is 0; allowed: [1, inf)"),
        ({"n_max": -3}, "parameter 'n_max' of strategy 'failfast' is -3; allowed: [1, inf)"),
        ({"initial_length": 20, "n_max": 12}, "initial_length 20 exceeds n_max 12; allowed: 1 <= initial_length <= n_max"),
        ({"policy": "greedy"}, "allowed: one of 'failfast', 'naive'"),
        ({"verification": "exact"}, "allowed: one of 'match', 'ratio'"),
        ({"small_block": 0}, "parameter 'small_block' of strategy 'failfast' is 0; allowed: [1, inf)"),
        ({"drafter_tau": 1.0}, "parameter 'drafter_tau' of strategy 'failfast' is 1.0; allowed: (0, 1)"),
        ({"drafter_strategy": "failfast"}, "'failfast' runs in the 'ar-target' decoder (FailFast itself"),
        ({"drafter_strategy": "spifyf+threshold"}, "drafter_strategy 'spifyf+threshold': unknown strategy 'spifyf'"),
        ({"drafter_strategy": "spiffy+threshold", "drafter_params": "spiffy.budget"},
         "drafter_params item 'spiffy.budget' is not NAME=VALUE"),
        ({"drafter_strategy": "spiffy+threshold", "drafter_params": "spiffy.budget=-1"},
         "drafter_strategy 'spiffy+threshold': parameter 'budget' of strategy 'spiffy' is -1"),
        ({"drafter_strategy": "threshold", "drafter_params": "budget=3"},
         "drafter_strategy 'threshold': unknown parameter 'budget'"),
    ],
)
def test_bad_parameters_name_the_allowed_range(target, drafter, params, message):
    with pytest.raises((ConfigurationError, UnknownStrategyError)) as raised:
        FailFastDecoder(target, drafter, params=params)
    assert message in str(raised.value)


def test_settings_validate_on_their_own():
    with pytest.raises(ConfigurationError, match="failfast tau is -0.1; allowed: \\[0, 1\\]"):
        FailFastSettings(tau=-0.1)
    with pytest.raises(ConfigurationError, match="failfast naive_length is 0"):
        FailFastSettings(naive_length=0)


def test_models_of_the_wrong_kind_are_refused(target, drafter):
    with pytest.raises(ModelError, match="'bidirectional' attention; an AR target needs 'causal'"):
        FailFastDecoder(drafter, drafter)
    with pytest.raises(ModelError, match="must be a bidirectional dLLM with a mask token"):
        FailFastDecoder(target, target)
    with pytest.raises(ModelError, match="drafter_cache 'prefix' needs a drafter whose forward takes"):
        FailFastDecoder(target, scripted([3] * 8, [0.9] * 8), drafter_cache="prefix")
    with pytest.raises(ConfigurationError, match="drafter_cache is 'dual'; allowed: none, prefix"):
        FailFastDecoder(target, drafter, drafter_cache="dual")
    with pytest.raises(ConfigurationError, match="temperature is -1.0; allowed: >= 0"):
        FailFastDecoder(target, drafter, temperature=-1)


def test_a_sequence_beyond_the_context_is_refused(target, drafter):
    with pytest.raises(ModelError, match="exceeds the drafter"):
        FailFastDecoder(target, drafter, max_new_tokens=126).generate([PROMPT])


# --- length policies ---------------------------------------------------------------------------


def _sequential(done: int, first_low: int, cap: int, s: FailFastSettings) -> int:
    """The length policy of ``docs/strategies/failfast.md`` step by step: the length the policy stops at once ``done`` tokens are in."""
    if s.policy == "naive":
        return min(s.naive_length, cap)
    length = min(s.initial_length, cap)
    while True:
        if done < length:
            return length  # not all of the first L are committed: keep denoising
        if first_low < length or length >= cap:
            return length
        length = min(length + s.n, cap)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 12), st.integers(1, 8), st.integers(1, 40), st.integers(0, 45), st.integers(0, 45),
    st.integers(1, 45), st.sampled_from(["failfast", "naive"]),
)
def test_closed_form_policy_equals_the_step_by_step_rule(initial, n, n_max, done, low, cap, policy):
    s = FailFastSettings(initial_length=min(initial, n_max), n=n, n_max=n_max, policy=policy, naive_length=initial)
    low = min(low, done)
    got = proposal_length(torch.tensor([done]), torch.tensor([low]), torch.tensor([cap]), s)
    assert int(got) == _sequential(done, low, cap, s)


def _first_round(target, tokens, confidence, max_new_tokens=40, **params):
    adapter = scripted(tokens, confidence)
    decoder = FailFastDecoder(target, adapter, params=params, max_new_tokens=max_new_tokens)
    result = decoder.generate([PROMPT])
    return result, adapter.model


def test_win_big_extends_by_n_up_to_n_max(target, continuation):
    result, model = _first_round(target, continuation[:40], [0.9] * 40, max_new_tokens=31, n_max=30)
    assert result.proposed == [[30]] and result.accepted == [[30]]  # 30 drafts + the bonus: done
    # small blocks of 8 with threshold 0.05 commit a block per forward: 8, 16, 24, 32 tokens;
    # L = 10 is checked after the second, 20 after the third, 30 after the fourth
    assert model.calls == result.drafter_forwards == 4
    assert result.token_lists[0] == continuation[:31]
    result, _ = _first_round(target, continuation[:40], [0.9] * 40)
    assert result.proposed[0] == [40] and result.token_lists[0] == continuation[:40]  # capped at 40 left


def test_fail_fast_stops_at_the_first_length_holding_a_low_confidence(target, continuation):
    confidence = [0.9] * 40
    confidence[13] = 0.2
    result, _ = _first_round(target, continuation[:40], confidence)
    assert result.proposed[0][0] == 20  # L = 10 all confident -> L = 20 holds position 13
    confidence[3] = 0.2
    result, _ = _first_round(target, continuation[:40], confidence)
    assert result.proposed[0][0] == 10  # the first 10 already hold a low confidence
    result, _ = _first_round(target, continuation[:40], confidence, tau=0.1)
    assert result.proposed[0][0] == 40  # nothing below tau = 0.1: win big up to the 40 left


def test_the_naive_policy_proposes_a_fixed_length(target, continuation):
    result, _ = _first_round(target, continuation[:40], [0.9] * 40, policy="naive", naive_length=5)
    assert result.proposed[0][:3] == [5, 5, 5]
    assert result.accepted[0][:3] == [5, 5, 5]
    assert result.token_lists[0] == continuation[:40]


def test_a_rejected_token_is_corrected_by_the_target(target, continuation):
    wrong = list(continuation[:40])
    wrong[6] = 3 if wrong[6] != 3 else 4
    result, _ = _first_round(target, wrong, [0.9] * 40, n_max=10)
    assert result.proposed[0][0] == 10 and result.accepted[0][0] == 6
    assert result.token_lists[0] == continuation[:40]


def test_drafting_stops_at_a_drafted_eos(target, continuation):
    tokens = list(continuation[:40])
    tokens[4] = 2
    result, _ = _first_round(target, tokens, [0.9] * 40)
    assert result.proposed[0][0] == 5


def test_quota_drafts_one_token_per_forward(target, continuation):
    result, model = _first_round(target, continuation[:40], [0.9] * 40, drafter_strategy="quota", n_max=10)
    assert result.proposed[0][0] == 10
    assert model.calls == int(result.drafter_nfe[0]) == result.drafter_forwards
    assert result.drafter_forwards >= 10


# --- the target's KV cache --------------------------------------------------------------------


def test_the_target_cache_is_cropped_to_the_shortest_accepted_prefix(target, drafter):
    decoder = FailFastDecoder(target, drafter, max_new_tokens=12)
    lengths = []
    crop = decoder.target.crop

    def spy(length):
        lengths.append(length)
        crop(length)

    decoder.target.crop = spy
    result = decoder.generate([PROMPT, [9, 3]])
    assert lengths == sorted(lengths) and lengths[0] >= len(PROMPT)
    assert result.forwards == 1 + len(lengths) + 1  # prefill, every round (the last is not cropped)


# --- batches ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_a_batch_gives_each_row_what_it_gives_alone(target, drafter, cache):
    prompts = [PROMPT, [9, 3], [3, 4, 5], [7, 8, 9, 10, 11]]
    decoder = FailFastDecoder(target, drafter, max_new_tokens=14, drafter_cache=cache)
    batch = decoder.generate(prompts)
    assert batch.token_lists == [decoder.generate([p]).token_lists[0] for p in prompts]
    assert batch.token_lists == target_greedy(target, prompts, 14)
    lengths = batch.generated_lengths.tolist()
    assert lengths == [len(t) for t in batch.token_lists]
    for row, n in enumerate(lengths):  # the target's pad after each row's end
        assert batch.generated[row, n:].eq(target.pad_token_id).all()
    assert len(batch.accepted) == 4 and all(len(a) == int(nfe) - 1 for a, nfe in zip(batch.accepted, batch.nfe))


def test_sampled_rows_are_reproducible_with_a_seed(target, drafter):
    decoder = FailFastDecoder(target, drafter, max_new_tokens=10, temperature=1.0, seed=3)
    first = decoder.generate([PROMPT] * 4).token_lists
    assert first == decoder.generate([PROMPT] * 4).token_lists
    assert len({tuple(t) for t in first}) > 1  # rows sample independently


def test_result_metrics_and_totals(target, drafter):
    decoder = FailFastDecoder(target, drafter, max_new_tokens=12)
    result = decoder.generate([PROMPT, [9, 3]])
    summary = result.summary()
    assert summary["target_forwards"] == result.forwards
    assert summary["drafter_forwards"] == result.drafter_forwards > 0
    assert sum(result.acceptance_histogram.values()) == summary["rounds"]
    assert result.speculation == {
        "verifications": summary["rounds"], "accepted_drafts": sum(map(sum, result.accepted)),
        "accepted_per_verification": summary["accepted_per_round"], "guarantee": "lossless",
        "drafting": {"path": "drafted"},
    }
    assert set(result.hook_seconds) >= {"target_forward", "drafter_forward", "draft", "verify", "select_commit"}
    totals = decoder.totals()
    assert totals["rows"] == 2 and totals["generated_tokens"] == result.total_generated
    assert totals["target_nfe_per_token"] == pytest.approx(int(result.nfe.sum()) / result.total_generated)
    decoder.reset_totals()
    assert decoder.totals()["rows"] == 0


# --- registration and CLI -----------------------------------------------------------------------


def test_failfast_is_registered_with_a_lossless_against_target_claim():
    strategy = get_registry().get("failfast")
    assert strategy.plugin == "failfast"
    assert strategy.claim.kind == "lossless" and strategy.claim.against == "target"
    # its four speculation hooks (and the check of its settings), run by the ar-target decoder
    assert set(strategy.hooks) == {"dloom_configure", *SPECULATION_HOOKS}
    assert {p.name for p in strategy.parameters} == set(FailFastSettings.__dataclass_fields__)


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory) -> tuple[str, str]:
    """A tiny AR target and dLLM drafter saved with the zoo's tokenizer (vocabulary 57)."""
    from dloom.zoo import tokenizer as tok

    tmp_path = tmp_path_factory.mktemp("failfast-pair")
    paths = []
    for name, model in (("ar", tiny_ar(0, vocab=57, hidden=32, layers=2, init=0.8, context=96)),
                        ("dllm", tiny_dllm(0, vocab=57, hidden=32, layers=2, init=0.8, context=96))):
        path = tmp_path / name
        model.model.to(torch.float32).save_pretrained(path)
        tok.save(path)
        paths.append(str(path))
    return paths[0], paths[1]


def test_cli_generate_and_eval_run_failfast(saved_pair):
    ar, dllm = saved_pair
    runner = CliRunner()
    result = runner.invoke(app, [
        "generate", "add 1 2", "copy ab", "--strategy", "failfast", "--target", ar, "--drafter", dllm,
        "--gen-length", "8", "--param", "n_max=20", "--json",
    ])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2 and rows[0]["config"]["strategy"] == "failfast"
    assert rows[0]["config"]["params"]["failfast"]["n_max"] == 20
    result = runner.invoke(app, [
        "eval", "--strategy", "failfast", "--target", ar, "--drafter", dllm, "-n", "3",
        "--gen-length", "8", "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.splitlines()[-1])  # the summary after one line per example
    assert report["n"] == 3 and report["config"]["drafter"] == dllm
    assert report["totals"]["rows"] == 3 and report["totals"]["drafter_forwards"] > 0
    assert report["speculation"]["drafting"] == {"path": "drafted", "batches": {"drafted": 1}}
    result = runner.invoke(app, [
        "eval", "--strategy", "failfast", "--target", ar, "--drafter", dllm, "-n", "3",
        "--gen-length", "8", "--param", "drafting=auto", "--param", "n_max=2", "--param", "initial_length=2",
        "--batch-size", "1", "--json",
    ])
    assert result.exit_code == 0, result.output
    drafting = json.loads(result.stdout.splitlines()[-1])["speculation"]["drafting"]
    assert drafting["path"] in ("drafted", "target alone") and sum(drafting["batches"].values()) == 3
    assert drafting["break_even_ratio"] is not None and drafting["measured_ratio"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategy", "threshold", "--target", "x"], "--target and --drafter apply to --strategy failfast only"),
        (["--strategy", "failfast", "--block-length", "4"], "do not apply to failfast"),
        (["--strategy", "failfast", "--param", "tau=2"], "allowed: [0, 1]"),
    ],
)
def test_cli_failfast_usage_errors(saved_pair, args, message):
    ar, dllm = saved_pair
    if "--target" not in args:
        args = args + ["--target", ar, "--drafter", dllm]
    result = CliRunner().invoke(app, ["generate", "add 1 2", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_cli_strategies_lists_failfast():
    result = CliRunner().invoke(app, ["strategies", "--json"])
    record = {r["name"]: r for r in json.loads(result.stdout)}["failfast"]
    assert record["claim"]["against"] == "target"
    assert set(record["hooks"]) >= set(SPECULATION_HOOKS) and record["decoder"] == "ar-target"
    assert CliRunner().invoke(app, ["strategies"]).exit_code == 0


def test_cli_check_tests_the_claim_against_the_target():
    result = CliRunner().invoke(app, ["check", "--strategy", "failfast", "--temperature", "0", "-n", "4", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["verdict"] == "lossless" and report["evidence"]["greedy"]["identical"] == 4


# --- host synchronisation ------------------------------------------------------------------------


def test_at_most_one_sync_per_drafter_step_and_per_round(monkeypatch, target, drafter):
    """Device-to-host reads counted as in test_host_sync.py: one per drafter step (is any row
    still drafting, with the verification widths) plus one per round (the new cache length),
    plus a constant per call; never per token or per row."""
    from decode.test_host_sync import (
        SyncCounter,  # tests/ is on sys.path (its conftest)
    )

    per_call = 12  # padding check, results to lists, totals
    prompts = [PROMPT, [9, 3], [3, 4, 5], [7, 8, 9, 10, 11], [12, 4, 4]]
    decoder = FailFastDecoder(target, drafter, max_new_tokens=10, params={"drafter_strategy": "quota"})
    decoder.generate(prompts)  # warm-up outside the count
    with SyncCounter().counting(monkeypatch) as counter:
        result = decoder.generate(prompts)
    rounds = result.forwards - 1  # the prefill is not a round
    total = sum(counter.decoder.values())
    assert total <= result.drafter_forwards + rounds + per_call, dict(counter.decoder)
    assert result.drafter_forwards >= 10 and rounds >= 3  # a per-row or per-token sync would show


def test_a_diffusion_decoder_refuses_failfast_with_a_pointer_to_the_right_decoder(tiny_adapter):
    from dloom import DiffusionDecoder
    from dloom.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="runs in the 'ar-target' decoder.*use dloom.ARTargetDecoder"):
        DiffusionDecoder(tiny_adapter, "failfast")


@pytest.mark.parametrize("params", [{"verification": "match"}, {"verification": "ratio", "small_block": 1}])
def test_a_seeded_failfast_sample_does_not_depend_on_the_batch_size(target, drafter, params):
    """Prompts of different lengths (each twice) decoded in batches of 1, 3 and 8 with
    ``row_offset`` at each batch's first index: the same samples; copies differ."""
    prompts = [PROMPT, [9, 3], [4, 4, 4, 10, 11], [12]] * 2
    decoder = FailFastDecoder(
        target, drafter, max_new_tokens=12, temperature=1.0, seed=5, params=params
    )

    def in_batches(size):
        out = []
        for first in range(0, len(prompts), size):
            out += decoder.generate(prompts[first : first + size], row_offset=first).token_lists
        return out

    whole = in_batches(8)
    assert in_batches(1) == whole and in_batches(3) == whole
    assert whole[:4] != whole[4:]
