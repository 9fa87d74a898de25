"""Spiffy is lossless: it decodes what its commit rule decodes one forward per step.

Claim (``docs/strategies/spiffy.md``): a verification forward gives
every draft the distribution a standalone forward on that draft's state would give (batch
rows always; packed spans under the dual cache or on block-causal models), and the verifier
takes every step with the reference kernel, continuing from a draft only when the sampled
state *equals* it. So the output distribution is the base strategy's, and under greedy
decoding (float64) the tokens are the same.

Checked here:

* greedy: token identity with the base strategy alone, on tiny random models (bidirectional
  and block-causal) for every base rule and every exact layout and cache combination, and
  on the shipped ``toy-dllm`` with its built-in graphs on held-out task prompts; the runs
  must actually accept drafts, or identity would prove nothing;
* sampling: ``dloom.check``'s chi-square test against the exact output distribution
  obtained by enumerating the kernel, on tiny models with vocabulary 6 and 3-4 generated
  positions, 20,000 samples per seed, three seeds (``slow``: about three minutes);
* negative controls, each detected: a verifier that reuses a draft's distribution for a
  state that differs from it, and the packed layout on a bidirectional model without cache.
"""

from __future__ import annotations

import dataclasses
import warnings
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from dloom import DiffusionDecoder, ModelAdapter, hookimpl
from dloom.check.report import check_lossless
from dloom.decode.speculation import follow_graph
from dloom.errors import HookContractError
from dloom.model.cost import CostCurve
from dloom.types import Verdict
from dloom.zoo import model_path
from dloom_plugins.spiffy import Spiffy
from dloom_plugins.spiffy.budget import (
    CACHED_MIN_GAIN,
    MIN_GAIN,
    choose_budget,
    expected_accepted,
    steps_per_block,
)
from dloom_plugins.spiffy.calibrate import calibrate

torch.set_num_threads(1)

VOCAB, MASK_ID, EOS_ID, PAD_ID = 40, 39, 2, 0
GEN_LENGTH, BLOCK_LENGTH = 16, 8
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18], [20, 21, 22, 23, 24]]
BASES = {"quota": {}, "threshold": {"tau": 0.5}, "factor": {"f": 1.5}, "frechet": {"delta": 0.0}}
FIXED_BUDGET = 10  # the tests that need drafts at a known budget; the auto ones name "auto"
EXACT = [
    ("bidirectional", "rows", "none"),
    ("bidirectional", "rows", "prefix"),
    ("bidirectional", "rows", "dual"),
    ("bidirectional", "packed", "dual"),
    ("block-causal", "rows", "none"),
    ("block-causal", "packed", "none"),
    ("block-causal", "packed", "prefix"),
    ("block-causal", "packed", "dual"),
]


@cache
def tiny(attention: str, shift: bool = False) -> ModelAdapter:
    """A float64 two-layer Llama with a sharpened head (confident, uneven profiles)."""
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
        initializer_range=0.5, is_causal=False, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    model = LlamaForCausalLM(config).eval().to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return ModelAdapter(
        model, mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        shift_logits=shift, attention=attention, max_context=96, name=f"tiny-{attention}",
    )


def decoder(model, strategy, params=None, **options) -> DiffusionDecoder:
    """A decoder; a Spiffy named by its strategy runs at budget 10 unless ``params`` give one
    (``budget=auto`` takes no drafts from an uncalibrated graph: nothing would be tested)."""
    settings = {"gen_length": GEN_LENGTH, "block_length": BLOCK_LENGTH, **options}
    params = dict(params or {})
    if isinstance(strategy, str) and "spiffy" in strategy.split("+"):
        params.setdefault("budget", FIXED_BUDGET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncalibrated-graph and temperature notes
        return DiffusionDecoder(model, strategy, params=params, **settings)


@cache
def graph_file(attention: str, base: str, tmp: str) -> str:
    """A graph calibrated on the tiny model itself (its own prompts, then a file)."""
    model = tiny(attention)
    prompts = [[t % 30 + 3, (t * 7) % 30 + 3, (t * 13) % 30 + 3] for t in range(12)]
    graph = calibrate(decoder(model, base, BASES[base]), prompts, budget=8)
    path = f"{tmp}/{attention}-{base}.json"
    graph.save(path)
    return path


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("graphs"))


