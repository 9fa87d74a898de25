"""Real-format checkpoints load natively and reproduce their families' own code.

``tests/fixtures/real-families/`` holds tiny random checkpoints of LLaDA, Dream, SDAR and
Qwen2.5 in the released on-disk format (no ``.py`` files) and what the published modelling
and generation code computed on them (see its README). Here dloom loads each with
``trust_remote_code=False`` onto ``transformers``' own classes and must give:

- the same logits (float32, 1e-4) on every recorded input: unpadded sequences, padded
  batches, and SDAR's block-causal and causal masks;
- the same tokens as the reference decodes: LLaDA's ML-GSAI ``generate`` and the Fast-dLLM
  variants (plain, threshold 0.9, prefix cache, dual cache) with the same number of
  forwards; Dream's ``diffusion_generate`` up to the one position its step schedule commits
  differently (explained and checked exactly below); Qwen2.5's greedy ``generate``.
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
from typer.testing import CliRunner

from dloom import DiffusionDecoder, load_model
from dloom.cli.commands import app
from dloom.decode.kernel import propose
from dloom.errors import ModelError
from dloom.model.attention import block_causal_mask
from dloom_plugins.baselines import dream_counts

FIXTURES = Path(__file__).parents[1] / "fixtures" / "real-families"
FAMILIES = ("llada", "dream", "sdar", "qwen2")
ATOL = 1e-4


def checkpoint(family: str) -> Path:
    return FIXTURES / family / "checkpoint"


@cache
def reference(family: str) -> dict:
    return json.loads((FIXTURES / family / "reference.json").read_text())


@cache
def reference_logits(family: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / family / "reference.safetensors")


@cache
def adapter(family: str):
    return load_model(checkpoint(family), require_mask=family != "qwen2")


def sdar_mask(length: int, block: int | None) -> torch.Tensor:
    """``(1, 1, L, L)`` bool: SDAR generate.py's block-causal mask, blocks aligned at
    position 0 (``block=None``: all True, the full-attention entry; ``block=1``: causal)."""
    if block is None:
        return torch.ones(1, 1, length, length, dtype=torch.bool)
    ids = torch.arange(length) // block
    return (ids[None, :] <= ids[:, None])[None, None]


def padded_sdar_mask(padding: torch.Tensor, block: int) -> torch.Tensor:
    """``(B, 1, L, L)`` bool as the reference harness built it: block-causal with blocks
    aligned at each row's first real token, pad keys hidden, pad queries see themselves."""
    position = (padding.cumsum(-1) - 1).clamp(min=0)
    ids = torch.where(padding.bool(), position // block, -1)
    real = padding.bool()
    layout = (ids[:, None, :] <= ids[:, :, None]) & real[:, None, :] & real[:, :, None]
    eye = torch.eye(padding.shape[1], dtype=torch.bool)[None] & ~real[:, :, None]
    return (layout | eye)[:, None]


def entry_inputs(family: str, name: str) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments for the recorded logits entry ``name``."""
    record = reference(family)
    entry = record["logits"][name]
    if "input_ids" in entry:
        ids = torch.tensor(entry["input_ids"])
        padding = torch.tensor(entry.get("attention_mask", entry.get("attention_mask_2d")))
        positions = (padding.cumsum(-1) - 1).clamp(min=0)
        mask = padded_sdar_mask(padding, 4) if family == "sdar" else padding
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    ids = torch.tensor([record["inputs"][name.split("_")[0]]])
    if family != "sdar":
        return {"input_ids": ids}
    block = 4 if name.endswith("_block4") else 1 if name.endswith("_causal") else None
    return {
        "input_ids": ids, "attention_mask": sdar_mask(ids.shape[1], block),
        "position_ids": torch.arange(ids.shape[1])[None],
    }


def raw_logits(family: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return adapter(family).model(**inputs).logits


def logit_entries(family: str) -> list[str]:
    entries = list(reference(family)["logits"])
    # LLaDA's released forward ignores the padding mask: that entry is checked separately.
    return [e for e in entries if not (family == "llada" and e == "padded_batch")]


def max_differences(logits: torch.Tensor, family: str, name: str) -> dict[str, float]:
    """Max |difference| to the reference over its columns, the full-vocabulary max and
    logsumexp, and how many argmaxes differ."""
    ref = reference_logits(family)
    columns = ref["columns"]
    return {
        "columns": (logits[..., columns] - ref[f"{name}.logits_cols"]).abs().max().item(),
        "max": (logits.max(-1).values - ref[f"{name}.max"]).abs().max().item(),
        "logsumexp": (logits.logsumexp(-1) - ref[f"{name}.logsumexp"]).abs().max().item(),
        "argmax": int((logits.argmax(-1) != ref[f"{name}.argmax"]).sum()),
    }


# --- loading without remote code ----------------------------------------------------------


@pytest.mark.parametrize(
    "family, native, conventions",
    [
        ("llada", "LlamaForCausalLM", (126336, (126081, 126348), 126081, False, "bidirectional", None, "prompt")),
        ("dream", "Qwen2ForCausalLM", (151666, (151643,), 151643, True, "bidirectional", None, "prompt")),
        ("sdar", "Qwen3ForCausalLM", (151669, (151643, 151645), 151643, False, "block-causal", 4, "absolute")),
        ("qwen2", "Qwen2ForCausalLM", (None, (151645, 151643), 151643, True, "causal", None, "prompt")),
    ],
)
def test_checkpoints_load_onto_native_classes_with_their_conventions(family, native, conventions):
    loaded = adapter(family)
    assert type(loaded.model).__name__ == native
    assert loaded.model.config._attn_implementation == "sdpa"
    assert (
        loaded.mask_token_id, loaded.eos_token_ids, loaded.pad_token_id, loaded.shift_logits,
        loaded.attention, loaded.default_block_length, loaded.block_alignment,
    ) == conventions
    assert loaded.can_pad


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_device_map_places_each_family_through_accelerate(family, monkeypatch):
    """``device_map`` goes to ``from_pretrained`` (``accelerate`` places the modules) with the
    load-time key map: the logits and a greedy decode equal those of a plain load."""
    import transformers

    placements = []
    load = transformers.PreTrainedModel.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        placements.append(kwargs.get("device_map"))
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(recording))
    placed = load_model(checkpoint(family), device_map="auto")
    assert placements == ["auto"]
    assert type(placed.model) is type(adapter(family).model)
    inputs = torch.tensor([[5, 17, 29, 41, 53, 65]])
    with torch.no_grad():
        assert torch.equal(placed.model(input_ids=inputs).logits, adapter(family).model(input_ids=inputs).logits)
    settings = {"gen_length": 8, "block_length": 4}
    decodes = [
        DiffusionDecoder(model, "threshold", tau=0.9, **settings).generate([[5, 17, 29, 41, 53, 65]])
        for model in (placed, adapter(family))
    ]
    assert decodes[0].generated.tolist() == decodes[1].generated.tolist()
    assert decodes[0].nfe.tolist() == decodes[1].nfe.tolist()


def test_bidirectional_families_are_not_causal():
    assert adapter("llada").model.config.is_causal is False
    assert adapter("dream").model.config.is_causal is False


def test_rope_frequencies_are_computed_not_left_uninitialised():
    """transformers 5 re-creates non-persistent buffers; the native classes recompute
    ``inv_freq`` (the remote code left it uninitialised)."""
    for family in ("llada", "dream", "sdar"):
        config = adapter(family).model.config
        rotary = adapter(family).model.model.rotary_emb
        dim = config.head_dim if getattr(config, "head_dim", None) else config.hidden_size // config.num_attention_heads
        theta = config.rope_parameters["rope_theta"]
        expected = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        assert torch.allclose(rotary.inv_freq, expected), family


def poisoned_copy(family: str, directory: Path) -> Path:
    """A copy of the family's checkpoint with every modelling file its ``auto_map`` names,
    each raising on import."""
    shutil.copytree(checkpoint(family), directory)
    targets = json.loads((directory / "config.json").read_text())["auto_map"].values()
    for module in {t.split(".")[0] for t in targets}:
        (directory / f"{module}.py").write_text("raise RuntimeError('remote code was imported')\n")
    return directory


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_a_checkpoints_own_code_is_never_imported(family, tmp_path):
    """Even with trust_remote_code=True a known family loads natively: modelling files that
    would raise on import are never read, by the loader or the command line."""
    directory = poisoned_copy(family, tmp_path / family)
    loaded = load_model(directory, trust_remote_code=True)
    assert type(loaded.model).__name__ == type(adapter(family).model).__name__
    ids = {"input_ids": torch.tensor([reference(family)["inputs"]["seq0"]])}
    with torch.no_grad():
        assert torch.equal(loaded.model(**ids).logits, raw_logits(family, ids))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": reference(family)["prompts"][0]}) + "\n")
    result = CliRunner().invoke(app, [
        "generate", "--model", str(directory), "--prompts", str(prompts), "--gen-length", "4",
        "--block-length", "4", "--trust-remote-code", "--json",
    ])
    assert result.exit_code == 0, result.output


def test_a_saved_rope_buffer_is_skipped_as_transformers_skips_it(tmp_path):
    """Older checkpoints saved each layer's ``rotary_emb.inv_freq``; transformers ignores
    them on load, and so does the tensor-name check."""
    directory = tmp_path / "dream"
    shutil.copytree(checkpoint("dream"), directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    save_file(tensors, directory / "model.safetensors")
    ids = {"input_ids": torch.tensor([reference("dream")["inputs"]["seq0"]])}
    with torch.no_grad():
        assert torch.equal(load_model(directory).model(**ids).logits, raw_logits("dream", ids))


def test_a_misspelled_tensor_name_is_refused_before_loading(tmp_path):
    """The tensor names are checked against the native model through the key map: a LLaDA
    checkpoint with one misspelled name is refused, naming it and the tensor it lacks
    (transformers would initialise that tensor at random and load anyway)."""
    directory = tmp_path / "llada"
    shutil.copytree(checkpoint("llada"), directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.transformer.blocks.1.attn_nrm.weight"] = tensors.pop("model.transformer.blocks.1.attn_norm.weight")
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ModelError, match=(
        r"do not match the llada layout \(native llama\): tensors with no place in it: "
        r"'model\.transformer\.blocks\.1\.attn_nrm\.weight'; tensors it needs that the "
        r"checkpoint lacks: 'model\.layers\.1\.input_layernorm\.weight'"
    )):
        load_model(directory)


def test_sdar_block_size_and_stop_ids_come_from_the_checkpoint(tmp_path):
    directory = tmp_path / "sdar"
    shutil.copytree(checkpoint("sdar"), directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "block_size": 8}))
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [151645, 7]}))
    loaded = load_model(directory)
    assert loaded.default_block_length == 8
    assert loaded.eos_token_ids == (151643, 151645, 7)


def test_sdar_chat_template_comes_from_its_tokenizer_files():
    text = adapter("sdar").chat_prompts(["hi"])[0]
    assert text.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert adapter("sdar").tokenizer.convert_tokens_to_ids("<|MASK|>") == 151669


def test_a_llada_variant_without_a_native_equivalent_is_refused(tmp_path):
    directory = tmp_path / "llada-alibi"
    shutil.copytree(checkpoint("llada"), directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "alibi": True}))
    with pytest.raises(ModelError, match=r"LLaDA config alibi=True has no native equivalent.*alibi=False"):
        load_model(directory)


# --- logits -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, name", [(f, e) for f in FAMILIES for e in logit_entries(f)], ids=lambda v: str(v)
)
def test_logits_equal_the_reference_code(family, name):
    logits = raw_logits(family, entry_inputs(family, name))
    if "padded" in name:  # pad positions are undefined; the real ones are compared
        real = entry_inputs(family, name)["position_ids"] * 0 + torch.tensor(
            reference(family)["logits"][name].get("attention_mask", reference(family)["logits"][name].get("attention_mask_2d"))
        )
        ref = reference_logits(family)
        keep = real.bool()
        columns = ref["columns"]
        assert (logits[keep][:, columns] - ref[f"{name}.logits_cols"][keep]).abs().max() <= ATOL
        assert torch.equal(logits[keep].argmax(-1), ref[f"{name}.argmax"][keep])
        assert (logits[keep].logsumexp(-1) - ref[f"{name}.logsumexp"][keep]).abs().max() <= ATOL
        return
    differences = max_differences(logits, family, name)
    assert differences["argmax"] == 0, differences
    assert max(differences["columns"], differences["max"], differences["logsumexp"]) <= ATOL, differences


def test_sdar_block_layout_changes_the_logits():
    """The block-causal entries are not the full-attention ones: a wrong mask is caught."""
    full = raw_logits("sdar", entry_inputs("sdar", "seq2"))
    differences = max_differences(full, "sdar", "seq2_block4")
    assert differences["columns"] > 1.0


def test_llada_padded_rows_equal_the_unpadded_reference():
    """Loaded natively, LLaDA honours the padding mask: each real row of the padded batch
    gives the unpadded sequence's logits. The released code ignores the mask, so its
    recorded padded entry differs from these by tens of logits."""
    inputs = entry_inputs("llada", "padded_batch")
    logits = raw_logits("llada", {**inputs, "attention_mask": inputs["attention_mask"]})
    ref = reference_logits("llada")
    columns = ref["columns"]
    for row in range(3):
        real = inputs["attention_mask"][row].bool()
        mine = logits[row, real][:, columns]
        assert (mine - ref[f"seq{row}.logits_cols"][0]).abs().max() <= ATOL
        if not real.all():
            assert (mine - ref["padded_batch.logits_cols"][row, real]).abs().max() > 10


def test_dream_adapter_shifts_the_logits_as_its_sampler_does():
    inputs = entry_inputs("dream", "seq1")
    shifted = adapter("dream").logits(inputs["input_ids"])
    raw = raw_logits("dream", inputs)
    assert torch.equal(shifted[:, 1:], raw[:, :-1]) and torch.equal(shifted[:, 0], raw[:, 0])


# --- decoding -----------------------------------------------------------------------------

CACHE_OF = {"generate": "none", "generate_with_prefix_cache": "prefix", "generate_with_dual_cache": "dual"}


@pytest.mark.parametrize("run", reference("llada")["decoding"], ids=lambda r: r["name"])
def test_llada_decodes_equal_the_reference_decodes(run):
    settings = run["settings"]
    assert (settings["temperature"], settings["remasking"]) == (0.0, "low_confidence")
    threshold = settings.get("threshold")
    decoder = DiffusionDecoder(
        adapter("llada"), "threshold" if threshold else "quota",
        gen_length=settings["gen_length"], block_length=settings["block_length"],
        steps=settings["steps"], cache=CACHE_OF[run["function"].split("::")[1]],
        **({"tau": threshold} if threshold else {}),
    )
    result = decoder.generate([run["prompt"]])
    assert result.generated[0].tolist() == run["generated"]
    assert result.nfe.tolist() == [run["forwards"]]


def dream_prompts(run: dict) -> list[list[int]]:
    if "attention_mask" not in run:
        return [run["prompt"]]
    return [[t for t, m in zip(p, mask) if m] for p, mask in zip(run["prompt"], run["attention_mask"])]


@pytest.mark.parametrize("run", reference("dream")["decoding"], ids=lambda r: r["name"])
def test_dloom_decodes_dream_exactly_as_diffusion_generate(run):
    """dloom's ``dream`` rule gives every recorded decode token for token, a left-padded
    batch included. Dream's schedule for 16 tokens in 16 steps commits ``0, 1 x 14, 2``; its
    first step changes nothing, so dloom skips it and needs 15 forwards for Dream's 16."""
    settings = run["settings"]
    assert dream_counts(settings["max_new_tokens"], settings["steps"], settings["eps"]) == [0] + [1] * 14 + [2]
    lengths = {"gen_length": settings["max_new_tokens"], "block_length": settings["max_new_tokens"], "steps": settings["steps"]}
    remasking = "entropy" if settings["alg"] == "entropy" else "low_confidence"
    decoder = DiffusionDecoder(adapter("dream"), "dream", eps=settings["eps"], remasking=remasking, **lengths)
    result = decoder.generate(dream_prompts(run))
    expected = run["generated"] if isinstance(run["generated"][0], list) else [run["generated"]]
    assert result.generated.tolist() == expected
    assert result.nfe.tolist() == [run["forwards"] - 1] * len(expected)
    # Negative control: LLaDA's one-token-per-step schedule misses Dream's last two commits.
    quota = DiffusionDecoder(adapter("dream"), "quota", remasking=remasking, **lengths)
    assert quota.generate(dream_prompts(run)).generated.tolist() != expected


@pytest.mark.parametrize("run", [r for r in reference("qwen2")["decoding"] if r["name"].startswith("greedy_p")], ids=lambda r: r["name"])
def test_qwen2_greedy_tokens_from_the_adapter_logits(run):
    """The causal target's shift-aligned logits (``logits[:, i]`` is token ``i``'s
    distribution) give transformers' greedy generate: the next token's distribution is read
    at a placeholder column, which causal attention keeps from influencing it."""
    target = adapter("qwen2")
    ids = torch.tensor([run["prompt"]])
    placeholder = torch.tensor([[target.pad_token_id]])
    for _ in range(run["settings"]["max_new_tokens"]):
        token = target.logits(torch.cat([ids, placeholder], dim=1))[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, token], dim=1)
    assert ids[0, len(run["prompt"]):].tolist() == run["generated"]


