"""``dloom check``: test the claim a strategy declares, and report the evidence.

:func:`check_strategy` reads the strategy's :class:`~dloom.types.Claim` and dispatches:

* ``reference``: lossless with respect to itself by definition; nothing to test;
* ``approximate``: no lossless claim to test; the greedy agreement with the strategy it
  approximates (``against``) is measured and reported;
* ``bound``: :func:`check_soundness` (:mod:`dloom.check.bounds`): ``sound`` / ``unsound``;
* ``lossless``: :func:`check_lossless`: greedy token identity on a prompt set
  (:mod:`dloom.check.greedy`), then, when ``temperature > 0``, the exact-distribution
  chi-square test on tiny enumerable models (:mod:`dloom.check.sampling`):
  ``lossless`` / ``not lossless`` / ``inconclusive``; against an AR target (``against``
  :data:`TARGET`, FailFast) the same two checks on model pairs (:mod:`dloom.check.target`);
* no claim: says so (and measures the agreement with ``against`` if one is given);
* a claim whose ``holds_when`` excludes the parameters: ``not claimed``, nothing to test.

Before any of these the commit rule's hook contract is probed (:mod:`dloom.check.contract`);
a break, or a :class:`~dloom.errors.HookContractError` raised while checking, is the verdict
``contract broken`` (a failed check, exit status 1, with its report). Then, for a strategy
that runs on the revisable or the uniform kernel, the claims each brings are tested on decodes
(:mod:`dloom.check.kernel_claims`); a broken one is the verdict ``kernel claim broken``
(exit status 1), whatever the strategy declares.

The checks take their options as keywords: the fields of :class:`GreedyOptions`,
:class:`~dloom.check.sampling.SamplingOptions` and :class:`~dloom.check.bounds.BoundOptions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import torch

from dloom.check import tiny
from dloom.check.bounds import BoundOptions, check_bound
from dloom.check.contract import probe_commit_rule
from dloom.check.greedy import GreedyComparison, compare_greedy
from dloom.check.kernel_claims import (
    ACCEPTS,
    FILLS,
    KernelClaims,
    check_kernel_claims,
)
from dloom.check.progress import stage
from dloom.check.resolve import Resolved, reference, resolve
from dloom.check.sampling import SamplingOptions, SamplingTest, sampling_test
from dloom.check.uniform_claims import check_uniform_claims
from dloom.decode.transition import REVISABLE, UNIFORM
from dloom.errors import ConfigurationError, HookContractError, each_warning_once
from dloom.model.adapter import ModelAdapter, load_model

NOT_CLAIMED = "not claimed"
"""The verdict when the declared claim's ``holds_when`` excludes the parameters or
temperature checked: nothing to test (exit 0)."""
CONTRACT_BROKEN = "contract broken"
"""The verdict when a hook of the strategy breaks its contract (:mod:`dloom.check.contract`,
or a :class:`~dloom.errors.HookContractError` raised while checking): a failed check."""
KERNEL_CLAIM_BROKEN = "kernel claim broken"
"""The verdict when decodes on a kernel the strategy runs on break a claim of that kernel
(:mod:`dloom.check.kernel_claims`): a failed check."""
REFUTED = ("not lossless", "unsound", CONTRACT_BROKEN, KERNEL_CLAIM_BROKEN)
EXIT_CODES = {"not lossless": 1, "unsound": 1, CONTRACT_BROKEN: 1, KERNEL_CLAIM_BROKEN: 1, "inconclusive": 3}
"""``dloom check`` exit status by verdict; every other verdict exits 0 (2: usage error)."""
KERNEL_CHECKS: dict[str, Callable[[Resolved], KernelClaims]] = {
    REVISABLE: check_kernel_claims, UNIFORM: check_uniform_claims,
}
"""The test of each kernel's claims (:data:`dloom.check.kernel_claims.KERNEL_CLAIMS`)."""
DEFAULT_PROMPTS = 32
TARGET = "target"
"""``Claim.against`` value: the AR target of a speculative decoder (FailFast)."""
TINY_GREEDY: dict[str, Any] = {"vocab": 16, "hidden": 32, "layers": 2, "init": 0.8}
"""The tiny model of the greedy check when neither ``model`` nor the toy zoo's is there."""
TINY_GREEDY_BLOCK_LENGTH = 4


