"""``dloom check``: claims, exact enumeration, statistics, the checks, the CLI, the pytest plugin.

Every check here is deterministic: models, prompts and samplers are seeded, and the greedy
check runs on the tiny random model whether or not the toy zoo's weights are installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import warnings

import pytest
import torch
from rich.console import Console
from scipy import stats
from typer.testing import CliRunner

import dloom
from dloom import Claim, DiffusionDecoder, StrategyRegistration
from dloom.check import (
    KERNEL,
    TARGET,
    check_lossless,
    check_soundness,
    check_strategy,
    tiny,
)
from dloom.check.enumerate import exact_distribution
from dloom.check.resolve import commit_rule_of, resolve
from dloom.check.sampling import SETTINGS, SamplingOptions, sampling_test
from dloom.check.stats import (
    chi2_isf,
    chi2_sf,
    ncx2_sf,
    pooled_chi_square,
    power,
    simulated_p_value,
)
from dloom.check.tiny import EOS_ID, MASK_ID, tiny_dllm, tiny_prompts
from dloom.cli import commands as cli
from dloom.cli.commands import app
from dloom.decode.commit import commit_top, sorted_profile
from dloom.errors import ConfigurationError, HookContractError
from dloom.hooks.registry import Strategy, get_registry

pytest_plugins = ["pytester"]

ZOO_INSTALLED = tiny.zoo_installed
"""The real test, kept before :func:`tiny_greedy_model` replaces it in every test."""


@pytest.fixture(autouse=True)
def tiny_greedy_model(monkeypatch):
    """The greedy checks run on tiny random models even once the toy zoo is trained."""
    monkeypatch.setattr(tiny, "zoo_installed", lambda *names: False)


class TopOne:
    """Commit the most confident position: quota at one token per step, written anew."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        ranked = torch.where(selectable, confidence, torch.full_like(confidence, -torch.inf))
        top = ranked.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(selectable).scatter_(-1, top, True) & selectable