def sdar_block_decode(prompt: list[int], settings: dict, layout: str = "absolute") -> tuple[list[int], int]:
    """SDAR generate.py's decode loop, driven by the natively loaded model.

    ``layout="absolute"`` is generate.py's: blocks of ``K`` from position 0 over
    ``ceil((P + G) / K) * K`` positions, the prompt's full blocks prefilled by one forward,
    the first decoded block holding the prompt's tail. ``"prompt"`` is dloom's current
    layout (:func:`dloom.model.attention.block_causal_mask`): the whole prompt is one block and
    ``G / K`` blocks start at ``P``. Each decoded block runs up to ``denoising_steps`` steps
    with ``K / steps`` tokens per step (by step index, not by the block's mask count),
    committing every masked position with confidence above the threshold when there are at
    least that many, else the top ones, then one more forward (SDAR's cache store);
    decoding stops after the first block that holds a stop id.

    The absolute layout is what dloom's decoder must reproduce for
    ``block_alignment="absolute"``; here it pins that the native model gives SDAR's tokens
    and forward counts under it.

    :return: the positions after the prompt and the number of forwards.
    """
    model, mask_id = adapter("sdar").model, adapter("sdar").mask_token_id
    k, steps, threshold = settings["block_length"], settings["denoising_steps"], settings["confidence_threshold"]
    p = len(prompt)
    if layout == "absolute":
        length = -(-(p + settings["gen_length"]) // k) * k
        mask, starts = sdar_mask(length, k), range(p // k * k, length, k)
        forwards = int(p >= k)
    else:
        length = p + settings["gen_length"]
        mask, starts = block_causal_mask(torch.ones(1, length), p, k), range(p, length, k)
        forwards = 1
    x = torch.full((1, length), mask_id)
    x[0, :p] = torch.tensor(prompt)
    positions = torch.arange(length)[None]
    quota = [k // steps + (i < k % steps) for i in range(steps)]
    for start in starts:
        end = start + k
        for step in range(steps + 1):
            forwards += 1
            masked = x[0, start:end] == mask_id
            if not masked.any():
                break
            with torch.no_grad():
                logits = model(input_ids=x[:, :end], attention_mask=mask[..., :end, :end],
                               position_ids=positions[:, :end]).logits[0, start:end].double()
            candidates = logits.argmax(-1)
            greedy_sample = settings["top_k"] == 1  # top-1 sampling: probability 1 everywhere
            confidence = torch.ones(k, dtype=torch.float64) if greedy_sample else (
                torch.softmax(logits, -1).gather(-1, candidates[:, None])[:, 0])
            confidence = torch.where(masked, confidence, -torch.inf)
            commit = confidence > threshold
            if commit.sum() < quota[step]:
                commit = torch.zeros(k, dtype=torch.bool)
                commit[confidence.topk(quota[step]).indices] = True
            x[0, start:end] = torch.where(commit, candidates, x[0, start:end])
        if any((x[0, p:] == stop).any() for stop in settings["stopping_criteria_idx"]):
            break
    return x[0, p:].tolist(), forwards


@pytest.mark.parametrize("run", reference("sdar")["decoding"], ids=lambda r: r["name"])
def test_native_sdar_reproduces_generate_py_under_its_block_layout(run):
    tokens, forwards = sdar_block_decode(run["prompt"], run["settings"])
    assert (tokens, forwards) == (run["generated"], run["forwards"])


def dloom_sdar_decoder(run: dict, cache: str) -> DiffusionDecoder:
    """dloom's decoder with the settings of one of SDAR's recorded decodes.

    ``low_confidence_dynamic`` with threshold 0.85 and one token per step as its floor is
    ``threshold`` with ``tau`` 0.85; top-1 sampling gives every candidate probability 1, so
    each block commits whole in one step: ``quota`` with one step per block.
    """
    settings = run["settings"]
    lengths = {"gen_length": settings["gen_length"], "block_length": settings["block_length"], "cache": cache}
    if settings["top_k"] == 1:
        blocks = settings["gen_length"] // settings["block_length"]
        return DiffusionDecoder(adapter("sdar"), "quota", steps=blocks, **lengths)
    assert settings["denoising_steps"] == settings["block_length"]  # the floor is one token per step
    return DiffusionDecoder(adapter("sdar"), "threshold", tau=settings["confidence_threshold"], **lengths)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("run", reference("sdar")["decoding"], ids=lambda r: r["name"])
def test_dloom_decodes_sdar_exactly_as_generate_py(run, cache):
    """dloom's own decoder, with the block layout read from the checkpoint (absolute
    alignment), gives generate.py's tokens under every cache mode. generate.py's forward
    count adds one prefill forward and one cache-store forward per decoded block to the
    decoding forwards that dloom counts as NFE."""
    result = dloom_sdar_decoder(run, cache).generate([run["prompt"]])
    generated = result.generated[0].tolist()
    assert generated[: len(run["generated"])] == run["generated"]
    prompt, k = len(run["prompt"]), run["settings"]["block_length"]
    blocks = -(-(prompt + run["settings"]["gen_length"]) // k) - prompt // k
    assert int(result.nfe[0]) == run["forwards"] - 1 - blocks


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("top_k", [1, 0], ids=["top-k 1", "temperature 0"])
def test_dloom_decodes_sdar_prompts_of_different_lengths_in_one_padded_batch(cache, top_k):
    """Prompts of 6 and 8 tokens in one left-padded batch: each row's blocks lie at
    multiples of 4 from its own first real token (the 6-token row decodes its prompt's last
    2 positions' block, the 8-token row starts a fresh block), and each row gives its own
    generate.py decode under every cache mode."""
    runs = [r for r in reference("sdar")["decoding"] if r["settings"]["top_k"] == top_k]
    assert sorted(len(r["prompt"]) % 4 for r in runs) == [0, 2]
    result = dloom_sdar_decoder(runs[0], cache).generate([r["prompt"] for r in runs])
    for row, run in enumerate(runs):
        assert result.generated[row].tolist()[: len(run["generated"])] == run["generated"]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_an_end_of_turn_in_the_prompts_last_partial_block_does_not_end_the_row(cache):
    """A chat prompt holds SDAR's stop id ``<|im_end|>`` (151645) after every turn; with
    blocks aligned at position 0 it can lie in the prompt's last partial block, decoded with
    the first generated positions. It is prompt, not output: each row decodes as
    generate.py's loop does (its stop test reads only the generated positions), alone and in
    a padded batch. Counting it as the row's EOS crashed the decoder (the row's block moved
    past the canvas)."""
    run = next(r for r in reference("sdar")["decoding"] if r["settings"]["top_k"] == 0)
    stop = 151645
    assert stop in run["settings"]["stopping_criteria_idx"]
    k = run["settings"]["block_length"]
    prompts = [[*run["prompt"][: 2 * k], stop], [*run["prompt"][:k], stop, *run["prompt"][k : k + 2]]]
    assert all(p.index(stop) >= len(p) // k * k for p in prompts)  # in the last partial block
    decoder = dloom_sdar_decoder(run, cache)
    batched = decoder.generate(prompts)
    for row, prompt in enumerate(prompts):
        expected, forwards = sdar_block_decode(prompt, run["settings"])
        alone = decoder.generate([prompt])
        assert alone.generated[0].tolist()[: len(expected)] == expected
        assert batched.generated[row].tolist()[: len(expected)] == expected
        assert int(alone.nfe[0]) == int(batched.nfe[row]) > 0


@pytest.mark.parametrize("function", sorted({r["function"] for r in reference("llada")["decoding"]}))
def test_llada_decodes_prompts_of_different_lengths_in_one_padded_batch(function):
    """LLaDA's released forward ignores the padding mask, so its code decodes one prompt at a
    time; loaded natively, the 6- and 8-token prompts in one left-padded batch give each
    prompt's unpadded reference decode, with the same forward counts."""
    runs = [r for r in reference("llada")["decoding"] if r["function"] == function]
    groups: dict = {}
    for run in runs:
        groups.setdefault(run["settings"].get("threshold"), []).append(run)
    for group in groups.values():
        assert sorted(len(r["prompt"]) for r in group) == [6, 8]
        settings = group[0]["settings"]
        threshold = settings.get("threshold")
        decoder = DiffusionDecoder(
            adapter("llada"), "threshold" if threshold else "quota",
            gen_length=settings["gen_length"], block_length=settings["block_length"],
            steps=settings["steps"], cache=CACHE_OF[function.split("::")[1]],
            **({"tau": threshold} if threshold else {}),
        )
        result = decoder.generate([r["prompt"] for r in group])
        assert result.generated.tolist() == [r["generated"] for r in group]
        assert result.nfe.tolist() == [r["forwards"] for r in group]


def test_dloom_decodes_sdar_differently_with_the_prompt_as_its_own_block():
    """Negative control for the decoder: the same settings with ``block_alignment="prompt"``
    miss generate.py's tokens for the 6-token prompt, whose last block is partial."""
    run = next(r for r in reference("sdar")["decoding"] if r["settings"]["top_k"] != 1)
    assert len(run["prompt"]) % run["settings"]["block_length"]
    shifted = dataclasses.replace(adapter("sdar"), block_alignment="prompt")
    decoder = DiffusionDecoder(shifted, "threshold", tau=0.85, gen_length=16, block_length=4)
    assert decoder.generate([run["prompt"]]).generated[0].tolist()[:16] != run["generated"][:16]


@pytest.mark.parametrize("index", [0, 1], ids=["top-k 1", "temperature 0"])
def test_sdar_decodes_depend_on_the_absolute_block_layout(index):
    """Negative control: with the prompt as its own block (dloom's current layout) the same
    loop does not give SDAR's tokens for the 6-token prompt, whose last block is partial."""
    run = reference("sdar")["decoding"][index]
    assert len(run["prompt"]) % run["settings"]["block_length"]
    tokens, _ = sdar_block_decode(run["prompt"], run["settings"], layout="prompt")
    assert tokens != run["generated"][: len(tokens)]


def test_confidences_are_the_reference_probabilities_renormalised_without_the_mask():
    """dloom's confidence is the candidate's probability with the mask logit dropped: the
    reference's full-vocabulary probability divided by ``1 - p(mask)``. Candidates are the
    same whenever the mask is not the argmax; on these checkpoints every LLaDA decode above
    matches token for token with it."""
    logits = adapter("llada").logits(torch.tensor([reference("llada")["inputs"]["seq2"]]))
    mask = adapter("llada").mask_token_id
    # The checkpoint gives the mask a negligible probability (< 1e-9); raise its logit to just
    # below each position's best, so that dropping it or not changes the confidence visibly.
    logits[..., mask] = logits.max(-1).values - 0.5
    candidates, confidence = propose(logits, 0.0, "low_confidence", None, mask)
    full = torch.softmax(logits.double(), dim=-1)
    expected = full.gather(-1, candidates[..., None])[..., 0] / (1 - full[..., mask])
    assert torch.allclose(confidence.double(), expected, rtol=1e-5, atol=0)
    with_mask = full.gather(-1, candidates[..., None])[..., 0]
    assert ((confidence.double() - with_mask) / with_mask).min() > 0.05  # the mask is not in the softmax
    assert torch.equal(candidates, logits.argmax(-1))  # the mask, one below the best, is never picked


# --- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_cli_generates_from_each_checkpoint_without_remote_code(family, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompt = reference(family)["prompts"][0]
    prompts.write_text(json.dumps({"input_ids": prompt}) + "\n")
    result = CliRunner().invoke(app, [
        "generate", "--model", str(checkpoint(family)), "--prompts", str(prompts),
        "--gen-length", "8", "--block-length", "4", "--json",
    ])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.splitlines()[-1])
    assert row["config"]["model"] == str(checkpoint(family))
    expected = DiffusionDecoder(adapter(family), gen_length=8, block_length=4).generate([prompt])
    assert row["tokens"] == expected.generated[0, : int(expected.generated_lengths[0])].tolist()


def test_cli_generates_text_with_sdars_chat_template():
    result = CliRunner().invoke(app, [
        "generate", "--model", str(checkpoint("sdar")), "--chat", "--gen-length", "8", "--json", "hello",
    ])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.splitlines()[-1])
    assert row["config"]["block_length"] == 4 and isinstance(row["text"], str)


def test_cli_failfast_with_the_qwen2_target_gives_its_greedy_decode(tmp_path):
    """`dloom generate --strategy failfast` with the Qwen2.5 checkpoint as target and Dream's
    as drafter (same vocabulary) is lossless: transformers' greedy tokens."""
    run = next(r for r in reference("qwen2")["decoding"] if r["name"] == "greedy_p0")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": run["prompt"]}) + "\n")
    result = CliRunner().invoke(app, [
        "generate", "--strategy", "failfast", "--target", str(checkpoint("qwen2")),
        "--drafter", str(checkpoint("dream")), "--prompts", str(prompts),
        "--gen-length", str(run["settings"]["max_new_tokens"]), "--json",
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["tokens"] == run["generated"]
