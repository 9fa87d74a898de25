"""DiffusionGemma loads onto transformers' own class and decodes on the uniform kernel.

``tests/fixtures/real-families/diffusion_gemma/`` holds a tiny random
``DiffusionGemmaForBlockDiffusion`` checkpoint exactly as ``save_pretrained`` writes it (no
``.py`` files) and what transformers 5.25.0 computed on it (see its README). Here dloom must
give the same canvas logits (float32, 1e-4) on every recorded input: without and with
self-conditioning, and a left-padded batch.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dloom import load_model
from dloom.hooks.registry import get_registry

FIXTURE = Path(__file__).parents[1] / "fixtures" / "real-families" / "diffusion_gemma"
CHECKPOINT = FIXTURE / "checkpoint"
ATOL = 1e-4


@cache
def reference() -> dict:
    return json.loads((FIXTURE / "reference.json").read_text())


@cache
def recorded() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "reference.safetensors")


@cache
def adapter():
    return load_model(CHECKPOINT)


def assert_logits_match(name: str, logits: torch.Tensor) -> None:
    """``logits`` ``(B, C, V)`` against entry ``name``: the recorded columns, and the argmax,
    max and logsumexp over the whole vocabulary."""
    tensors = recorded()
    columns = tensors["columns"]
    torch.testing.assert_close(logits[..., columns], tensors[f"{name}.logits_cols"], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits.amax(-1), tensors[f"{name}.max"], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits.logsumexp(-1), tensors[f"{name}.logsumexp"], rtol=0, atol=ATOL)
    assert torch.equal(logits.argmax(-1), tensors[f"{name}.argmax"])


def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    entry = reference()["inputs"][name]
    return torch.tensor([entry["prompt"]]), torch.tensor([entry["canvas"]])


def test_the_family_is_registered_and_loads_onto_transformers_own_class():
    from transformers import DiffusionGemmaForBlockDiffusion

    family = get_registry().families.detect(CHECKPOINT)
    assert family.name == "diffusion-gemma" and family.plugin == "families"
    model = adapter()
    assert type(model.model) is DiffusionGemmaForBlockDiffusion
    assert not list(CHECKPOINT.glob("*.py"))
    assert (model.mask_token_id, model.pad_token_id, model.eos_token_ids) == (None, 0, (1,))
    assert (model.kernel, model.attention, model.default_block_length) == ("uniform", "block-causal", 8)
    assert model.max_context == 4096


@pytest.mark.parametrize("name", ["pair0", "pair1", "pair2"])
def test_canvas_logits_match_with_and_without_self_conditioning(name):
    prompt, canvas = pair(name)
    model = adapter()
    plain = model.canvas_logits(prompt, torch.ones_like(prompt), canvas)
    assert_logits_match(name, plain)
    conditioned = model.canvas_logits(prompt, torch.ones_like(prompt), canvas, plain)
    assert_logits_match(f"{name}_sc", conditioned)


def test_canvas_logits_of_a_left_padded_batch_match():
    """Positions ignore left padding here (the reference's do not): rotary attention sees
    relative positions only, so the rows' logits are the same."""
    entry = reference()["logits"]["padded_batch"]
    ids, mask = torch.tensor(entry["input_ids"]), torch.tensor(entry["attention_mask_2d"])
    logits = adapter().canvas_logits(ids, mask, torch.tensor(entry["decoder_input_ids"]))
    assert_logits_match("padded_batch", logits)