class TopTwo:
    """Commit the two most confident positions per step."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        _, ranks = sorted_profile(confidence, selectable)
        return commit_top(ranks, selectable, torch.full_like(ranks[:, 0], 2))


class Nothing:
    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        return torch.zeros_like(selectable)


TOP_ONE = StrategyRegistration("top-one", TopOne, claim=Claim("lossless", against="quota"))
TOP_TWO = StrategyRegistration("top-two", TopTwo, claim=Claim("lossless", against="quota"))
FAST = dict(samples=6000, epsilon=0.1)  # power >= 0.99 against TV >= 0.1 on every tiny model


def register(registration: StrategyRegistration) -> None:
    registry = get_registry()
    registry.strategies[registration.name] = Strategy(registration.name, "tests", registration)


# --- claims ------------------------------------------------------------------------------


def test_builtins_declare_their_claims():
    registry = get_registry()
    assert registry.get("quota").claim == Claim(
        "reference", conditions="the transition kernel K itself, at every temperature and remasking"
    )
    for name in ("threshold", "factor"):
        claim = registry.get(name).claim
        assert (claim.kind, claim.against) == ("approximate", "quota")
    frechet = registry.get("frechet").claim
    assert (frechet.kind, frechet.bound) == ("bound", "frechet")
    assert "temperature 0" in frechet.conditions and "low_confidence" in frechet.conditions


def test_a_registration_without_a_claim_still_works():
    registration = StrategyRegistration("old-style", TopOne, guarantee="none")
    assert registration.claim is None
    assert Strategy("old-style", "tests", registration).claim is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="exact"), "claim kind 'exact' is not known; allowed: lossless, bound"),
        (dict(kind="lossless"), "a 'lossless' claim needs against="),
        (dict(kind="bound"), "a 'bound' claim needs bound="),
    ],
)
def test_malformed_claims_are_refused(kwargs, message):
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(")):
        Claim(**kwargs)


def test_claim_describes_itself_and_serialises():
    claim = Claim("lossless", against="quota", conditions="any temperature")
    assert claim.describe() == "lossless against quota (any temperature)"
    assert claim.describe(conditions=False) == "lossless against quota"
    assert claim.to_json() == {
        "kind": "lossless", "against": "quota", "bound": None, "conditions": "any temperature"
    }
    assert dloom.Claim is Claim


def test_strategies_json_and_table_show_claims(monkeypatch):
    monkeypatch.setattr(cli, "console", Console(width=400))
    result = CliRunner().invoke(app, ["strategies", "--json"])
    assert result.exit_code == 0, result.output
    claims = {r["name"]: r["claim"] for r in json.loads(result.stdout)}
    assert claims["quota"]["kind"] == "reference"
    assert claims["frechet"] == get_registry().get("frechet").claim.to_json()
    table = CliRunner().invoke(app, ["strategies"]).stdout
    assert "bound frechet" in table and "approximate (of quota)" in table


class TopK:
    """Commit the ``k`` most confident positions per step: quota at one token per step
    when ``k == 1``."""

    def __init__(self, k: int = 1) -> None:
        self.k = k

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        _, ranks = sorted_profile(confidence, selectable)
        return commit_top(ranks, selectable, torch.full_like(ranks[:, 0], self.k))


TOP_K = StrategyRegistration(
    "top-k", TopK, parameters=[dloom.Parameter("k", 1, int, "positions per step", low=1)],
    guarantee="quota's outputs at k = 1", claim=Claim("lossless", against="quota", holds_when={"k": 1}),
)


def test_a_claim_holds_at_the_parameter_values_it_names():
    register(TOP_K)
    claim = TOP_K.claim
    assert claim.describe() == "lossless against quota at k = 1"
    assert claim.to_json()["holds_when"] == {"k": 1} and Claim(**claim.to_json()).unmet({"k": 2})
    assert claim.unmet({"k": 1}) == [] and claim.unmet({"k": 3}) == ["k = 3 (holds at k = 1)"]
    assert check_strategy("top-k", temperature=0).verdict == "lossless"
    report = check_strategy("top-k", params={"k": 2}, temperature=0)
    assert (report.verdict, report.exit_code) == ("not claimed", 0)
    assert "makes no lossless claim at k = 2 (holds at k = 1): nothing to test" in report.reason
    with pytest.warns(UserWarning, match="not claimed at k = 2"):  # tested anyway when asked
        assert check_lossless("top-k", "quota", params={"k": 2}, temperature=0).verdict == "not lossless"
    model = tiny_dllm(0)
    assert DiffusionDecoder(model, "top-k", gen_length=4).guarantees == {"top-k": "quota's outputs at k = 1"}
    with pytest.warns(UserWarning, match="'top-k': lossless against quota not claimed at k = 2"):
        decoder = DiffusionDecoder(model, "top-k", k=2, gen_length=4)
    assert decoder.guarantees["top-k"] == "lossless against quota not claimed at k = 2 (holds at k = 1)"


def test_a_claim_made_at_temperature_zero_is_not_sampled():
    greedy_only = StrategyRegistration(
        "top-one-greedy", TopOne, claim=Claim("lossless", against="quota", holds_when={"temperature": [0, 0.0]})
    )
    report = check_strategy(greedy_only, **FAST)
    assert report.verdict == "lossless" and "sampling" not in report.evidence
    assert any("sampling test skipped: the claim is not made at temperature = 1.0" in n for n in report.notes)
    sampled_only = StrategyRegistration(
        "top-one-sampled", TopOne, claim=Claim("lossless", against="quota", holds_when={"temperature": 1.0})
    )
    report = check_strategy(sampled_only, **FAST)
    assert report.verdict == "lossless" and "greedy" not in report.evidence and "sampling" in report.evidence
    assert check_strategy(sampled_only, temperature=0).verdict == "not claimed"


def test_holds_when_names_a_parameter_or_a_decoder_setting():
    with pytest.raises(ConfigurationError, match="holds_when names 'gamma', which is neither a parameter"):
        StrategyRegistration("x", TopK, claim=Claim("lossless", against="quota", holds_when={"gamma": 0}))
    with pytest.raises(ConfigurationError, match=r"holds_when\['k'\] allows no value"):
        Claim("lossless", against="quota", holds_when={"k": []})


# --- statistics --------------------------------------------------------------------------


@pytest.mark.parametrize("df", [1, 7, 60, 240])
def test_chi_square_functions_match_scipy(df):
    for x in (0.3, df / 2, df, 2 * df + 15):
        assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)
    assert chi2_isf(1e-3, df) == pytest.approx(stats.chi2.isf(1e-3, df), rel=1e-9)
    critical = stats.chi2.isf(1e-3, df)
    for nc in (0.0, 3.0, 40.0, 200.0):
        assert ncx2_sf(critical, df, nc) == pytest.approx(
            stats.ncx2.sf(critical, df, nc) if nc else stats.chi2.sf(critical, df), rel=1e-7, abs=1e-12
        )


def test_power_is_that_of_the_least_favourable_alternative():
    df, samples, alpha, epsilon = 50, 8000, 1e-3, 0.05
    expected = stats.ncx2.sf(stats.chi2.isf(alpha, df), df, 4 * samples * epsilon**2)
    assert power(df, samples, alpha, epsilon) == pytest.approx(expected, rel=1e-7)
    # the alternative that moves epsilon of mass from one half of the bins to the other has
    # chi-square divergence exactly 4 epsilon^2
    p = torch.full((50,), 1 / 50, dtype=torch.float64)
    q = p * torch.where(torch.arange(p.numel()) % 2 == 0, 1 + 2 * epsilon, 1 - 2 * epsilon)
    assert float(((q - p) ** 2 / p).sum()) == pytest.approx(4 * epsilon**2)
    assert 0.5 * float((q - p).abs().sum()) == pytest.approx(epsilon)
    assert power(df, 2 * samples, alpha, epsilon) > power(df, samples, alpha, epsilon)
    assert power(0, 100, alpha, 0.05) == pytest.approx(1 - 0.95**100)


def test_pooling_gives_every_bin_five_expected_and_impossible_outputs_reject():
    probabilities = {("a",): 0.5, ("b",): 0.3, ("c",): 0.19, ("d",): 0.006, ("e",): 0.004}
    counts = {("a",): 260, ("b",): 140, ("c",): 95, ("d",): 3, ("e",): 2}
    test = pooled_chi_square(counts, probabilities)
    assert test.bins == 4  # e (2 expected) and d (3 expected) pooled: 5 expected together
    assert test.pooled_mass == pytest.approx(0.01)
    pooled = [260, 140, 95, 5]
    expected = [250, 150, 95, 5]
    assert test.statistic == pytest.approx(stats.chisquare(pooled, expected).statistic)
    assert test.p_value == pytest.approx(stats.chisquare(pooled, expected).pvalue)
    assert pooled_chi_square({**counts, ("z",): 1}, probabilities).p_value == 0.0
    assert pooled_chi_square({**counts, ("z",): 1}, probabilities).impossible == (("z",),)


def test_small_p_values_are_simulated_under_the_exact_distribution():
    uniform = torch.full((4,), 0.25, dtype=torch.float64).numpy()
    critical = stats.chi2.isf(0.01, 3)  # large expected counts: simulation ~ asymptotics
    assert simulated_p_value(critical, uniform, 10_000, 40_000, seed=3) == pytest.approx(0.01, abs=0.002)
    probabilities = {("a",): 0.5, ("b",): 0.3, ("c",): 0.2}
    counts = {("a",): 560, ("b",): 280, ("c",): 160}  # p ~ 2.6e-4 asymptotically
    plain = pooled_chi_square(counts, probabilities)
    assert plain.replicates == 0 and plain.p_value == plain.p_value_asymptotic
    above = pooled_chi_square(counts, probabilities, simulate_below=1e-4, replicates=1000)
    assert above.replicates == 0  # only p-values below the threshold are simulated
    simulated = pooled_chi_square(counts, probabilities, simulate_below=0.01, replicates=100_000)
    assert simulated.replicates == 100_000
    assert simulated.p_value == pytest.approx(plain.p_value_asymptotic, rel=0.5)


# --- exact enumeration -------------------------------------------------------------------

BUILTINS = [("quota", {}), ("threshold", {"tau": 0.5}), ("factor", {}), ("frechet", {})]


@pytest.mark.parametrize("strategy, params", BUILTINS)
@pytest.mark.parametrize("settings", SETTINGS)
def test_exact_distribution_is_a_distribution_over_well_formed_outputs(strategy, params, settings):
    model = tiny_dllm(1)
    decoder = DiffusionDecoder(model, strategy, params=params, temperature=0.7, **settings)
    distribution = exact_distribution(decoder, [3, 4])
    assert math.fsum(distribution.values()) == pytest.approx(1.0, abs=1e-12)
    assert len(distribution) > 10
    for output, p in distribution.items():
        assert p > 0 and MASK_ID not in output
        assert 1 <= len(output) <= settings["gen_length"]
        assert EOS_ID not in output[:-1]
        assert output[-1] == EOS_ID or len(output) == settings["gen_length"]


@pytest.mark.parametrize("strategy, params", BUILTINS)
def test_greedy_enumeration_is_the_decoders_greedy_output(strategy, params):
    model = tiny_dllm(2)
    decoder = DiffusionDecoder(model, strategy, params=params, gen_length=4, block_length=2)
    distribution = exact_distribution(decoder, [5, 3, 4])
    assert distribution == {tuple(decoder.generate([[5, 3, 4]]).token_lists[0]): 1.0}


@pytest.mark.parametrize("strategy, params", BUILTINS)
def test_enumeration_agrees_with_the_decoders_samples(strategy, params):
    """The enumerated kernel is the distribution the engine samples, for every built-in rule
    (chi-square on three tiny models and settings; power >= 0.99 against TV >= 0.1)."""
    resolved = resolve(strategy, params)
    test = sampling_test(resolved, resolved, SamplingOptions(**FAST))
    assert test.verdict == "lossless", test.reason
    assert min(s.power for s in test.seeds) > 0.99


def test_enumeration_refuses_what_it_cannot_enumerate():
    with pytest.raises(ConfigurationError, match="vocab <= 8 and gen_length <= 4.*got vocab 9"):
        exact_distribution(DiffusionDecoder(tiny_dllm(0, vocab=9), gen_length=2), [3])
    with pytest.raises(ConfigurationError, match="got gen_length 5"):
        exact_distribution(DiffusionDecoder(tiny_dllm(0), gen_length=5), [3])
    with pytest.raises(ConfigurationError, match="remasking='low_confidence' only, got 'random'"):
        exact_distribution(DiffusionDecoder(tiny_dllm(0), gen_length=2, remasking="random"), [3])


def test_enumeration_reports_a_rule_that_commits_nothing():
    decoder = DiffusionDecoder(tiny_dllm(0), Nothing(), gen_length=2, temperature=1.0)
    with pytest.raises(HookContractError, match="committed no position"):
        exact_distribution(decoder, [3])


def test_tiny_models_are_seeded_and_leave_the_global_random_state_alone():
    state = torch.random.get_rng_state()
    a, b = tiny_dllm(4), tiny_dllm(4)
    assert torch.equal(torch.random.get_rng_state(), state)
    ids = torch.tensor([[3, 4, MASK_ID]])
    assert torch.equal(a.logits(ids), b.logits(ids))
    assert a.dtype == torch.float64 and a.default_gen_length == 8
    assert tiny_prompts(2, seed=1) == tiny_prompts(2, seed=1)
    assert all(3 <= t < 6 for p in tiny_prompts(5) for t in p)


# --- the checks --------------------------------------------------------------------------


BUILTIN_VERDICTS = {
    "quota": "reference", "dream": "approximate", "threshold": "approximate", "factor": "approximate",
    "joint_threshold": "approximate", "wino": "approximate", "entropy_bound": "approximate", "frechet": "sound",
    "frechet_edit": "approximate",
    "spiffy": "lossless", "failfast": "lossless",
}


def test_the_builtin_verdicts_cover_every_builtin_strategy():
    registry = get_registry()
    builtin = {p.name for p in registry.plugins.values() if p.builtin}
    assert {s.name for s in registry.strategies.values() if s.plugin in builtin} == set(BUILTIN_VERDICTS)


def test_a_check_run_shows_each_plugin_warning_once():
    """Spiffy has no draft graph for any of the sampling test's three tiny models: it warns
    on each decoder the run builds, and the run shows the first only."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # Python's own once-per-message filter off
        check_strategy("spiffy+quota", prompt_count=2, samples=200, seeds=3)
    shown = [str(w.message) for w in caught if "no built-in draft graph fits" in str(w.message)]
    assert len(shown) == 1 and "tiny-dllm(seed=0" in shown[0]
    assert [w.filename for w in caught if "no built-in draft graph" in str(w.message)] == [__file__]


