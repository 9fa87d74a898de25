"""LLaDA2.x loads natively onto dloom's BailingMoeV2 class and reproduces its own code.

``tests/fixtures/real-families/llada2/`` holds a tiny random checkpoint in LLaDA2.0-mini's
published on-disk format (no ``.py`` files) and what the released modelling and
``generate`` code computed on it (see its README). Here dloom must give:

- the same logits (float32, 1e-4) on every recorded input: full attention, the block-causal
  and causal 4-D masks, a left-padded batch under a 4-D mask and under a 2-D mask;
- the same tokens and the same number of forwards as LLaDA2's greedy ``generate``
  (threshold with a top-1 fallback, blocks aligned at position 0, blocks the prompt fills
  skipped, EOS), under every cache mode and in a padded batch;
- the same for LLaDA2.1's editing ``generate``, with ``joint_threshold`` on the revisable
  kernel;
- fewer FLOPs than the reference's full-prefix recomputation, with the exact dual cache.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache
from typer.testing import CliRunner

from dloom import DiffusionDecoder, load_model
from dloom.cli.commands import app
from dloom.errors import ConfigurationError, ModelError
from dloom.model.bailing import BailingMoeV2ForCausalLM

FIXTURE = Path(__file__).parents[1] / "fixtures" / "real-families" / "llada2"
CHECKPOINT = FIXTURE / "checkpoint"
ATOL = 1e-4


@cache
def reference() -> dict:
    return json.loads((FIXTURE / "reference.json").read_text())


@cache
def reference_logits() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "reference.safetensors")


@cache
def adapter():
    return load_model(CHECKPOINT)


def runs(prefix: str) -> list[dict]:
    return [r for r in reference()["decoding"] if r["name"].startswith(prefix)]


def block_mask(length: int, block: int) -> torch.Tensor:
    """``(1, 1, L, L)`` additive float mask as LLaDA2's ``generate`` builds it: 0 where block
    ``key // block <= query // block`` (blocks aligned at position 0), ``-inf`` elsewhere."""
    ids = torch.arange(length) // block
    allowed = ids[None, :] <= ids[:, None]
    return torch.zeros(length, length).masked_fill(~allowed, float("-inf"))[None, None]