@dataclass
class CheckReport:
    """What ``dloom check`` found, JSON-ready (:meth:`to_json`).

    :ivar strategy: the strategy checked.
    :ivar claim: the claim tested (``Claim.to_json``), or ``None``.
    :ivar claimed_by: the component of a composition that declared it.
    :ivar verdict: ``lossless``, ``not lossless``, ``inconclusive``, ``sound``, ``unsound``,
        ``contract broken``, ``kernel claim broken``, ``reference``, ``approximate``,
        ``not claimed`` or ``no claim``.
    :ivar reason: the verdict in one sentence.
    :ivar evidence: ``greedy`` (agreement, first difference), ``sampling`` (per seed:
        p-value, power, ...), ``bound`` (joints tried, counterexample), ``contract``
        (the hook contract break: the error, or the probe's situation) and
        ``kernel_claims`` (by kernel: each of its claims' verdict and detail), as run.
    :ivar notes: what was assumed or skipped.
    """

    strategy: str
    claim: dict[str, Any] | None
    claimed_by: str | None
    verdict: str
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def refuted(self) -> bool:
        return self.verdict in REFUTED

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.verdict, 0)

    @property
    def failed_claims(self) -> list[str]:
        """The kernel claims (:data:`dloom.check.kernel_claims.KERNEL_CLAIMS`) found broken:
        by the decodes, or ``fills`` by the hook contract probe (a row that committed nothing)."""
        failed = [c for kernel in self.evidence.get("kernel_claims", {}).values() for c in kernel["failed"]]
        failed = list(dict.fromkeys(failed))
        claim = self.evidence.get("contract", {}).get("claim")
        return failed + [claim] if claim and claim not in failed else failed

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "claim": self.claim, "claimed_by": self.claimed_by,
            "verdict": self.verdict, "reason": self.reason, "exit_code": self.exit_code,
            "failed_claims": self.failed_claims, "evidence": self.evidence, "notes": self.notes,
        }

    def render(self) -> str:
        """Plain text for a terminal or an assertion message."""
        claim = "none declared" if self.claim is None else _claim_text(self.claim)
        lines = [f"{self.strategy}: {self.verdict}", f"  claim: {claim}", f"  {self.reason}"]
        greedy = self.evidence.get("greedy")
        if greedy:
            lines.append(
                f"  greedy: {greedy['identical']}/{greedy['prompts']} prompts identical on "
                f"{greedy['model']} ({greedy['dtype']})"
            )
            first = greedy["first_difference"]
            if first:
                lines.append(
                    f"    first difference: prompt {first['prompt']}, position {first['position']}: "
                    f"{first['strategy_tokens']} vs {first['against_tokens']}"
                )
        sampling = self.evidence.get("sampling")
        if sampling:
            lines.append(
                f"  sampling (T={sampling['temperature']:g}, alpha={sampling['alpha']:g}, "
                f"epsilon={sampling['epsilon']:g}): {sampling['verdict']}"
            )
            for s in sampling["seeds"]:
                simulated = (
                    f" (simulated, {s['replicates']} replicates; asymptotic {s['p_value_asymptotic']:.3g})"
                    if s["replicates"] else ""
                )
                lines.append(
                    f"    seed {s['seed']}: {s['samples']} samples, {s['bins']} bins, "
                    f"chi2 {s['statistic']:.1f} (df {s['df']}), p = {s['p_value']:.3g}{simulated}, "
                    f"power {s['power']:.3f}"
                )
        bound = self.evidence.get("bound")
        if bound:
            lines.append(
                f"  bound: {bound['random_joints']} random + {bound['adversarial_joints']} "
                f"adversarial joints, {bound['certified_commits']} multi-token commits checked"
            )
            if bound["counterexample"]:
                c = bound["counterexample"]
                lines.append(f"    counterexample (joint {c['joint']}, {c['kind']}, shape {c['shape']}): {c['problem']}")
                lines.append(f"    confidences {[round(x, 6) for x in c['confidence']]}")
        contract = self.evidence.get("contract")
        if contract and "block_length" in contract:
            lines.append(
                f"  contract probe: block of {contract['block_length']}, {contract['steps_per_block']} "
                f"steps per block, step {contract['step']}, row {contract['row']}: selectable "
                f"{_bits(contract['selectable'])}, committed {_bits(contract['committed'])}"
            )
        for kernel in self.evidence.get("kernel_claims", {}).values():
            lines.append(f"  {kernel['kernel']} kernel claims on {kernel['model']}:")
            lines.extend(
                f"    {name}: {outcome['verdict']}: {outcome['detail']}" for name, outcome in kernel["claims"].items()
            )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _bits(flags: list[bool]) -> str:
    return "".join("1" if flag else "0" for flag in flags)