@pytest.mark.filterwarnings("ignore:no built-in draft graph fits")
@pytest.mark.parametrize("strategy, verdict", BUILTIN_VERDICTS.items())
def test_every_builtins_declared_claim_passes(strategy, verdict):
    report = check_strategy(strategy, **FAST)
    assert report.verdict == verdict, report.render()
    assert report.exit_code == 0 and not report.refuted
    assert report.claim == get_registry().get(strategy).claim.to_json()
    json.dumps(report.to_json())
    if verdict == "sound":  # the certificate was exercised, not vacuous
        bound = report.evidence["bound"]
        assert bound["certified_commits"] > 200  # 602 at frechet's default δ 0.5 (656 at 0.25, 244 at 0.97)
        assert (bound["random_joints"], bound["adversarial_joints"]) == (400, 400)
    if verdict == "lossless":  # both checks ran and passed
        assert report.evidence["greedy"]["identical"] == 32
        assert report.evidence["sampling"]["verdict"] == "lossless"


def test_failfast_is_checked_against_its_ar_target():
    report = check_lossless("failfast", TARGET, temperature=0, prompt_count=4, model="toy-dllm")
    assert report.verdict == "lossless", report.render()
    greedy = report.evidence["greedy"]
    assert greedy["model"].startswith("tiny-ar(seed=0") and greedy["prompts"] == greedy["identical"] == 4
    assert "greedy outputs equal the target's on all 4 prompts" in report.reason
    assert any(note.startswith("model ignored: the greedy check against an AR target") for note in report.notes)
    declared = check_strategy("failfast", against="quota", temperature=0, prompt_count=4)
    assert any("--against quota ignored" in note for note in declared.notes)


