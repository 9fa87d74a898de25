"""``wino``: WINO's draft-low, remask-suspicious rule on the revisable kernel, on hand-worked
profiles, against a plain loop written here, batch-invariantly, and under ``dloom check``
(with broken variants caught)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dloom
from conftest import edit_schedule, revisable
from dloom import Edits
from dloom.check import check_strategy, tiny
from dloom.check.kernel_claims import KERNEL_CLAIMS, check_kernel_claims
from dloom.check.resolve import resolve
from dloom.decode import revisable as revisable_kernel
from dloom.errors import ConfigurationError
from dloom.hooks.registry import Strategy, get_registry
from dloom_plugins.baselines import WinoCommit

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]


def test_a_fill_step_drafts_above_tau_and_remasks_filled_tokens_below_remask_tau():
    # row 0: positions 0-2 masked (confidence 0.7, 0.5, 0.65: 0 and 2 pass tau 0.6); 3-5 filled,
    #   their tokens at 0.95, 0.4, 0.89: 4 and 5 fall below remask_tau 0.9 (3 is offered for an
    #   edit, its candidate differing, but a fill step does not rewrite).
    # row 1: positions 0-1 masked, none above tau: the most confident (1) alone; 2 filled at 0.3.
    confidence = torch.tensor([[0.7, 0.5, 0.65, 0.8, 0.3, 0.6], [0.2, 0.4, 0.9, 0.1, 0.1, 0.1]], dtype=torch.float64)
    selectable = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    plan = edit_schedule([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], [0, 0])
    probability = torch.tensor([[0.0, 0.0, 0.0, 0.95, 0.4, 0.89], [0.0, 0.0, 0.3, 0.99, 0.99, 0.99]], dtype=torch.float64)
    got = WinoCommit(0.6, 0.9, 0).dloom_select_commit(confidence, selectable, plan, {"token_probability": probability})
    assert isinstance(got, Edits) and got.remask is not None
    assert got.commit.int().tolist() == [[1, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]]
    assert got.remask.int().tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 1, 0, 0, 0]]
    assert not got.delete.any() and not got.split.any()


def test_a_post_step_rewrites_suspicious_offered_tokens_within_its_budget_and_never_remasks():
    # no mask left; positions 0 and 1 offered (their candidate differs), 2 not
    confidence = torch.tensor([[0.8, 0.7, 0.9]] * 3, dtype=torch.float64)
    selectable = torch.tensor([[1, 1, 0]] * 3, dtype=torch.bool)
    probability = torch.tensor([[0.1, 0.95, 0.2]] * 3, dtype=torch.float64)
    plan = edit_schedule([[0, 0, 0]] * 3, [1, 2, 3])  # row 2 is past a budget of 2
    got = WinoCommit(0.6, 0.9, 2).dloom_select_commit(confidence, selectable, plan, {"token_probability": probability})
    assert got.commit.int().tolist() == [[1, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert not got.remask.any()
    none = WinoCommit(0.6, 0.9, 0).dloom_select_commit(confidence, selectable, plan, {"token_probability": probability})
    assert not none.commit.any()


@pytest.mark.parametrize("params, message", [
    ({"tau": 0.0}, "parameter 'tau' of strategy 'wino' is 0.0; allowed: (0, 1)"),
    ({"tau": 1.0}, "parameter 'tau' of strategy 'wino' is 1.0; allowed: (0, 1)"),
    ({"remask_tau": 1.5}, "parameter 'remask_tau' of strategy 'wino' is 1.5; allowed: (0, 1]"),
    ({"max_post_steps": -1}, "parameter 'max_post_steps' of strategy 'wino' is -1; allowed: [0, inf)"),
    ({"tau": 0.9, "remask_tau": 0.8}, "strategy 'wino': tau is 0.9 and remask_tau is 0.8; allowed: tau < remask_tau"),
    ({"tau": 0.9}, "strategy 'wino': tau is 0.9 and remask_tau is 0.9; allowed: tau < remask_tau"),
])
def test_bad_parameters_are_named_with_what_is_allowed(sharp_adapter, params, message):
    with pytest.raises(ConfigurationError) as raised:
        dloom.DiffusionDecoder(revisable(sharp_adapter), "wino", gen_length=8, block_length=4, **params)
    assert message in str(raised.value)


def reference_wino(adapter, prompt, gen_length, block_length, tau, remask_tau, max_post_steps):
    """WINO on one row as a plain loop over this model's layout (blocks after the prompt,
    every forward over the whole sequence), candidates and probabilities as dloom's kernel
    reads them (the mask token excluded): fill above tau (at least the surest), remask the
    filled tokens below remask_tau, at most one fewer than the fills, least probable first;
    once the block is full, rewrite tokens below remask_tau for up to max_post_steps steps.

    :return: the generated tokens, the forwards, and the remasks made.
    """
    mask, eos = adapter.mask_token_id, adapter.eos_token_ids
    x = torch.tensor([prompt + [mask] * gen_length])
    start, forwards, remasks = len(prompt), 0, 0
    for block in range(gen_length // block_length):
        lo, hi = start + block * block_length, start + (block + 1) * block_length
        post_steps = 0
        while True:
            old = x[0, lo:hi].clone()
            masked = old == mask
            if not masked.any():
                post_steps += 1
                if post_steps > max_post_steps:
                    break
            logits = adapter.model(input_ids=x).logits[0, lo:hi].double()
            forwards += 1
            logits[:, mask] = -torch.inf
            probs = torch.softmax(logits, -1)
            x0 = probs.argmax(-1)
            p = probs.gather(-1, x0[:, None])[:, 0]
            held = torch.where(masked, 0.0, probs.gather(-1, old[:, None])[:, 0]).detach()
            new = old.clone()
            if masked.any():
                fill = masked & (p > tau)
                if not fill.any():
                    fill[torch.where(masked, p, -torch.inf).argmax()] = True
                new[fill] = x0[fill]
                suspicious = [j for j in range(len(old)) if not masked[j] and held[j] < remask_tau]
                suspicious.sort(key=lambda j: (float(held[j]), j))
                for j in suspicious[: int(fill.sum()) - 1]:
                    new[j] = mask
                    remasks += 1
            else:
                edit = (x0 != old) & (held < remask_tau)
                new[edit] = x0[edit]
                if not edit.any():
                    break
            x[0, lo:hi] = new
        if any(t in eos for t in x[0, start:hi].tolist()):
            break
    generated = x[0, start:].tolist()
    ends = [i for i, t in enumerate(generated) if t in eos]
    return generated[: ends[0] + 1] if ends else generated, forwards, remasks


@pytest.mark.parametrize("tau, remask_tau, max_post_steps", [(0.6, 0.9, 0), (0.3, 0.9, 2)])
def test_wino_decodes_as_a_plain_loop_and_a_batch_as_its_rows_alone(sharp_adapter, tau, remask_tau, max_post_steps):
    settings = dict(gen_length=16, block_length=4, tau=tau, remask_tau=remask_tau, max_post_steps=max_post_steps)
    decoder = dloom.DiffusionDecoder(revisable(sharp_adapter), "wino", **settings)
    batch = decoder.generate(PROMPTS)
    remasks = 0
    for row, prompt in enumerate(PROMPTS):
        tokens, forwards, made = reference_wino(sharp_adapter, prompt, 16, 4, tau, remask_tau, max_post_steps)
        remasks += made
        assert batch.token_lists[row] == tokens and int(batch.nfe[row]) == forwards
        alone = decoder.generate([prompt])
        assert alone.token_lists[0] == batch.token_lists[row] and int(alone.nfe[0]) == int(batch.nfe[row])
    assert remasks > 0, "no remask was made: the test is vacuous"


def test_refused_on_the_absorbing_kernel(sharp_adapter):
    with pytest.raises(ConfigurationError, match="'wino' supports the 'revisable' kernel"):
        dloom.DiffusionDecoder(sharp_adapter, "wino", gen_length=8, block_length=4)


def test_dloom_check_passes_wino_on_the_editing_zoo_model():
    report = check_strategy("wino", model="long-dllm-words-edit", prompt_count=8)
    assert (report.verdict, report.exit_code, report.failed_claims) == ("approximate", 0, []), report.render()
    assert "greedy agreement with quota" in report.reason
    kernel = report.evidence["kernel_claims"]["revisable"]["claims"]
    assert list(kernel) == list(KERNEL_CLAIMS["revisable"])
    assert all(outcome["verdict"] == "holds" for outcome in kernel.values())
    # not vacuous: on the tiny model the kernel keeps remasks, and post steps edit
    watched = check_kernel_claims(resolve("wino", {"max_post_steps": 2}))
    assert watched.failed == [], watched.claims
    assert "(0 remask" not in watched.claims["progress"]["detail"]
    assert " 0 edits" not in watched.claims["edit_budget"]["detail"]


class WinoPastBudget(WinoCommit):
    """A broken WINO: rewrites suspicious tokens in every post step, whatever its budget."""

    @dloom.hookimpl
    @dloom.reads_signals("token_probability")
    def dloom_select_commit(self, confidence, selectable, schedule, signals):
        answer = super().dloom_select_commit(confidence, selectable, schedule, signals)
        if schedule.masked is None:
            return answer
        post = ~schedule.masked.any(-1, keepdim=True)
        rewrites = selectable & post & (signals["token_probability"] < self.remask_tau)
        return dataclasses.replace(answer, commit=answer.commit | rewrites)


def test_dloom_check_catches_a_wino_past_its_budget_and_a_kernel_without_the_remask_cap(monkeypatch):
    monkeypatch.setattr(tiny, "zoo_installed", lambda *names: False)
    registration = dataclasses.replace(get_registry().strategies["wino"].registration, plugin_class=WinoPastBudget)
    get_registry().strategies["wino-past-budget"] = Strategy("wino-past-budget", "tests", registration)
    report = check_strategy("wino-past-budget", params={"tau": 0.05, "remask_tau": 0.5}, prompt_count=2)
    assert (report.verdict, report.failed_claims) == ("kernel claim broken", ["edit_budget"]), report.render()

    monkeypatch.setattr(revisable_kernel, "kept_remasks", lambda remask, probability, filled: remask)
    report = check_strategy("wino", params={"tau": 0.05, "remask_tau": 0.99}, prompt_count=2)
    assert (report.verdict, report.failed_claims) == ("kernel claim broken", ["progress"]), report.render()