@pytest.mark.parametrize("attention, layout, mode", EXACT)
def test_greedy_output_is_the_base_strategys_for_every_exact_layout_and_cache(
    attention, layout, mode, graph_dir
):
    model = tiny(attention)
    accepted = 0
    for base, params in BASES.items():
        reference = decoder(model, base, params, cache=mode).generate(PROMPTS)
        spiffy = decoder(
            model, f"spiffy+{base}",
            {**params, "graph": graph_file(attention, base, graph_dir), "layout": layout, "budget": 5},
            cache=mode,
        ).generate(PROMPTS)
        assert spiffy.token_lists == reference.token_lists, (base, layout, mode)
        assert torch.equal(spiffy.sequences, reference.sequences)
        assert spiffy.speculation["guarantee"] == "lossless"
        assert spiffy.nfe.sum() + spiffy.accepted_drafts == reference.nfe.sum()
        accepted += spiffy.accepted_drafts
    assert accepted > 0  # drafts were accepted, so identity is evidence


@pytest.mark.parametrize("attention, layout, mode", EXACT[:4])
@pytest.mark.parametrize("curve", [CostCurve.flat(), CostCurve.linear(1.0, 1.0)], ids=["flat", "steep"])
def test_greedy_identity_at_the_budget_auto_chooses(attention, layout, mode, curve, graph_dir, tmp_path):
    """``budget=auto`` drafts under a flat curve (where the graph's gains reach the bar) and
    nothing under a steep one: the base rule's tokens either way."""
    model, cost = tiny(attention), tmp_path / "cost.json"
    curve.save(cost)
    accepted, chosen = 0, []
    for base, params in BASES.items():
        reference = decoder(model, base, params, cache=mode).generate(PROMPTS)
        graph = graph_file(attention, base, graph_dir)
        built = decoder(model, f"spiffy+{base}",
                        {**params, "graph": graph, "layout": layout, "budget": "auto", "cost": str(cost)}, cache=mode)
        plugin = next(p for p in built.pm.get_plugins() if isinstance(p, Spiffy))
        steps = steps_per_block(plugin.graph)
        bar = MIN_GAIN if mode == "none" else CACHED_MIN_GAIN
        assert plugin.chosen_budget == choose_budget(expected_accepted(plugin.graph), curve, steps,
                                                     plugin.choice["overhead"], bar)
        chosen.append(plugin.chosen_budget)
        spiffy = built.generate(PROMPTS)
        assert spiffy.token_lists == reference.token_lists, (base, layout, mode)
        assert spiffy.nfe.sum() + spiffy.accepted_drafts == reference.nfe.sum()
        accepted += spiffy.accepted_drafts
    assert (max(chosen) > 0) == (curve.description["synthetic"] == "flat")
    assert (accepted > 0) == (max(chosen) > 0)  # drafting: identity is evidence; none: plain steps


def test_greedy_identity_for_a_shifted_model_and_left_padded_batch(graph_dir):
    model = tiny("bidirectional", shift=True)
    for layout, mode in [("rows", "none"), ("packed", "dual"), ("rows", "prefix")]:
        reference = decoder(model, "quota", cache=mode).generate(PROMPTS)
        spiffy = decoder(model, "spiffy", {"layout": layout}, cache=mode).generate(PROMPTS)
        assert spiffy.token_lists == reference.token_lists, (layout, mode)
        assert spiffy.accepted_drafts > 0


def test_seeded_sampling_of_one_row_draws_the_same_tokens(graph_dir):
    """One row, same seed: every kernel step consumes the sampler exactly as the base's does,
    so even the sampled tokens agree (a stronger statement than equal distributions)."""
    model = tiny("bidirectional")
    for prompt in PROMPTS:
        options = dict(temperature=1.0, seed=11)
        reference = decoder(model, "quota", **options).generate([prompt])
        spiffy = decoder(model, "spiffy+quota", {"graph": graph_file("bidirectional", "quota", graph_dir)},
                         **options).generate([prompt])
        assert spiffy.token_lists == reference.token_lists


TOY_INSTALLED = (model_path("toy-dllm") / "model.safetensors").exists()