def test_options_are_checked_before_anything_runs():
    with pytest.raises(TypeError, match="unexpected option 'sample'; allowed: .*samples"):
        check_strategy("quota", sample=10)
    with pytest.raises(TypeError, match="unexpected option 'samples'; allowed: adversarial_joints"):
        check_soundness("frechet", samples=10)
    with pytest.raises(ConfigurationError, match="allowed: 0 < alpha < 1"):
        check_lossless("quota", "quota", alpha=2)
    with pytest.raises(ConfigurationError, match="samples 0, seeds 3; allowed: at least 1 each"):
        check_lossless("quota", "quota", samples=0)


def test_an_unregistered_speculator_runs_over_its_default_commit_rule():
    from dloom_plugins.spiffy import Spiffy

    claim = Claim("lossless", against="kernel")
    resolved = resolve(StrategyRegistration("my-spiffy", Spiffy, claim=claim, default_commit_rule="quota"))
    assert isinstance(resolved.spec[0], Spiffy) and resolved.spec[1] == "quota"
    assert commit_rule_of(resolved).name == "kernel(quota)"
    assert resolve(StrategyRegistration("plain", TopOne, default_commit_rule="quota")).spec.__class__ is TopOne


def test_approximate_strategies_report_their_greedy_agreement():
    report = check_strategy("threshold")
    greedy = report.evidence["greedy"]
    assert greedy["prompts"] == 32 and 0 < greedy["identical"] < 32
    assert greedy["first_difference"]["prompt"] < 32
    assert f"greedy agreement with quota: {greedy['identical']}/32" in report.reason
    assert any("tiny random model" in note for note in report.notes)