def _claim_text(claim: dict[str, Any]) -> str:
    from dloom.types import Claim

    return Claim(**claim).describe()


# --- the greedy check's model and prompts ------------------------------------------------


def _random_prompts(model: ModelAdapter, count: int) -> list[list[int]]:
    vocab = int(getattr(getattr(model.model, "config", None), "vocab_size", 0) or 0)
    special = {model.mask_token_id, model.pad_token_id, *model.eos_token_ids}
    plain = [t for t in range(min(vocab, 256)) if t not in special]
    if not plain:
        raise ConfigurationError(f"cannot make prompts for {model.name!r}: no vocab_size in its config; pass prompts")
    picks = torch.randint(0, len(plain), (count, 4), generator=torch.Generator().manual_seed(0))
    return [[plain[i] for i in row] for row in picks.tolist()]


def greedy_setup(
    model: ModelAdapter | str | None,
    prompts: Sequence[Any] | None,
    count: int = DEFAULT_PROMPTS,
    gen_length: int | None = None,
    block_length: int | None = None,
) -> tuple[ModelAdapter, list[Any], dict[str, Any], list[str]]:
    """The model, prompts and decoder settings of the greedy check, and notes about them.

    ``model``: an adapter, a zoo name or checkpoint path (loaded in float64), or ``None``:
    the toy zoo's ``toy-dllm`` when its weights are installed, else a tiny random model
    (:data:`TINY_GREEDY`, two blocks of 4). Prompts default to ``count`` held-out task prompts
    (models with a tokenizer) or random token ids. ``gen_length`` and ``block_length``
    default to the decoder's defaults for the model.
    """
    notes: list[str] = []
    settings: dict[str, Any] = {"gen_length": gen_length, "block_length": block_length}
    if model is None:
        if tiny.zoo_installed("toy-dllm"):
            model = "toy-dllm"
        else:
            model = tiny.tiny_dllm(0, **TINY_GREEDY)
            settings["block_length"] = block_length or TINY_GREEDY_BLOCK_LENGTH
            notes.append(
                "toy-dllm weights are not installed: the greedy check ran on a tiny random "
                f"model (vocab {TINY_GREEDY['vocab']}, float64)"
            )
    if isinstance(model, str):
        model = load_model(model, dtype="float64")
    if prompts is None:
        if model.tokenizer is not None:
            from dloom.zoo.tasks import held_out

            prompts = [example.prompt for example in held_out(count)]
        else:
            prompts = _random_prompts(model, count)
    if str(model.dtype) != "torch.float64":
        notes.append(f"the greedy check ran in {model.dtype}, not float64: near-ties may differ by rounding")
    return model, list(prompts), settings, notes