def assert_identical_on_toy_dllm(base: str, layout: str, mode: str, prompts: int) -> None:
    from dloom import load_model
    from dloom.zoo.tasks import held_out

    model = load_model("toy-dllm", dtype="float64")
    texts = [example.prompt for example in held_out(prompts)]
    options = dict(block_length=8, cache=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a built-in graph must fit: no fallback warning
        spiffy = DiffusionDecoder(model, f"spiffy+{base}", layout=layout, budget=FIXED_BUDGET, **options)
    reference = DiffusionDecoder(model, base, **options).generate(texts)
    result = spiffy.generate(texts)
    assert result.token_lists == reference.token_lists
    # drafts were accepted, at least one per ten prompts, so the identity is evidence (a
    # Spiffy that never accepted a draft would equal its base rule trivially)
    assert result.accepted_drafts >= max(1, prompts // 10), (result.accepted_drafts, result.verifications)


@pytest.mark.skipif(not TOY_INSTALLED, reason="toy-dllm not installed")
@pytest.mark.parametrize("base, layout, mode", [
    ("quota", "packed", "dual"), ("threshold", "rows", "prefix"), ("frechet", "rows", "dual"),
])
def test_greedy_identity_on_the_toy_dllm_with_its_built_in_graphs(base, layout, mode):
    assert_identical_on_toy_dllm(base, layout, mode, prompts=21)


@pytest.mark.slow
@pytest.mark.skipif(not TOY_INSTALLED, reason="toy-dllm not installed")
@pytest.mark.parametrize("layout, mode", [("rows", "none"), ("packed", "dual")])
@pytest.mark.parametrize("base", list(BASES))
def test_greedy_identity_on_140_held_out_prompts(base, layout, mode):
    assert_identical_on_toy_dllm(base, layout, mode, prompts=140)


@pytest.mark.slow
def test_sampled_output_distribution_equals_the_kernels():
    report = check_lossless("spiffy", "quota", samples=20_000, seeds=3, prompt_count=8)
    assert report.verdict == "lossless", report.render()
    assert all(s["samples"] == 20_000 for s in report.evidence["sampling"]["seeds"])


# --- negative controls -------------------------------------------------------------------


CONTROL_SAMPLES = 4_000
"""Enough to refute the broken verifier below (its bias is large); the full-power test of
the correct one is :func:`test_sampled_output_distribution_equals_the_kernels`."""


class ReusesAMismatchedDraft(Spiffy):
    """Broken on purpose: after the first kernel step, continue from the first valid child
    that committed the same *positions*, whatever tokens it holds (its distribution is then
    that of another state)."""

    @hookimpl
    def dloom_verify(self, state, graph, logits, kernel) -> Verdict:
        root = torch.zeros_like(graph.tokens[:, 0, 0])
        block = kernel(graph.tokens[:, 0], logits.of(root), graph.valid[:, 0])
        mask = state.mask_token_id
        same_positions = ((graph.tokens == mask) == (block == mask).unsqueeze(1)).all(-1)
        hits = graph.children(torch.zeros_like(block[:, 0])) & graph.valid & same_positions
        found = hits.any(-1) & (block == mask).any(-1)
        node = hits.long().argmax(-1)
        wrong = torch.where(found[:, None, None], logits.of(node), logits.of(root))
        nxt = kernel(block, wrong, found)
        return Verdict(block=nxt, logits=wrong, accepted=found.long())


def test_a_verifier_reusing_a_mismatched_draft_is_caught_by_the_sampling_test():
    broken = [ReusesAMismatchedDraft(budget=FIXED_BUDGET), "quota"]
    report = check_lossless(broken, "quota", samples=CONTROL_SAMPLES, seeds=2, prompt_count=4)
    assert report.verdict == "not lossless", report.render()


@pytest.mark.parametrize("attention", ["bidirectional", "block-causal"])
def test_the_broken_verifier_is_caught_at_the_budget_auto_chooses(attention, graph_dir, tmp_path):
    """The negative control at a chosen ``D`` (a flat curve makes ``auto`` draft the whole
    calibrated graph): the broken verifier's greedy tokens are not the rule's, the correct
    one's are."""
    model, cost = tiny(attention), tmp_path / "flat.json"
    CostCurve.flat().save(cost)
    caught = 0
    for base, params in BASES.items():
        reference = decoder(model, base, params).generate(PROMPTS)
        settings = {**params, "graph": graph_file(attention, base, graph_dir), "budget": "auto", "cost": str(cost)}
        broken = ReusesAMismatchedDraft(**{k: v for k, v in settings.items() if k not in params})
        wrong = decoder(model, [broken, base], params).generate(PROMPTS)
        if broken.chosen_budget:
            caught += wrong.token_lists != reference.token_lists
        else:  # nothing drafted, nothing to break
            assert wrong.token_lists == reference.token_lists
    assert caught > 0


def test_the_same_check_passes_the_correct_verifier():
    """Same test, same budget, correct verifier: not refuted (the control's failure is the
    verifier's, not the test's)."""
    report = check_lossless([Spiffy(budget=FIXED_BUDGET), "quota"], "quota", samples=CONTROL_SAMPLES, seeds=2, prompt_count=4)
    assert report.verdict != "not lossless", report.render()
    assert min(s["p_value"] for s in report.evidence["sampling"]["seeds"]) > 1e-3


def test_packed_layout_on_a_bidirectional_model_without_cache_is_detected_and_labelled():
    model = tiny("bidirectional")
    reference = decoder(model, "quota").generate(PROMPTS)
    packed = decoder(model, "spiffy", {"layout": "packed"}).generate(PROMPTS)
    assert packed.speculation["guarantee"] == "near-lossless"
    assert packed.token_lists != reference.token_lists


# --- a block's first forward (first_forward) -----------------------------------------------
#
# Without a cache, a verification forward sees the whole canvas, so a draft whose block is
# complete is evaluated on exactly the canvas the reference's next forward reads (the next
# block's first). When a step completes the block in a state that equals such a draft, its
# next-block logits take the next block's first step without a forward. Checked: token
# identity and the exact NFE account (every saved forward is an accepted draft) over random
# settings, forwards actually saved, and two broken variants caught.


def first_forward_run(model, base, params, prompts, first_forward=True, plugin=None, **options):
    """Spiffy over ``base`` without a cache (rows layout), first-forward drafting as asked."""
    budget = options.pop("budget", 5)
    spiffy = plugin if plugin is not None else Spiffy(budget=budget, first_forward=first_forward)
    settings = {"gen_length": GEN_LENGTH, "block_length": BLOCK_LENGTH, **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DiffusionDecoder(model, [spiffy, base], params=params, **settings).generate(prompts)


@settings(max_examples=12, deadline=None)
@given(
    attention=st.sampled_from(["bidirectional", "block-causal"]), shift=st.booleans(),
    base=st.sampled_from(list(BASES)), budget=st.integers(1, 8),
    block_length=st.sampled_from([2, 4, 8]), blocks=st.integers(2, 4),
    prompts=st.lists(st.lists(st.integers(3, 30), min_size=1, max_size=6), min_size=1, max_size=4),
)
def test_first_forward_drafting_keeps_the_base_rules_tokens_and_accounts_every_saved_forward(
    attention, shift, base, budget, block_length, blocks, prompts
):
    model = tiny(attention, shift) if attention == "bidirectional" else tiny(attention)
    options = dict(gen_length=block_length * blocks, block_length=block_length)
    reference = decoder(model, base, BASES[base], **options).generate(prompts)
    result = first_forward_run(model, base, BASES[base], prompts, budget=budget, **options)
    assert result.token_lists == reference.token_lists
    assert torch.equal(result.sequences, reference.sequences)
    assert result.speculation["guarantee"] == "lossless"
    # exact: every forward the reference runs is either run here or an accepted draft
    assert int(result.nfe.sum()) + result.accepted_drafts == int(reference.nfe.sum())


@pytest.mark.parametrize("attention", ["bidirectional", "block-causal"])
def test_first_forward_drafting_saves_forwards_on_calibrated_graphs(attention, graph_dir):
    """Same graphs, first-forward drafting off then on: the same tokens, strictly fewer
    forwards with it, and the difference is accepted (primed) drafts."""
    model = tiny(attention)
    saved = 0
    for base, params in BASES.items():
        graph = graph_file(attention, base, graph_dir)
        off, on = (
            first_forward_run(model, base, params, PROMPTS,
                              plugin=Spiffy(graph=graph, budget=5, first_forward=flag))
            for flag in (False, True)
        )
        reference = decoder(model, base, params).generate(PROMPTS)
        assert on.token_lists == off.token_lists == reference.token_lists, base
        for result in (off, on):
            assert int(result.nfe.sum()) + result.accepted_drafts == int(reference.nfe.sum()), base
        saved += int(off.nfe.sum() - on.nfe.sum())
    assert saved > 0


def test_seeded_sampling_with_first_forward_drafting_draws_the_base_rules_tokens():
    """One row, same seed, temperature 0.3: a primed step samples from the reference's
    distribution with the reference's random draw, so the sampled tokens are the base
    rule's; and priming happens (fewer forwards than with it off), so this is evidence."""
    model = tiny("bidirectional")
    nfe = {False: 0, True: 0}
    for prompt in PROMPTS:
        options = dict(temperature=0.3, seed=11)
        reference = decoder(model, "quota", **options).generate([prompt])
        for flag in (False, True):
            result = first_forward_run(model, "quota", {}, [prompt], first_forward=flag, **options)
            assert result.token_lists == reference.token_lists, (prompt, flag)
            assert int(result.nfe.sum()) + result.accepted_drafts == int(reference.nfe.sum())
            nfe[flag] += int(result.nfe.sum())
    assert nfe[True] < nfe[False], nfe


class PrimesFromTheStaleForward(Spiffy):
    """Broken on purpose: a completed block primes its next block with the next-block logits
    of the forward it was completed *from* (the root's: the finished block not yet in it),
    "the logits the model already produced" taken without a draft of the completed state."""

    @hookimpl
    def dloom_verify(self, state, graph, logits, kernel) -> Verdict:
        verdict = follow_graph(graph, logits, kernel)
        complete = ~(verdict.block == state.mask_token_id).any(-1)
        root = torch.zeros_like(complete, dtype=torch.long)
        return dataclasses.replace(verdict, primed=complete, next_logits=logits.next_of(root))


class PrimesFromAnUncheckedDraft(Spiffy):
    """Broken on purpose: a completed block primes from the likeliest valid draft that fills
    its block, whether or not the completed block equals it."""

    @hookimpl
    def dloom_verify(self, state, graph, logits, kernel) -> Verdict:
        verdict = follow_graph(graph, logits, kernel)
        complete = ~(verdict.block == state.mask_token_id).any(-1)
        full_drafts = graph.valid & ~(graph.tokens == state.mask_token_id).any(-1)
        likeliest = torch.where(full_drafts, graph.score, -torch.inf).argmax(-1)
        return dataclasses.replace(
            verdict, primed=complete & full_drafts.any(-1), next_logits=logits.next_of(likeliest)
        )


@pytest.mark.parametrize("broken", [PrimesFromTheStaleForward, PrimesFromAnUncheckedDraft])
def test_a_verifier_priming_without_checking_the_completed_state_is_caught(broken, graph_dir):
    """Each broken variant changes some output (and so does not pass the identity above),
    while the correct verifier on the same runs keeps them all."""
    differs = False
    for attention in ("bidirectional", "block-causal"):
        model = tiny(attention)
        for base, params in BASES.items():
            graph = graph_file(attention, base, graph_dir)
            reference = decoder(model, base, params).generate(PROMPTS)
            wrong = first_forward_run(model, base, params, PROMPTS, plugin=broken(graph=graph, budget=5))
            right = first_forward_run(model, base, params, PROMPTS, plugin=Spiffy(graph=graph, budget=5))
            assert right.token_lists == reference.token_lists
            differs |= wrong.token_lists != reference.token_lists
    assert differs


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_with_a_cache_first_forward_drafting_is_off_and_a_next_block_layout_is_refused(mode, graph_dir):
    """With a cache the verification forward does not hold the reference's next-block
    forward (that one is a full forward recording the next block's keys and values, and on
    a bidirectional model the earlier blocks' keys change with the completed block): the
    option is inert (same NFE as off), and a layout asking for next-block logits is refused."""
    model = tiny("bidirectional")
    graph = graph_file("bidirectional", "quota", graph_dir)
    off, on = (
        first_forward_run(model, "quota", {}, PROMPTS, cache=mode,
                          plugin=Spiffy(graph=graph, budget=5, first_forward=flag))
        for flag in (False, True)
    )
    assert on.token_lists == off.token_lists and torch.equal(on.nfe, off.nfe)

    class AsksForTheNextBlock(Spiffy):
        @hookimpl
        def dloom_build_mask(self, state, graph):
            return dataclasses.replace(super().dloom_build_mask(state, graph), next_block=True)

    with pytest.raises(HookContractError, match=f"next-block logits with cache {mode!r}"):
        first_forward_run(model, "quota", {}, PROMPTS, cache=mode, plugin=AsksForTheNextBlock(graph=graph, budget=5))


@pytest.mark.skipif(not TOY_INSTALLED, reason="toy-dllm not installed")
@pytest.mark.parametrize("base", ["quota", "threshold"])
def test_first_forward_drafting_on_the_toy_dllm(base):
    from dloom import load_model
    from dloom.zoo.tasks import held_out

    model = load_model("toy-dllm", dtype="float64")
    texts = [example.prompt for example in held_out(14)]
    params = {"quota": {}, "threshold": {"tau": 0.9}}[base]
    reference = DiffusionDecoder(model, base, params=params, block_length=8).generate(texts)
    results = {}
    for flag in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the built-in graph fits
            results[flag] = DiffusionDecoder(
                model, f"spiffy+{base}", params={**params, "first_forward": flag, "budget": FIXED_BUDGET}, block_length=8
            ).generate(texts)
        assert results[flag].token_lists == reference.token_lists
        assert int(results[flag].nfe.sum()) + results[flag].accepted_drafts == int(reference.nfe.sum())
    assert results[True].nfe.sum() < results[False].nfe.sum()
