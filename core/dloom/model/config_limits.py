"""Sanity limits on a checkpoint's ``config.json``, checked before any model is built.

A config is input from anywhere: ``num_hidden_layers: 1000000`` would build a million
layers (minutes, then memory), ``hidden_size: "4096"`` or ``-1`` would fail deep inside a
model class, and a config that describes a far larger model than its weights files hold
would load mostly random weights. :func:`check_config_values` refuses each, naming the
field, its value and what is allowed, in well under a second:

- the size fields (:data:`SIZE_LIMITS`, under ``transformers``' names and LLaDA's) must be
  integers within absolute caps;
- the attention heads must divide the hidden size (unless ``head_dim`` is given) and the
  key/value heads the attention heads;
- the identity fields dloom reads (``architectures``, ``auto_map``, the ``dloom`` section,
  the special token ids) must have their JSON types.

:func:`check_size_against_weights` then compares a lower bound on the parameter count that
the (native) config implies with the bytes of the tensors the checkpoint's safetensors
files hold.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dloom.errors import ModelError
from dloom.model.json_files import read_json_object


@dataclass(frozen=True)
class Limit:
    """The allowed integer range of one config field; ``nullable`` allows ``null``
    (``transformers`` then derives the value)."""

    low: int
    high: int
    nullable: bool = False


_LAYERS = Limit(1, 1024)
_WIDTH = Limit(1, 65536)
_FFN = Limit(1, 1_048_576)
_HEADS = Limit(1, 4096)
_VOCAB = Limit(1, 4_194_304)
SIZE_LIMITS: dict[str, Limit] = {
    "num_hidden_layers": _LAYERS,
    "n_layers": _LAYERS,  # LLaDA's names
    "hidden_size": _WIDTH,
    "d_model": _WIDTH,
    "intermediate_size": _FFN,
    "mlp_hidden_size": Limit(1, 1_048_576, nullable=True),
    "moe_intermediate_size": _FFN,
    "num_attention_heads": _HEADS,
    "n_heads": _HEADS,
    "num_key_value_heads": Limit(1, 4096, nullable=True),
    "n_kv_heads": Limit(1, 4096, nullable=True),
    "head_dim": Limit(1, 65536, nullable=True),
    "vocab_size": _VOCAB,
    "embedding_size": Limit(1, 4_194_304, nullable=True),
    "max_position_embeddings": Limit(1, 16_777_216, nullable=True),
    "max_sequence_length": Limit(1, 16_777_216, nullable=True),
    "num_experts": Limit(0, 4096),
    "num_experts_per_tok": Limit(1, 4096),
    "block_size": Limit(1, 65536),  # SDAR's trained block size
    "bd_size": Limit(1, 65536),  # Fast-dLLM v2's
}
"""The size fields checked when present, with their absolute caps."""

TOKEN_ID_FIELDS = ("mask_token_id", "pad_token_id", "bos_token_id", "eos_token_id", "eos_token_ids")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_ids(raw: Mapping[str, Any], where: str, prefix: str = "") -> None:
    """Refuse a special token id of ``raw`` (:data:`TOKEN_ID_FIELDS`) that is no token id.

    :raises ModelError: naming the file, the field and its value.
    """
    for key in TOKEN_ID_FIELDS:
        value = raw.get(key)
        if value is None or _is_int(value) and value >= 0:
            continue
        if isinstance(value, list) and value and all(_is_int(v) and v >= 0 for v in value):
            continue
        raise ModelError(
            f"{where} {prefix}{key} is {value!r}; allowed: a token id (an integer >= 0)"
            + (", or a list of them" if key.startswith("eos") else "")
        )


def check_config_values(raw: Mapping[str, Any], where: str = "config.json") -> None:
    """Refuse a config whose size fields, head counts or identity fields cannot describe a
    model dloom can build (see the module docstring).

    :param raw: the parsed ``config.json``.
    :param where: the file, for the message.
    :raises ModelError: naming the field, its value and what is allowed.
    """
    for key, limit in SIZE_LIMITS.items():
        if key not in raw:
            continue
        value = raw[key]
        if value is None and limit.nullable:
            continue
        if not _is_int(value) or not limit.low <= value <= limit.high:
            shown = f"{value!r}" if _is_int(value) else f"{value!r} ({type(value).__name__})"
            raise ModelError(
                f"{where} {key} is {shown}; allowed: an integer {limit.low} .. {limit.high}"
            )
    hidden = raw.get("hidden_size", raw.get("d_model"))
    heads = raw.get("num_attention_heads", raw.get("n_heads"))
    kv_heads = raw.get("num_key_value_heads", raw.get("n_kv_heads"))
    if hidden is not None and heads is not None and raw.get("head_dim") is None and hidden % heads:
        raise ModelError(
            f"{where} hidden_size {hidden} is not divisible by num_attention_heads {heads}; "
            "allowed: a multiple of the head count (or an explicit head_dim)"
        )
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ModelError(
            f"{where} num_attention_heads {heads} is not divisible by num_key_value_heads "
            f"{kv_heads}; allowed: a divisor of the head count"
        )
    experts, per_token = raw.get("num_experts"), raw.get("num_experts_per_tok")
    if _is_int(experts) and experts and _is_int(per_token) and per_token > experts:
        raise ModelError(
            f"{where} num_experts_per_tok {per_token} exceeds num_experts {experts}; "
            f"allowed: 1 .. {experts}"
        )
    architectures = raw.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise ModelError(f"{where} architectures is {architectures!r}; allowed: a list of class names")
    for key in ("auto_map", "dloom"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ModelError(f"{where} {key} is {raw[key]!r}; allowed: a JSON object")
    if raw.get("model_type") is not None and not isinstance(raw["model_type"], str):
        raise ModelError(f"{where} model_type is {raw['model_type']!r}; allowed: a string")
    check_token_ids(raw, where)
    check_token_ids(raw.get("dloom") or {}, where, prefix="dloom.")
    kernel = (raw.get("dloom") or {}).get("kernel")
    if kernel is not None and not (isinstance(kernel, str) and kernel.isidentifier()):
        raise ModelError(f"{where} dloom.kernel is {kernel!r}; allowed: a kernel name such as 'absorbing' or 'revisable'")


def parameter_lower_bound(config: Any) -> tuple[int, str] | None:
    """A lower bound on the parameters of the model a ``transformers`` config describes,
    and the field that contributes most (``"num_hidden_layers"`` or ``"vocab_size"``);
    ``None`` when the config lacks the sizes (an architecture with other names).

    Per layer: the query and output projections (``2 * hidden * heads * head_dim``) and
    two of the MLP's matrices (``2 * hidden * ffn``, one expert's for a mixture of
    experts); once: the embedding (``vocab * hidden``). Norms, biases, key/value
    projections, a third MLP matrix, the other experts and an untied output head only add.
    """
    try:
        hidden = int(config.hidden_size)
        layers = int(config.num_hidden_layers)
        vocab = int(config.vocab_size)
        heads = int(config.num_attention_heads)
    except (AttributeError, TypeError, ValueError):
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // max(heads, 1)
    ffn_sizes = [getattr(config, key, None) for key in ("intermediate_size", "moe_intermediate_size")]
    ffn = min((int(f) for f in ffn_sizes if isinstance(f, int) and f > 0), default=0)
    per_layer = 2 * hidden * heads * int(head_dim) + 2 * hidden * ffn
    embedding = vocab * hidden
    dominant = "num_hidden_layers" if layers * per_layer >= embedding else "vocab_size"
    return layers * per_layer + embedding, dominant


def check_size_against_weights(config: Any, weight_bytes: int, where: str = "config.json") -> None:
    """Refuse a config that describes a larger model than the checkpoint's tensors can hold,
    at one byte per parameter (no dtype dloom loads is smaller).

    :param config: the ``transformers`` config the model would be built from.
    :param weight_bytes: the bytes of every tensor in the checkpoint's safetensors files.
    :raises ModelError: naming the field that contributes most, its value, the bound and
        the bytes present.
    """
    bound = parameter_lower_bound(config)
    if bound is None:
        return
    parameters, field = bound
    if parameters > weight_bytes:
        raise ModelError(
            f"{where} {field} is {getattr(config, field)}: with hidden_size "
            f"{config.hidden_size} the config describes at least {parameters:,} parameters, but "
            f"the checkpoint's tensors hold {weight_bytes:,} bytes (allowed: a config whose "
            "model fits the weights it ships; a size field is wrong or weights are missing)"
        )


def check_config(directory: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``directory``, its values checked
    (:func:`check_config_values`).

    :raises ModelError: when it is missing, unreadable, not JSON, not a JSON object, too
        large or too deeply nested, or a value is of the wrong type or out of bounds.
    """
    path = directory / "config.json"
    if not os.path.lexists(path):
        raise ModelError(f"no config.json in {str(directory)!r}; a checkpoint directory needs one")
    data = read_json_object(path)
    check_config_values(data, repr(str(path)))
    return data