def test_a_strategy_without_a_claim_is_said_to_have_none():
    report = check_strategy(StrategyRegistration("mute", TopOne))
    assert report.verdict == "no claim" and report.exit_code == 0
    assert "declares no claim" in report.reason and report.evidence == {}


def test_a_true_lossless_claim_passes():
    """An independent re-implementation of quota at one token per step is lossless."""
    report = check_strategy(TOP_ONE, **FAST)
    assert report.verdict == "lossless", report.render()
    assert report.evidence["greedy"]["identical"] == 32
    seeds = report.evidence["sampling"]["seeds"]
    assert [s["settings"] for s in seeds] == list(SETTINGS)
    assert all(s["p_value"] >= 1e-3 and s["power"] >= 0.8 for s in seeds)


def test_too_few_samples_is_inconclusive():
    report = check_lossless(TOP_ONE, "quota", samples=200)
    assert report.verdict == "inconclusive" and report.exit_code == 3
    assert "raise the number of samples" in report.reason


def test_greedy_only_at_temperature_zero():
    report = check_lossless("quota", "quota", temperature=0)
    assert report.verdict == "lossless" and "sampling" not in report.evidence
    assert any("temperature 0" in note for note in report.notes)


def test_kernel_reference_is_the_strategys_own_commit_rule():
    kernel = commit_rule_of(resolve("threshold", {"tau": 0.7}))
    assert kernel.name == "kernel(threshold)" and kernel.spec.tau == 0.7
    assert check_lossless("frechet", KERNEL, seeds=1, **FAST).verdict == "lossless"


