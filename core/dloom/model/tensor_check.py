"""A checkpoint's tensors checked against the model ``transformers`` builds from its config.

``from_pretrained`` initialises a parameter the checkpoint lacks at random and loads
anyway, silently casts an integer tensor into a float parameter, and fails deep in its
weight conversion on a tensor of another shape. :func:`check_tensors` builds the model on
the ``meta`` device (no memory, no weights read) and compares, for every checkpoint (a known
family's through its key map, any other as ``transformers`` loads it):

- **names**: every checkpoint tensor must have a place in the model (or be a name
  ``transformers`` skips on load, such as a saved RoPE ``inv_freq``), and every parameter
  must have a source. Tied parameters (the output head tied to the embedding) need one
  source between them; per-expert tensors of a mixture of experts fill the stacked expert
  parameter, every expert of it (a model with one module per expert names them as they
  are); a checkpoint saved from the base model (without the
  ``base_model_prefix``) matches too.
- **shapes**: each tensor's shape must be its parameter's (a per-expert tensor: one slice
  of the stacked one).
- **dtypes**: a floating parameter takes a floating tensor only (an ``I8`` tensor would be
  cast to meaningless floats; quantized checkpoints are not loaded).

Every mismatch is refused with a :class:`~dloom.errors.ModelError` naming the first few
offending tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from dloom.errors import ModelError
from dloom.model.files import FLOAT_DTYPES, TensorHeader

#: A per-expert tensor of a mixture-of-experts checkpoint (Qwen3-MoE's and SDAR-MoE's names),
#: which ``transformers`` stacks into ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``.
EXPERT_TENSOR = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
FUSED_EXPERTS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def listed(names: Iterable[str], limit: int = 6) -> str:
    """The first ``limit`` names, sorted and quoted, and how many more."""
    ordered = sorted(names)
    more = f" and {len(ordered) - limit} more" if len(ordered) > limit else ""
    return ", ".join(repr(n) for n in ordered[:limit]) + more


def meta_model(config: Any, model_class: str | None = None) -> Any:
    """The model ``transformers`` builds from ``config``, on the ``meta`` device: the
    ``transformers`` class ``model_class`` names, else the causal LM class, else the base
    model class (as :func:`dloom.load_model` falls back)."""
    import torch
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        if model_class is not None:
            return getattr(transformers, model_class)(config)
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            return AutoModel.from_config(config)


def _expert_slice_shape(fused: tuple[int, ...], proj: str) -> tuple[int, ...]:
    """The shape of one expert's ``proj`` matrix inside the stacked parameter of shape
    ``fused`` (``(experts, 2 * ffn, hidden)`` for gate_up, ``(experts, hidden, ffn)`` for down)."""
    if proj == "down_proj":
        return fused[1:]
    return (fused[1] // 2, *fused[2:])


def _target_name(name: str, key_mapping: Mapping[str, str], places: Mapping[str, Any], prefix: str) -> str:
    """The model's name for checkpoint tensor ``name``: renamed by ``key_mapping``, with the
    ``base_model_prefix`` added or removed when only that makes it a model name."""
    target = name
    for pattern, replacement in key_mapping.items():
        target = re.sub(pattern, replacement, target)
    if target in places or not prefix:
        return target
    if f"{prefix}.{target}" in places:
        return f"{prefix}.{target}"
    if target.startswith(prefix + ".") and target[len(prefix) + 1:] in places:
        return target[len(prefix) + 1:]
    return target


def check_tensors(
    config: Any, tensors: Mapping[str, TensorHeader], described: str,
    key_mapping: Mapping[str, str] | None = None, model_class: str | None = None,
) -> None:
    """Check a checkpoint's tensors (names, shapes, dtypes) against the model built from
    ``config``, before any weight is read (see the module docstring).

    :param config: the ``transformers`` config the model is built from.
    :param tensors: the checkpoint's safetensors header entries, by tensor name.
    :param described: what the model is, for the message (``"the llada layout (native
        llama)"``).
    :param key_mapping: regex -> replacement renaming the checkpoint's tensor names (as
        ``from_pretrained(key_mapping=...)``).
    :param model_class: the ``transformers`` class the model loads onto, when it is not an
        auto class's (:attr:`dloom.model.profiles.ModelProfile.model_class`).
    :raises ModelError: naming the unexpected and the missing tensors, or the tensors of
        the wrong shape or dtype.
    """
    model = meta_model(config, model_class)
    places: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    aliases: dict[int, list[str]] = {}
    for place_name, parameter in places.items():
        aliases.setdefault(id(parameter), []).append(place_name)
    skipped = [r"rotary_emb\.inv_freq$", *(model._keys_to_ignore_on_load_unexpected or ())]
    ignored = re.compile("|".join(skipped))
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    experts = int(getattr(config, "num_experts", 0) or 0)
    found: set[str] = set()
    unexpected: list[str] = []
    wrong: list[str] = []
    seen_experts: dict[tuple[str, str], set[int]] = {}
    for name, header in tensors.items():
        target = _target_name(name, key_mapping or {}, places, prefix)
        expert = EXPERT_TENSOR.match(target)
        if expert is not None and f"{expert['experts']}.{FUSED_EXPERTS[expert['proj']]}" not in places:
            expert = None  # a model that keeps one module per expert (BailingMoeV2) names it as is
        if expert is not None:
            target = f"{expert['experts']}.{FUSED_EXPERTS[expert['proj']]}"
            seen_experts.setdefault((expert["experts"], expert["proj"]), set()).add(int(expert["index"]))
        place = places.get(target)
        if place is None and ignored.search(target) is not None:
            continue  # transformers drops it on load, whatever its shape
        place = place if place is not None else buffers.get(target)
        if place is None:
            unexpected.append(name)
            continue
        found.add(target)
        shape = tuple(place.shape)
        if expert is not None and target in places:
            shape = _expert_slice_shape(shape, expert["proj"])
        if header.shape != shape:
            wrong.append(f"{name!r} has shape {list(header.shape)}, the model's {list(shape)}")
        elif place.is_floating_point() and not header.floating:
            wrong.append(
                f"{name!r} is {header.dtype}, the model's is floating point (allowed: "
                f"{', '.join(FLOAT_DTYPES)})"
            )
    missing = sorted(
        names[0] for names in aliases.values() if not any(n in found for n in names)
    )
    for experts_prefix in sorted({p for p, _ in seen_experts}):
        for proj, fused in FUSED_EXPERTS.items():
            if f"{experts_prefix}.{fused}" not in places:
                continue
            indices = seen_experts.get((experts_prefix, proj), set())
            missing += [f"{experts_prefix}.{i}.{proj}.weight" for i in range(experts) if i not in indices]
            unexpected += [f"{experts_prefix}.{i}.{proj}.weight" for i in sorted(indices) if i >= experts]
    if unexpected or missing:
        problems = []
        if unexpected:
            problems.append(f"tensors with no place in it: {listed(unexpected)}")
        if missing:
            problems.append(f"tensors it needs that the checkpoint lacks: {listed(missing)}")
        raise ModelError(
            f"the checkpoint's tensor names do not match {described}: " + "; ".join(problems)
            + " (a misspelled or missing tensor name, or a checkpoint of another shape)"
        )
    if wrong:
        more = f"; and {len(wrong) - 4} more" if len(wrong) > 4 else ""
        raise ModelError(
            f"the checkpoint's tensors do not fit {described}: " + "; ".join(wrong[:4]) + more
            + " (a checkpoint of another size, or quantized weights, which dloom does not load)"
        )