# --- options -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GreedyOptions:
    """The greedy check's model, prompts and lengths (see :func:`greedy_setup`).

    Against an AR target only ``prompt_count`` and ``gen_length`` (the most new tokens)
    apply: the check runs on the toy zoo's or a tiny random model pair
    (:func:`dloom.check.target.greedy_pair`).
    """

    model: ModelAdapter | str | None = None
    prompts: Sequence[Any] | None = None
    prompt_count: int = DEFAULT_PROMPTS
    gen_length: int | None = None
    block_length: int | None = None

    def run(self, ours: Resolved, ref: Resolved, notes: list[str]) -> GreedyComparison:
        """Compare ``ours`` with ``ref`` (:func:`dloom.check.greedy.compare_greedy`)."""
        adapter, prompts, settings, setup_notes = greedy_setup(
            self.model, self.prompts, self.prompt_count, self.gen_length, self.block_length
        )
        notes.extend(setup_notes)
        stage(f"greedy identity: {ours.name} vs {ref.name} on {len(prompts)} prompts ({adapter.name})")
        return compare_greedy(ours, ref, adapter, prompts, **settings)

    def run_against_target(self, make_decoder: Callable[..., Any], notes: list[str]) -> GreedyComparison:
        """Compare the decoder ``make_decoder`` builds with its AR target's greedy decoding."""
        from dloom.check.target import compare_target_greedy, greedy_pair

        ignored = [name for name in ("model", "prompts", "block_length") if getattr(self, name) is not None]
        if ignored:
            notes.append(f"{', '.join(ignored)} ignored: the greedy check against an AR target runs on a model pair")
        target, drafter, prompts, length, setup_notes = greedy_pair(self.prompt_count, self.gen_length)
        notes.extend(setup_notes)
        stage(f"greedy identity against the AR target on {len(prompts)} prompts")
        return compare_target_greedy(make_decoder, target, drafter, prompts, length)


def _split(options: Mapping[str, Any], *kinds: type) -> tuple[Any, ...]:
    """One instance of each options dataclass in ``kinds``, from the keyword ``options``
    that it declares.

    :raises TypeError: for a keyword none of them declares (as Python does for an unknown
        keyword argument).
    """
    names = [{f.name for f in fields(kind)} for kind in kinds]
    allowed = set().union(*names)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"unexpected option {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
    return tuple(kind(**{k: v for k, v in options.items() if k in n}) for kind, n in zip(kinds, names))


# --- the checks --------------------------------------------------------------------------


def _guarded(
    ours: Resolved, claim: dict[str, Any] | None, notes: list[str], run: Callable[[], CheckReport],
    probe: bool = True, kernel_claims: bool = False,
) -> CheckReport:
    """``run()``, after probing the commit rule's contract (``probe``) and, with
    ``kernel_claims``, testing the claims of each kernel ``ours`` runs on; a contract break,
    found by the probe or raised while checking, is the verdict :data:`CONTRACT_BROKEN`, a
    broken kernel claim :data:`KERNEL_CLAIM_BROKEN`, and the kernel claims that held join
    the report's evidence."""
    claimed_by = ours.claimed_by if claim else None
    try:
        if probe:
            stage(f"hook contract of {ours.name}'s commit rule")
            found = probe_commit_rule(ours)
            if found is not None:
                return CheckReport(
                    ours.name, claim, claimed_by, CONTRACT_BROKEN,
                    f"the commit rule broke the dloom_select_commit contract: {found.problem}",
                    {"contract": {**found.to_json(), "claim": _empty_claim(ours) if found.empty else None}}, notes,
                )
        held: dict[str, Any] = {}
        kernels = [k for k in ours.kernels if k in KERNEL_CHECKS] if kernel_claims else []
        for kernel in kernels:
            stage(f"the {kernel} kernel's claims on decodes of {ours.name}")
            tested = KERNEL_CHECKS[kernel](ours)
            held[kernel] = tested.to_json()
            if tested.failed:
                first = tested.claims[tested.failed[0]]["detail"]
                return CheckReport(
                    ours.name, claim, claimed_by, KERNEL_CLAIM_BROKEN,
                    f"decodes on the {kernel} kernel broke its claim(s) {', '.join(tested.failed)}: {first}",
                    {"kernel_claims": held}, notes,
                )
        report = run()
        if held:
            report.evidence["kernel_claims"] = held
        return report
    except HookContractError as error:
        return CheckReport(
            ours.name, claim, claimed_by, CONTRACT_BROKEN, f"a hook broke its contract: {error}",
            {"contract": {"error": str(error)}}, notes,
        )