def test_overriding_the_declared_reference_is_noted():
    report = check_strategy(TOP_ONE, against="factor", temperature=0)
    assert any("testing against factor, not the declared quota" in n for n in report.notes)


def test_a_bound_claim_ignores_against_and_says_so():
    report = check_strategy("frechet", against="quota", random_joints=20, adversarial_joints=20)
    assert report.verdict == "sound"
    assert any("--against quota ignored" in note for note in report.notes)


def test_soundness_of_a_rule_without_a_bound_function_tests_the_certificate():
    report = check_soundness("frechet", bound=None, random_joints=50, adversarial_joints=50)
    assert report.verdict == "sound"  # the declared bound was taken
    assert report.evidence["bound"]["bound"] == "frechet"
    bare = check_soundness(StrategyRegistration("bare", TopOne), random_joints=20, adversarial_joints=20)
    assert bare.verdict == "sound"
    assert any("only the joint-mode certificate" in n for n in bare.notes)
    assert any("never committed two positions" in n for n in bare.notes)


def test_unknown_bounds_are_usage_errors():
    with pytest.raises(ConfigurationError, match="unknown bound 'nope'; known bounds: frechet"):
        check_soundness("frechet", "nope")
    with pytest.raises(ConfigurationError, match="cannot be loaded"):
        check_soundness("frechet", "dloom_plugins.frechet:no_such_function")