def entry_inputs(name: str) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments for the recorded logits entry ``name``."""
    entry = reference()["logits"][name]
    if "input_ids" in entry:  # the padded batch: its recorded mask, 4-D (bool) or 2-D
        mask = entry.get("attention_mask_4d_allowed", entry["attention_mask_2d"])
        return {
            "input_ids": torch.tensor(entry["input_ids"]),
            "attention_mask": torch.tensor(mask).bool() if "attention_mask_4d_allowed" in entry else torch.tensor(mask),
            "position_ids": torch.tensor(entry["position_ids"]),
        }
    ids = torch.tensor([reference()["inputs"][name.split("_")[0]]])
    if "_" not in name:
        return {"input_ids": ids}
    block = 4 if name.endswith("_block4") else 1
    return {
        "input_ids": ids, "attention_mask": block_mask(ids.shape[1], block),
        "position_ids": torch.arange(ids.shape[1])[None],
    }


def logits(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return adapter().model(**inputs).logits


# --- loading ------------------------------------------------------------------------------


def test_the_checkpoint_loads_onto_dlooms_class_with_llada2s_conventions():
    loaded = adapter()
    assert type(loaded.model) is BailingMoeV2ForCausalLM
    assert (
        loaded.mask_token_id, loaded.eos_token_ids, loaded.pad_token_id, loaded.shift_logits,
        loaded.attention, loaded.default_block_length, loaded.block_alignment,
    ) == (156895, (156892,), 156892, False, "block-causal", 32, "absolute")
    assert loaded.cache_argument == "cache" and loaded.takes_logits_to_keep
    assert loaded.model.config._attn_implementation == "sdpa"
    config = loaded.model.config
    assert (config.rotary_dim, config.head_dim, config.num_experts, config.first_k_dense_replace) == (4, 8, 8, 1)


def test_every_tensor_loads_and_none_is_left_over():
    _, info = BailingMoeV2ForCausalLM.from_pretrained(
        CHECKPOINT, config=adapter().model.config, output_loading_info=True
    )
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    assert not info["mismatched_keys"]
    stored = load_file(CHECKPOINT / "model.safetensors")
    state = adapter().model.state_dict()
    assert set(state) == set(stored)
    assert all(torch.equal(state[k], stored[k].float()) for k in stored)


def test_its_own_code_is_never_imported(tmp_path):
    directory = tmp_path / "llada2"
    shutil.copytree(CHECKPOINT, directory)
    for module in ("modeling_llada2_moe", "configuration_llada2_moe"):
        (directory / f"{module}.py").write_text("raise RuntimeError('remote code was imported')\n")
    loaded = load_model(directory, trust_remote_code=True)
    assert type(loaded.model) is BailingMoeV2ForCausalLM


def test_a_saved_copy_loads_back_as_llada2(tmp_path):
    """``save_pretrained`` writes dloom's own ``model_type``; it loads back with the family's
    conventions and the same logits."""
    adapter().model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "dloom_bailing_moe_v2"
    again = load_model(tmp_path)
    assert (again.profile, again.mask_token_id, again.attention) == ("llada2", 156895, "block-causal")
    inputs = entry_inputs("seq2_block4")
    with torch.no_grad():
        assert torch.equal(again.model(**inputs).logits, logits(inputs))


def test_device_map_places_it_through_accelerate():
    """``device_map="auto"`` loads through accelerate (no layer split across devices) and
    gives the same logits and decode as a plain load."""
    placed = load_model(CHECKPOINT, device_map="auto")
    assert type(placed.model) is BailingMoeV2ForCausalLM
    inputs = entry_inputs("seq1_block4")
    with torch.no_grad():
        assert torch.equal(placed.model(**inputs).logits, logits(inputs))
    prompt = reference()["prompts"][0]
    decodes = [
        DiffusionDecoder(model, "threshold", tau=0.9, gen_length=8, block_length=4).generate([prompt])
        for model in (placed, adapter())
    ]
    assert decodes[0].generated.tolist() == decodes[1].generated.tolist()


def test_a_misspelled_expert_tensor_is_refused_before_loading(tmp_path):
    directory = tmp_path / "llada2"
    shutil.copytree(CHECKPOINT, directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.1.mlp.experts.3.gate_prj.weight"] = tensors.pop("model.layers.1.mlp.experts.3.gate_proj.weight")
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ModelError, match=(
        r"tensors with no place in it: 'model\.layers\.1\.mlp\.experts\.3\.gate_prj\.weight'; tensors it needs "
        r"that the checkpoint lacks: 'model\.layers\.1\.mlp\.experts\.3\.gate_proj\.weight'"
    )):
        load_model(directory)


# --- logits -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(reference()["logits"]))
def test_logits_equal_the_reference_code(name):
    """Every entry, on its real positions (pad positions of the batch are undefined)."""
    inputs = entry_inputs(name)
    entry = reference()["logits"][name]
    real = torch.tensor(entry["attention_mask_2d"]).bool() if "attention_mask_2d" in entry else torch.ones(
        inputs["input_ids"].shape, dtype=torch.bool
    )
    mine, ref = logits(inputs)[real], reference_logits()
    assert (mine[:, ref["columns"]] - ref[f"{name}.logits_cols"][real]).abs().max() <= ATOL
    assert torch.equal(mine.argmax(-1), ref[f"{name}.argmax"][real])
    assert (mine.max(-1).values - ref[f"{name}.max"][real]).abs().max() <= ATOL
    assert (mine.logsumexp(-1) - ref[f"{name}.logsumexp"][real]).abs().max() <= ATOL
    assert torch.equal(mine.topk(16).indices, ref[f"{name}.top16_ids"][real])


def test_the_mask_changes_the_logits():
    """Negative control: full, block-causal and causal attention give different logits, so
    a model that ignored the mask (or got it wrong) fails the entries above."""
    full, block, causal = (logits(entry_inputs(f"seq2{s}")) for s in ("", "_block4", "_causal"))
    assert (full - block).abs().max() > 1.0 and (block - causal).abs().max() > 1.0


def test_a_bool_mask_gives_the_additive_masks_logits():
    inputs = entry_inputs("seq2_block4")
    as_bool = {**inputs, "attention_mask": inputs["attention_mask"] == 0}
    assert (logits(as_bool) - logits(inputs)).abs().max() <= 1e-5


def test_a_cached_forward_gives_the_uncached_logits_of_a_block_causal_model():
    """The prefix (blocks before the last) through a ``DynamicCache``, then the last block
    alone attending to it: the block's logits are those of one full forward, and
    ``logits_to_keep`` picks columns."""
    inputs = entry_inputs("seq2_block4")
    ids, mask, positions = inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"]
    full = logits(inputs)
    kv = DynamicCache()
    with torch.no_grad():
        model = adapter().model
        model(ids[:, :16], mask[..., :16, :16], positions[:, :16], cache=kv, use_cache=True)
        tail = model(ids[:, 16:], mask[..., 16:, :], positions[:, 16:], cache=kv, use_cache=True).logits
        kept = model(**inputs, logits_to_keep=torch.tensor([3, 17])).logits
    assert (tail - full[:, 16:]).abs().max() <= 1e-5
    assert torch.equal(kept, full[:, [3, 17]])


# --- decoding: LLaDA2's own greedy generate ------------------------------------------------


def decoder_for(run: dict, cache: str = "none", block_length: int | None = None) -> DiffusionDecoder:
    """dloom's decoder with the settings of one recorded decode.

    LLaDA2's ``generate`` commits, per step, every masked position of the block with
    probability above ``threshold``, or else its ``block_length // steps`` most confident
    (one here): that is ``threshold`` with ``tau``. ``threshold`` 1.0 is never met, so it is
    one position per step: ``quota`` with one step per position. The released code's top-k 1
    sampling gives every candidate probability 1, so a block fills in one step: ``quota``
    with one step per block. The EOS is the run's ``eos_id``.
    """
    settings = run["settings"]
    model = dataclasses.replace(adapter(), eos_token_ids=(settings["eos_id"],))
    lengths = {"gen_length": settings["gen_length"], "cache": cache}
    if block_length is not None:
        lengths["block_length"] = block_length
    assert settings["block_length"] // settings["steps"] == 1 and settings["temperature"] == 0.0
    if settings["top_k"] == 1:
        return DiffusionDecoder(model, "quota", steps=settings["gen_length"] // settings["block_length"], **lengths)
    if settings["threshold"] >= 1.0:
        return DiffusionDecoder(model, "quota", steps=settings["gen_length"], **lengths)
    return DiffusionDecoder(model, "threshold", tau=settings["threshold"], **lengths)


GREEDY = runs("generate_greedy") + runs("generate_topk1")


@pytest.mark.parametrize("cache_mode", ["none", "prefix", "dual"])
@pytest.mark.parametrize("run", GREEDY, ids=lambda r: r["name"])
def test_dloom_decodes_as_llada2s_generate(run, cache_mode):
    """Same tokens and forwards: blocks of ``block_length`` from position 0 (the prompt's
    last partial block decoded with the first generated positions, blocks the prompt fills
    skipped), the rows' EOS ending it after the block that holds it. The block-32 runs take
    the block length from the checkpoint's profile (LLaDA2's default); the others pass 4.
    The reference truncates its output at ``gen_length`` (or after the EOS) while dloom
    decodes the last block to its end: the recorded tokens are the prefix of dloom's."""
    block = None if run["settings"]["block_length"] == 32 else run["settings"]["block_length"]
    result = decoder_for(run, cache_mode, block).generate([run["prompt"]])
    assert result.generated[0].tolist()[: len(run["generated"])] == run["generated"]
    assert result.nfe.tolist() == [run["forwards"]]
    if "eos" in run["name"]:  # generation ends at the EOS
        assert int(result.generated_lengths[0]) == len(run["generated"])