def _empty_claim(ours: Resolved) -> str:
    """The kernel claim a commit rule breaks by committing nothing: ``accepts`` for a rule
    that runs on the uniform kernel only, ``fills`` otherwise."""
    return ACCEPTS if tuple(ours.kernels) == (UNIFORM,) else FILLS


def check_lossless(
    strategy: Any,
    against: Any,
    *,
    params: dict[str, Any] | None = None,
    against_params: dict[str, Any] | None = None,
    **options: Any,
) -> CheckReport:
    """Test "``strategy`` is lossless with respect to ``against``", declared or not.

    Greedy token identity on ``prompts`` over ``model`` (:func:`greedy_setup`); then, when
    ``temperature > 0`` and greedy found no difference, the sampling test on ``seeds`` tiny
    enumerable models with ``samples`` samples each (:func:`dloom.check.sampling.sampling_test`).

    :param strategy: a strategy name (``"a+b"``), :class:`~dloom.hooks.registry.Strategy`,
        :class:`~dloom.StrategyRegistration` or plugin object; ``params`` are its parameters.
    :param against: the reference, given the same ways, or ``"kernel"``, or ``"target"``
        (a FailFast strategy's AR target: :mod:`dloom.check.target`).
    :param options: fields of :class:`GreedyOptions` (``model``, ``prompts``,
        ``prompt_count``, ``gen_length``, ``block_length``) and of
        :class:`~dloom.check.sampling.SamplingOptions` (``temperature``, ``samples``,
        ``seeds``, ``alpha``, ``epsilon``, ``min_power``).
    """
    greedy, sampling = _split(options, GreedyOptions, SamplingOptions)
    ours = resolve(strategy, params)
    notes: list[str] = []
    return _guarded(ours, None, notes, partial(
        _lossless, ours, against, against_params, greedy, sampling, claim=None, notes=notes
    ))


def _lossless(
    ours: Resolved, against: Any, against_params: dict[str, Any] | None, greedy_options: GreedyOptions,
    options: SamplingOptions, claim: dict[str, Any] | None, notes: list[str], run_greedy: bool = True,
) -> CheckReport:
    """Greedy identity (unless ``run_greedy`` is false: a claim not made at temperature 0),
    then the sampling test at ``options.temperature > 0``."""
    sample: Callable[[], SamplingTest]
    greedy: GreedyComparison | None = None
    if against == TARGET:
        from dloom.check.target import ar_target_factory, target_sampling_test

        make_decoder = ar_target_factory(ours.spec, ours.params)
        ref_name = "the target"
        if run_greedy:
            greedy = greedy_options.run_against_target(make_decoder, notes)
        sample = partial(target_sampling_test, make_decoder, options)
    else:
        ref = reference(against, ours, against_params)
        ref_name = ref.name
        if run_greedy:
            greedy = greedy_options.run(ours, ref, notes)
        sample = partial(sampling_test, ours, ref, options)
    evidence: dict[str, Any] = {}
    report = CheckReport(ours.name, claim, ours.claimed_by if claim else None, "", "", evidence, notes)
    if greedy is None:
        test = sample()
        evidence["sampling"] = test.to_json()
        report.verdict = test.verdict
        report.reason = f"sampling at T={options.temperature:g}: {test.reason}"
        return report
    evidence["greedy"] = greedy.to_json()
    if greedy.first_difference is not None:
        first = greedy.first_difference
        report.verdict = "not lossless"
        report.reason = (
            f"greedy outputs differ from {ref_name}'s on {greedy.prompts - greedy.identical} of "
            f"{greedy.prompts} prompts; first at prompt {first['prompt']}, position {first['position']}"
        )
        if options.temperature > 0:
            notes.append("sampling test skipped: the greedy check already refutes the claim")
        return report
    if options.temperature <= 0:
        report.verdict = "lossless"
        report.reason = f"greedy outputs equal {ref_name}'s on all {greedy.prompts} prompts"
        notes.append("temperature 0: the sampling test was not run (pass a temperature > 0)")
        return report
    test = sample()
    evidence["sampling"] = test.to_json()
    report.verdict = test.verdict
    report.reason = (
        f"greedy outputs equal {ref_name}'s on all {greedy.prompts} prompts; "
        f"sampling at T={options.temperature:g}: {test.reason}"
    )
    return report