@pytest.fixture
def fake_zoo_dllm(tmp_path, monkeypatch):
    """A tiny random model saved like the zoo's toy-dllm (character tokenizer, gen_length 8)
    and installed in its place."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dloom import zoo
    from dloom.zoo import tokenizer

    path = tmp_path / "toy-dllm"
    config = LlamaConfig(
        vocab_size=len(tokenizer.vocab()), hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=64, initializer_range=0.8, is_causal=False, mask_token_id=1,
        eos_token_id=2, pad_token_id=0,
        dloom={"kind": "dllm", "attention": "bidirectional", "shift": False, "gen_length": 8},
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save(path)
    monkeypatch.setattr(zoo, "model_path", lambda name: path)
    monkeypatch.setattr(tiny, "zoo_installed", lambda *names: names == ("toy-dllm",))
    return path


def test_the_greedy_check_defaults_to_the_zoo_dllm_and_its_task_prompts(fake_zoo_dllm):
    report = check_strategy("threshold", params={"tau": 0.3}, prompt_count=6)
    greedy = report.evidence["greedy"]
    assert (greedy["model"], greedy["dtype"], greedy["prompts"]) == ("toy-dllm", "float64", 6)
    assert greedy["settings"]["gen_length"] == 8
    assert not any("tiny random model" in note for note in report.notes)


# --- the command line --------------------------------------------------------------------


@pytest.fixture
def run(monkeypatch):
    monkeypatch.setattr(cli, "console", Console(width=400))
    monkeypatch.setattr(cli, "err_console", Console(width=400, stderr=True))

    def invoke(*args: str):
        return CliRunner().invoke(app, ["check", *map(str, args)])

    return invoke


def test_cli_check_bound_json(run):
    result = run("--strategy", "frechet", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["verdict"] == "sound" and report["exit_code"] == 0
    assert report["claim"]["bound"] == "frechet"


def test_cli_check_text(run):
    result = run("--strategy", "quota")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("quota: reference")
    assert "claim: reference process" in result.stdout


def test_cli_check_with_a_model_directory(run, tiny_model_dir):
    result = run(
        "--strategy", "factor", "--model", tiny_model_dir, "--gen-length", "8", "--block-length",
        "4", "-n", "5", "--json",
    )
    assert result.exit_code == 0, result.output
    greedy = json.loads(result.stdout)["evidence"]["greedy"]
    assert greedy["model"] == str(tiny_model_dir) and greedy["dtype"] == "float64"
    assert greedy["prompts"] == 5 and greedy["settings"]["block_length"] == 4


def test_cli_check_refuted_exits_1(run):
    register(TOP_TWO)
    result = run("--strategy", "top-two", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["verdict"] == "not lossless"
    first = report["evidence"]["greedy"]["first_difference"]
    assert first["strategy_tokens"][first["position"]] != first["against_tokens"][first["position"]]


def test_cli_check_inconclusive_exits_3(run):
    register(TOP_ONE)
    result = run("--strategy", "top-one", "--samples", "200", "--seeds", "1")
    assert result.exit_code == 3, result.output
    assert "top-one: inconclusive" in result.stdout


class LastPosition:
    """Commit the block's last position at every step, selectable or not: from the second step
    of a block on, it is already decoded (and the row commits nothing else)."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        commit = torch.zeros_like(selectable)
        commit[:, -1] = True
        return commit


class AlsoDecoded:
    """The most confident position, and every position that is not selectable: the
    decoder drops the extra commits, so it decodes like TopOne without an error."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        return TopOne().dloom_select_commit(confidence, selectable, schedule) | ~selectable


class Raises:
    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        raise RuntimeError("boom")


def test_the_decoder_names_a_commit_to_a_decoded_position():
    decoder = DiffusionDecoder(tiny_dllm(0), LastPosition(), gen_length=4, block_length=4)
    with pytest.raises(HookContractError, match="'LastPosition' committed positions that were already decoded"):
        decoder.generate([[3]])
    with pytest.raises(HookContractError, match="'Nothing' committed no position in a row that had masked"):
        DiffusionDecoder(tiny_dllm(0), Nothing(), gen_length=4, block_length=4).generate([[3]])


@pytest.mark.parametrize("kind", ["lossless", "approximate", None])
def test_commits_to_decoded_positions_break_the_contract_whatever_the_claim(kind):
    claim = None if kind is None else Claim(kind, against="quota")
    report = check_strategy(StrategyRegistration("also-decoded", AlsoDecoded, claim=claim), temperature=0)
    assert (report.verdict, report.exit_code, report.refuted) == ("contract broken", 1, True)
    contract = report.evidence["contract"]
    assert "that were not selectable (already decoded" in report.reason
    assert any(c and not s for c, s in zip(contract["committed"], contract["selectable"]))
    assert "contract probe: block of" in report.render()
    assert check_strategy(StrategyRegistration("top", TopOne), temperature=0).verdict == "no claim"


def test_cli_check_reports_a_contract_break_as_a_failed_check(run):
    register(StrategyRegistration("last-position", LastPosition, claim=Claim("lossless", against="quota")))
    result = run("--strategy", "last-position", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["verdict"], report["exit_code"]) == ("contract broken", 1)
    assert report["evidence"]["contract"]["committed"][-1] is True
    register(StrategyRegistration("raises", Raises, claim=Claim("approximate")))
    result = run("--strategy", "raises")
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("raises: contract broken")
    assert "raised RuntimeError in dloom_select_commit: boom" in " ".join(result.stdout.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (("--strategy", "treshold"), "unknown strategy 'treshold'"),
        (("--strategy", "quota", "--alpha", "2"), "allowed: 0 < alpha < 1"),
        (("--strategy", "threshold", "--param", "tau=3"), "parameter 'tau' of strategy 'threshold' is 3.0"),
        (("--strategy", "threshold", "--against", "nope"), "unknown strategy 'nope'"),
    ],
)
def test_cli_check_usage_errors_exit_2(run, args, message):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())


# --- the pytest plugin -------------------------------------------------------------------


def test_the_pytest_plugin_is_registered_under_pytest11():
    entry = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "dloom"]
    assert [e.value for e in entry] == ["dloom.check.pytest_plugin"]


def test_plugin_fixtures(dloom_tiny_dllm, dloom_enumerable_dllm, dloom_tiny_ar):
    assert dloom_tiny_dllm.dtype == torch.float64 and dloom_tiny_dllm.mask_token_id == MASK_ID
    assert dloom_tiny_dllm.model.config.vocab_size == 16
    decoder = DiffusionDecoder(dloom_enumerable_dllm, "quota", gen_length=2, temperature=1.0)
    assert math.fsum(exact_distribution(decoder, [3]).values()) == pytest.approx(1.0)
    assert dloom_tiny_ar.attention == "causal" and dloom_tiny_ar.mask_token_id is None


def test_zoo_fixtures_skip_when_the_zoo_is_missing(pytester):
    pytester.makepyfile(
        """
        def test_ar(dloom_zoo_ar):
            pass

        def test_any(dloom_zoo_model):
            dloom_zoo_model("toy-ar-small")
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(skipped=2)