@pytest.mark.parametrize("prefix", ["generate_greedy_thr0.5_p", "generate_greedy_thr0.95_p", "generate_topk1_p"])
def test_prompts_of_different_lengths_decode_in_one_padded_batch(prefix):
    """LLaDA2's ``generate`` takes one prompt; dloom decodes the 6- and 8-token prompts in
    one left-padded batch, each row as the reference decoded it alone."""
    group = runs(prefix)
    assert sorted(len(r["prompt"]) for r in group) == [6, 8]
    result = decoder_for(group[0], "prefix", 4).generate([r["prompt"] for r in group])
    for row, run in enumerate(group):
        assert result.generated[row].tolist()[: len(run["generated"])] == run["generated"]
    assert result.nfe.tolist() == [r["forwards"] for r in group]


LLADA21 = runs("llada21_")


@cache
def full_prefix_editing_decode(name: str) -> tuple[list[int], int, int]:
    """LLaDA2.1's ``generate`` loop as it computes, for the recorded run ``name``: per
    block, steps until a post step (one beginning with no mask) changes nothing or
    ``max_post_steps`` post steps have run; each step one forward over the prefix up to the
    block's end; fill the masked positions above ``threshold`` (else the most likely one),
    rewrite the filled generated positions whose argmax differs with probability above
    ``editing_threshold``; stop after the block that holds the EOS.

    :return: the tokens after the prompt, the forwards made, and the blocks that settled on
        a post step that changed nothing and had a block after them (without a cache dloom
        takes that block's first step from the settling forward: one forward fewer each).
    """
    (run,) = runs(name)
    settings, prompt = run["settings"], run["prompt"]
    block, mask_id = settings["block_length"], settings["mask_id"]
    blocks = -(-(len(prompt) + settings["gen_length"]) // block)
    x = torch.full((1, blocks * block), mask_id)
    x[0, : len(prompt)] = torch.tensor(prompt)
    generated = torch.arange(blocks * block) >= len(prompt)
    mask, positions = block_mask(blocks * block, block), torch.arange(blocks * block)[None]
    forwards = reusable = 0
    unchanged = False
    for end in range((len(prompt) // block + 1) * block, blocks * block + 1, block):
        reusable += unchanged  # the block before settled unchanged, and this one follows it
        post_steps, unchanged = 0, False
        while True:
            old = x[0, end - block : end].clone()
            masked = old == mask_id
            if not masked.any():
                post_steps += 1
                if post_steps > settings["max_post_steps"]:
                    break
            forwards += 1
            with torch.no_grad():
                out = adapter().model(x[:, :end], mask[..., :end, :end], positions[:, :end]).logits
            logits = out[0, -block:].double()
            logits[:, mask_id] = -torch.inf
            confidence, candidates = logits.softmax(-1).max(-1)
            fill = masked & (confidence > settings["threshold"])
            if masked.any() and not fill.any():
                ranked = torch.where(masked, confidence, -torch.inf)
                fill = masked & (ranked == ranked.max())
            edit = generated[end - block : end] & ~masked & (confidence > settings["editing_threshold"])
            edit &= candidates != old
            x[0, end - block : end] = torch.where(fill | edit, candidates, old)
            if not masked.any() and not edit.any():
                unchanged = True
                break
        if (x[0, len(prompt) : end] == settings["eos_id"]).any():
            break
    return x[0, len(prompt) : len(prompt) + settings["gen_length"]].tolist(), forwards, reusable


@pytest.mark.parametrize("run", LLADA21, ids=lambda r: r["name"])
def test_the_editing_loop_reproduces_llada21s_generate(run):
    """The loop above gives the recorded tokens and forwards (so its count of blocks that
    settle unchanged is that of LLaDA2.1's own decode)."""
    tokens, forwards, _ = full_prefix_editing_decode(run["name"])
    assert (tokens, forwards) == (run["generated"], run["forwards"])


@pytest.mark.parametrize("cache_mode", ["none", "prefix", "dual"])
@pytest.mark.parametrize("run", LLADA21, ids=lambda r: r["name"])
def test_dloom_decodes_as_llada21s_editing_generate(run, cache_mode):
    """LLaDA2.1's ``generate`` (fill above ``threshold``, else the most confident; rewrite a
    filled generated position whose argmax differs with probability above
    ``editing_threshold``; once the block holds no mask, edit rounds until one changes
    nothing or ``max_post_steps`` have run) is ``joint_threshold`` on the revisable kernel,
    which the family's profile names: same tokens and forwards, quality mode (0.7 / 0.5),
    speed mode (0.5 / 0.0) and no edits (0.5 / 1.0, one checking forward per block more
    than LLaDA2.0's decode), under every cache mode. The forwards are the reference's;
    without a cache, less one per block that settled on a post step that changed nothing
    before another block (that post step's forward gives the next block's first step)."""
    settings = run["settings"]
    assert adapter().kernel == "revisable"
    decoder = DiffusionDecoder(
        adapter(), "joint_threshold", tau=settings["threshold"], edit_tau=settings["editing_threshold"],
        max_post_steps=settings["max_post_steps"], num_to_transfer=settings["num_to_transfer"],
        gen_length=settings["gen_length"], block_length=settings["block_length"], cache=cache_mode,
    )
    result = decoder.generate([run["prompt"]])
    assert result.generated[0].tolist()[: len(run["generated"])] == run["generated"]
    _, forwards, reusable = full_prefix_editing_decode(run["name"])
    assert result.nfe.tolist() == [forwards - (reusable if cache_mode == "none" else 0)]
    if cache_mode == "none" and "speed" not in run["name"]:  # speed mode's blocks run out of post steps
        assert reusable, "no block settled unchanged before another: the case is vacuous"


def test_edits_change_the_decode():
    """Negative control: the quality and speed runs differ from the run without edits, so an
    editing rule that never edits fails them."""
    by_name = {r["name"]: r["generated"] for r in LLADA21}
    for row in (0, 1):
        assert by_name[f"llada21_quality_p{row}"] != by_name[f"llada21_noedit_p{row}"]
        assert by_name[f"llada21_speed_p{row}"] != by_name[f"llada21_noedit_p{row}"]


def test_the_lossless_speculative_strategies_are_refused_on_its_kernel():
    with pytest.raises(ConfigurationError, match=r"strategy 'spiffy' supports the 'absorbing' kernel\(s\), not the model's 'revisable'"):
        DiffusionDecoder(adapter(), "spiffy", gen_length=8, block_length=4)


def full_prefix_decode(run: dict) -> tuple[list[int], int]:
    """LLaDA2's ``generate`` loop as it computes: every step one forward over the whole
    prefix up to the active block's end (no cache), the head over every position; commit
    the block's masked positions with probability above the threshold, else the most
    likely one; stop after the block that holds the EOS.

    :return: the tokens after the prompt (``gen_length`` of them) and the forwards made.
    """
    settings, prompt = run["settings"], run["prompt"]
    block, mask_id = settings["block_length"], settings["mask_id"]
    blocks = -(-(len(prompt) + settings["gen_length"]) // block)
    x = torch.full((1, blocks * block), mask_id)
    x[0, : len(prompt)] = torch.tensor(prompt)
    mask, positions = block_mask(blocks * block, block), torch.arange(blocks * block)[None]
    forwards = 0
    for end in range((len(prompt) // block + 1) * block, blocks * block + 1, block):
        while (masked := x[0, end - block : end] == mask_id).any():
            forwards += 1
            with torch.no_grad():
                out = adapter().model(x[:, :end], mask[..., :end, :end], positions[:, :end]).logits
            confidence, candidates = out[0, -block:].double().softmax(-1).max(-1)
            confidence = torch.where(masked, confidence, -torch.inf)
            commit = confidence > settings["threshold"]
            if not commit.any():
                commit = confidence == confidence.max()
            x[0, end - block : end] = torch.where(commit, candidates, x[0, end - block : end])
        if (x[0, len(prompt) : end] == settings["eos_id"]).any():
            break
    return x[0, len(prompt) : len(prompt) + settings["gen_length"]].tolist(), forwards


@pytest.mark.parametrize("name", ["generate_greedy_thr0.95_p0", "generate_greedy_block32_p1"])
def test_the_cached_decode_gives_the_full_prefix_tokens_in_fewer_flops(name):
    """LLaDA2's ``generate`` recomputes the whole prefix at every step; on this block-causal
    model dloom's dual cache is exact (earlier blocks never attend to later ones), so it gives
    the same tokens and forwards while computing the body over the active block only and the
    head over the block's columns only. Measured with ``torch``'s FLOP counter on the
    fixture (figures in docs/models.md)."""
    from torch.utils.flop_counter import FlopCounterMode

    run = runs(name)[0]
    with FlopCounterMode(display=False) as reference_flops:
        tokens, forwards = full_prefix_decode(run)
    assert (tokens, forwards) == (run["generated"], run["forwards"])
    block = None if run["settings"]["block_length"] == 32 else 4
    with FlopCounterMode(display=False) as dloom_flops:
        result = decoder_for(run, "dual", block).generate([run["prompt"]])
    assert result.generated[0].tolist()[: len(tokens)] == tokens and int(result.nfe[0]) == forwards
    body = {
        counter: sum(counter.get_flop_counts()["BailingMoeV2ForCausalLM.model"].values())
        for counter in (reference_flops, dloom_flops)
    }
    assert dloom_flops.get_total_flops() < 0.5 * reference_flops.get_total_flops()
    assert body[dloom_flops] < 0.7 * body[reference_flops]


def test_a_wrong_fill_rule_or_block_layout_misses_the_reference():
    """Negative controls: one token per step instead of the threshold rule, or the prompt as
    its own block (blocks aligned at the prompt's end), give other tokens."""
    run = runs("generate_greedy_thr0.5_p1")[0]
    quota = DiffusionDecoder(adapter(), "quota", steps=16, gen_length=16, block_length=4)
    assert quota.generate([run["prompt"]]).generated[0].tolist()[:16] != run["generated"]
    run = runs("generate_greedy_thr0.5_p0")[0]  # its 6-token prompt ends in a partial block
    shifted = dataclasses.replace(adapter(), block_alignment="prompt")
    threshold = DiffusionDecoder(shifted, "threshold", tau=0.5, gen_length=16, block_length=4)
    assert threshold.generate([run["prompt"]]).generated[0].tolist()[:16] != run["generated"]


def test_cli_generates_with_llada21s_quality_mode(tmp_path):
    run = runs("llada21_quality_p0")[0]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": run["prompt"]}) + "\n")
    result = CliRunner().invoke(app, [
        "generate", "--model", str(CHECKPOINT), "--prompts", str(prompts), "--strategy", "joint_threshold",
        "--param", "tau=0.7", "--param", "edit_tau=0.5", "--param", "max_post_steps=16",
        "--gen-length", "16", "--block-length", "4", "--json",
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["tokens"][:16] == run["generated"]


def test_cli_generates_with_the_threshold_strategy(tmp_path):
    run = runs("generate_greedy_thr0.95_p1")[0]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": run["prompt"]}) + "\n")
    result = CliRunner().invoke(app, [
        "generate", "--model", str(CHECKPOINT), "--prompts", str(prompts), "--strategy", "threshold",
        "--param", "tau=0.95", "--gen-length", "16", "--block-length", "4", "--json",
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["tokens"][:16] == run["generated"]