def check_soundness(
    strategy: Any,
    bound: str | None = None,
    *,
    params: dict[str, Any] | None = None,
    **options: Any,
) -> CheckReport:
    """Test a commit rule's bound claim (:mod:`dloom.check.bounds`).

    :param bound: the bound's name or import path; default: the one the strategy declares
        (without one, only the rule's joint-mode certificate is tested).
    :param options: fields of :class:`~dloom.check.bounds.BoundOptions` (``random_joints``,
        ``adversarial_joints``, ``seed``).
    """
    (bound_options,) = _split(options, BoundOptions)
    ours = resolve(strategy, params)
    if bound is None and ours.claim is not None:
        bound = ours.claim.bound
    notes: list[str] = []
    return _guarded(ours, None, notes, partial(_sound, ours, bound, bound_options, claim=None, notes=notes))


def _sound(
    ours: Resolved, bound: str | None, options: BoundOptions, claim: dict[str, Any] | None,
    notes: list[str],
) -> CheckReport:
    stage(
        f"soundness of {ours.name}: {options.random_joints} random and "
        f"{options.adversarial_joints} adversarial joints"
    )
    result = check_bound(ours, bound, options)
    if bound is None:
        notes.append("no bound function named: only the joint-mode certificate of the commits was tested")
    if result.verdict == "sound" and result.certified_commits == 0:
        notes.append("the rule never committed two positions at once: the certificate was not exercised")
    if result.counterexample is None:
        reason = (
            f"no counterexample on {options.random_joints + options.adversarial_joints} joints "
            f"({options.random_joints} random, {options.adversarial_joints} adversarial; seed {options.seed})"
        )
    else:
        c = result.counterexample
        reason = f"counterexample on joint {c['joint']} ({c['kind']}): {c['problem']}"
    return CheckReport(
        ours.name, claim, ours.claimed_by if claim else None, result.verdict, reason,
        {"bound": result.to_json()}, notes,
    )


def check_strategy(
    strategy: Any,
    against: Any = None,
    *,
    params: dict[str, Any] | None = None,
    against_params: dict[str, Any] | None = None,
    **options: Any,
) -> CheckReport:
    """Test the claim ``strategy`` declares (see the module docstring); the options are
    those of :func:`check_lossless` and :func:`check_soundness`.

    :param against: overrides the reference of a ``lossless`` claim (noted in the report);
        for ``approximate``, ``reference`` or no claim, the strategy to measure greedy
        agreement with (default: an ``approximate`` claim's own ``against``).

    One run builds many decoders (the user's model, each tiny model of the sampling test):
    a plugin's warning shows once (:func:`dloom.errors.each_warning_once`).
    """
    with each_warning_once():
        return _check_strategy(strategy, against, params, against_params, options)


def _check_strategy(
    strategy: Any, against: Any, params: dict[str, Any] | None, against_params: dict[str, Any] | None,
    options: dict[str, Any],
) -> CheckReport:
    greedy_options, sampling_options, bound_options = _split(
        options, GreedyOptions, SamplingOptions, BoundOptions
    )
    ours = resolve(strategy, params)
    notes: list[str] = []
    claim_json = ours.claim.to_json() if ours.claim is not None else None
    return _guarded(ours, claim_json, notes, partial(
        _check_claim, ours, against, against_params, notes, greedy_options, sampling_options,
        bound_options,
    ), kernel_claims=True)