def test_zoo_fixtures_load_the_zoo_models_in_float64(monkeypatch, request):
    monkeypatch.setattr(tiny, "zoo_installed", ZOO_INSTALLED)
    if not ZOO_INSTALLED("toy-ar", "toy-dllm"):
        pytest.skip("toy-ar / toy-dllm weights are not installed")
    ar, dllm = request.getfixturevalue("dloom_zoo_ar"), request.getfixturevalue("dloom_zoo_dllm")
    assert (ar.name, ar.attention, ar.dtype) == ("toy-ar", "causal", torch.float64)
    assert (dllm.name, dllm.attention, dllm.dtype) == ("toy-dllm", "bidirectional", torch.float64)


def test_plugin_authors_get_the_checks_in_three_lines(pytester):
    pytester.makepyfile(
        """
        from dloom.check import assert_lossless, assert_sound

        def test_rule_is_sound():
            assert_sound("frechet", random_joints=30, adversarial_joints=30)

        def test_rule_is_lossless_greedily(dloom_tiny_dllm):
            assert_lossless("quota", against="quota", temperature=0, model=dloom_tiny_dllm)

        def test_broken_rule_fails_with_the_report():
            assert_lossless("threshold", against="quota", temperature=0, params={"tau": 0.1})
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*dloom check: expected lossless*", "*threshold: not lossless*"])


def test_a_claim_is_checked_where_it_is_exercised_unless_the_user_chooses():
    """Spiffy's default budget ("auto") drafts nothing on a CPU, so its identity would test
    nothing: its claim's ``exercised_at`` makes the check decode at a budget of 10, unless
    the parameter is given, plainly or for Spiffy alone."""
    assert get_registry().get("spiffy").claim.exercised_at == {"budget": 10}
    assert resolve("spiffy").params == {"spiffy.budget": 10}
    assert resolve("spiffy+threshold", {"tau": 0.5}).params == {"tau": 0.5, "spiffy.budget": 10}
    assert resolve("spiffy", {"budget": "auto"}).params == {"budget": "auto"}
    assert resolve("spiffy", {"spiffy.budget": 4}).params == {"spiffy.budget": 4}
    assert resolve("threshold").params == {}  # a claim with nothing to exercise adds nothing