def _check_claim(
    ours: Resolved, against: Any, against_params: dict[str, Any] | None, notes: list[str],
    greedy_options: GreedyOptions, sampling_options: SamplingOptions, bound_options: BoundOptions,
) -> CheckReport:
    """:func:`check_strategy` once the commit rule kept its contract."""
    claim = ours.claim
    claim_json = claim.to_json() if claim is not None else None
    unmet = claim.unmet(ours.claim_values) if claim is not None else []
    run_greedy = True
    if claim is not None and claim.kind == "lossless" and not unmet:
        # the greedy check runs at temperature 0, the sampling test at the option's
        greedy_unmet = claim.unmet({"temperature": 0.0, "remasking": "low_confidence"})
        sampling_unmet = claim.unmet({"temperature": sampling_options.temperature, "remasking": "low_confidence"})
        if greedy_unmet and (sampling_unmet or sampling_options.temperature <= 0):
            unmet = greedy_unmet
        elif sampling_unmet and sampling_options.temperature > 0:
            notes.append(f"sampling test skipped: the claim is not made at {', '.join(sampling_unmet)}")
            sampling_options = dataclasses.replace(sampling_options, temperature=0.0)
        elif greedy_unmet:
            notes.append(f"greedy check skipped: the claim is not made at {', '.join(greedy_unmet)}")
            run_greedy = False
    if claim is not None and unmet:
        reason = f"{ours.name} makes no {claim.kind} claim at {', '.join(unmet)}: nothing to test"
        return CheckReport(ours.name, claim_json, ours.claimed_by, NOT_CLAIMED, reason, {}, notes)
    if claim is None or claim.kind in ("approximate", "reference"):
        if claim is None:
            verdict, target = "no claim", against
            reason = (
                f"{ours.name} declares no claim: nothing to test (declare one with "
                "StrategyRegistration(claim=dloom.Claim(...)))"
            )
        elif claim.kind == "reference":
            verdict, target = "reference", against
            reason = (
                f"{ours.name} is a reference process: lossless with respect to itself by "
                "definition; nothing to test"
            )
        else:
            verdict, target = "approximate", against if against is not None else claim.against
            reason = f"{ours.name} is approximate: no lossless claim to test"
        evidence = {}
        if target is not None:
            ref = reference(target, ours, against_params)
            greedy = greedy_options.run(ours, ref, notes)
            evidence["greedy"] = greedy.to_json()
            reason += f"; greedy agreement with {ref.name}: {greedy.identical}/{greedy.prompts} prompts"
        return CheckReport(ours.name, claim_json, ours.claimed_by, verdict, reason, evidence, notes)
    if claim.kind == "bound":
        if against is not None:
            notes.append(
                f"--against {against} ignored: {ours.name} declares a bound, not losslessness "
                "(dloom.check.check_lossless tests losslessness anyway)"
            )
        return _sound(ours, claim.bound, bound_options, claim_json, notes)
    target = claim.against
    if against is not None and against != target:
        if target == TARGET:
            notes.append(f"--against {against} ignored: {ours.name} is lossless against its AR target")
        else:
            notes.append(f"testing against {against}, not the declared {target}")
            target = against
    return _lossless(ours, target, against_params, greedy_options, sampling_options, claim_json, notes, run_greedy)


# --- assertions for plugin authors' tests --------------------------------------------------


def assert_lossless(strategy: Any, against: Any, **options: Any) -> CheckReport:
    """Fail (``AssertionError`` with the report) unless :func:`check_lossless` says
    ``lossless``; return the report. ``options`` go to :func:`check_lossless`."""
    report = check_lossless(strategy, against, **options)
    if report.verdict != "lossless":
        raise AssertionError("dloom check: expected lossless\n" + report.render())
    return report


def assert_sound(strategy: Any, bound: str | None = None, **options: Any) -> CheckReport:
    """Fail unless :func:`check_soundness` says ``sound``; return the report."""
    report = check_soundness(strategy, bound, **options)
    if report.verdict != "sound":
        raise AssertionError("dloom check: expected a sound bound\n" + report.render())
    return report
