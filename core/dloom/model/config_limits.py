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
- the number fields (:data:`NUMBER_LIMITS`: ``rms_norm_eps``, ``rope_theta``, ...) must be
  finite numbers in range, the flags (:data:`FLAG_FIELDS`: ``tie_word_embeddings``, ...)
  ``true`` or ``false``, ``hidden_act`` an activation ``transformers`` has, every RoPE
  ``rope_type`` one it computes, and the rotary dimension (``head_dim`` times
  ``partial_rotary_factor``) even;
- the identity fields dloom reads (``architectures``, ``auto_map``, the ``dloom`` section,
  the special token ids) must have their JSON types, and a special token id must lie inside
  the vocabulary;
- the ``dloom`` section's conventions (:data:`SECTION_FIELDS`: ``shift``, ``attention``,
  ``block_length``, ...) must be values a decoder takes.

These are the checks of every family (LLaDA, Dream, SDAR, LLaDA2, a plugin's, the
``transformers`` catch-all): each field is checked here, on the checkpoint's own
``config.json``, before any family translates it or any model is built.

:func:`check_size_against_weights` then compares a lower bound on the parameter count that
the (native) config implies with the bytes of the tensors the checkpoint's safetensors
files hold.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dloom.errors import ModelError
from dloom.model.json_files import read_json_object

BLOCK_ALIGNMENTS = ("prompt", "absolute")
"""Where a model's blocks start: after the prompt, or at absolute multiples of the block length."""
ATTENTION_KINDS = ("bidirectional", "block-causal", "causal")
"""The attention patterns a model may declare (``dloom.attention``)."""


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



@dataclass(frozen=True)
class NumberLimit:
    """The allowed range of one real-valued config field: a finite JSON number from ``low``
    (excluded when ``open_low``) to ``high``."""

    low: float
    high: float
    open_low: bool = False

    def allows(self, value: Any) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return False
        return (self.low < value if self.open_low else self.low <= value) and value <= self.high

    def describe(self) -> str:
        return f"a finite number {'>' if self.open_low else '>='} {self.low:g} and <= {self.high:g}"


_EPSILON = NumberLimit(0.0, 1.0, open_low=True)
NUMBER_LIMITS: dict[str, NumberLimit] = {
    "rms_norm_eps": _EPSILON,
    "layer_norm_eps": _EPSILON,
    "rope_theta": NumberLimit(0.0, 1e15, open_low=True),
    "partial_rotary_factor": NumberLimit(0.0, 1.0, open_low=True),
    "attention_dropout": NumberLimit(0.0, 1.0),
    "initializer_range": NumberLimit(0.0, 1e6),
    "routed_scaling_factor": NumberLimit(0.0, 1e6, open_low=True),
}
"""The real-valued fields checked when present (the model classes take them as floats)."""

FLAG_FIELDS: dict[str, bool] = {
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "use_sliding_window": False, "norm_topk_prob": False, "use_qkv_bias": False,
    "use_bias": False, "use_qk_norm": False, "is_causal": True,
    "weight_tying": True, "multi_query_attention": True, "include_qkv_bias": True,  # LLaDA's
}
"""The boolean fields checked when present, and whether ``null`` is allowed (the native
classes refuse it for the ones marked ``False``)."""

TOKEN_ID_FIELDS = ("mask_token_id", "pad_token_id", "bos_token_id", "eos_token_id", "eos_token_ids")

SECTION_FIELDS: dict[str, Any] = {
    "shift": (True, False),
    "attention": ATTENTION_KINDS,
    "block_alignment": BLOCK_ALIGNMENTS,
    "block_length": Limit(1, 65536),
    "gen_length": Limit(1, 16_777_216),
}
"""The conventions of a config's ``dloom`` section (besides its token ids): the allowed
values, or the integer range."""

ROPE_KEYS = ("rope_parameters", "rope_scaling")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """``value`` for a message, with its type unless it is an integer."""
    return repr(value) if _is_int(value) else f"{value!r} ({type(value).__name__})"


def vocabulary_size(raw: Mapping[str, Any]) -> int | None:
    """The rows of the embedding a config describes (LLaDA's ``embedding_size`` when given,
    else ``vocab_size``); ``None`` when the config does not say."""
    for key in ("embedding_size", "vocab_size"):
        if _is_int(raw.get(key)):
            return int(raw[key])
    return None


def check_token_ids(raw: Mapping[str, Any], where: str, prefix: str = "", vocab: int | None = None) -> None:
    """Refuse a special token id of ``raw`` (:data:`TOKEN_ID_FIELDS`) that is no token id,
    or (given the ``vocab`` size) lies outside the vocabulary.

    :raises ModelError: naming the file, the field, its value and the allowed ids.
    """
    allowed = "a token id (an integer >= 0)" if vocab is None else f"a token id 0 .. {vocab - 1}"
    bound = math.inf if vocab is None else vocab
    for key in TOKEN_ID_FIELDS:
        value: Any = raw.get(key)
        values: list[Any] = value if isinstance(value, list) and value else [value]
        if value is None or all(_is_int(v) and 0 <= v < bound for v in values):
            continue
        raise ModelError(
            f"{where} {prefix}{key} is {value!r}; allowed: {allowed}"
            + (", or a list of them" if key.startswith("eos") else "")
        )


def _check_kinds(raw: Mapping[str, Any], where: str) -> None:
    """The number fields, the flags and ``hidden_act``."""
    for key, number in NUMBER_LIMITS.items():
        if key in raw and not number.allows(raw[key]):
            raise ModelError(f"{where} {key} is {_shown(raw[key])}; allowed: {number.describe()}")
    for key, nullable in FLAG_FIELDS.items():
        if key in raw and not (isinstance(raw[key], bool) or raw[key] is None and nullable):
            raise ModelError(
                f"{where} {key} is {_shown(raw[key])}; allowed: true or false" + (" (or null)" if nullable else "")
            )
    if "hidden_act" in raw:
        from transformers.activations import ACT2FN

        if not isinstance(raw["hidden_act"], str) or raw["hidden_act"] not in ACT2FN:
            raise ModelError(
                f"{where} hidden_act is {raw['hidden_act']!r}; allowed: {', '.join(sorted(ACT2FN))}"
            )


def _check_rope(raw: Mapping[str, Any], where: str) -> None:
    """Every RoPE setting a known ``rope_type``, and the rotary dimension even."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kinds = ("default", *sorted(ROPE_INIT_FUNCTIONS))
    for key in ROPE_KEYS:
        settings = raw.get(key)
        if settings is None:
            continue
        if not isinstance(settings, dict):
            raise ModelError(f"{where} {key} is {settings!r}; allowed: a JSON object, or null")
        # one setting, or one per layer type ({"full_attention": {...}, "sliding_attention": {...}})
        nested = not ({"rope_type", "type", "rope_theta"} & set(settings)) and all(
            isinstance(v, dict) for v in settings.values())
        for name, setting in (settings.items() if nested else [("", settings)]):
            field_name = f"{key}.{name}." if name else f"{key}."
            for kind_key in ("rope_type", "type"):
                kind = setting.get(kind_key)
                if kind_key in setting and kind not in kinds:
                    raise ModelError(f"{where} {field_name}{kind_key} is {kind!r}; allowed: {', '.join(kinds)}")
            if "rope_theta" in setting and not NUMBER_LIMITS["rope_theta"].allows(setting["rope_theta"]):
                raise ModelError(
                    f"{where} {field_name}rope_theta is {_shown(setting['rope_theta'])}; allowed: "
                    + NUMBER_LIMITS["rope_theta"].describe()
                )
    if not (raw.get("rope", True) and any(k in raw for k in ("rope_theta", "rope", *ROPE_KEYS))):
        return
    hidden = raw.get("hidden_size", raw.get("d_model"))
    heads = raw.get("num_attention_heads", raw.get("n_heads"))
    head_dim = raw.get("head_dim") or (hidden // heads if hidden is not None and heads is not None else None)
    if head_dim is None:
        return
    rotary = head_dim * raw.get("partial_rotary_factor", 1.0)
    if rotary != int(rotary) or int(rotary) % 2:
        source = "head_dim is" if raw.get("head_dim") else f"hidden_size {hidden} / num_attention_heads {heads} gives head_dim"
        factor = f" (times partial_rotary_factor {raw['partial_rotary_factor']})" if "partial_rotary_factor" in raw else ""
        raise ModelError(
            f"{where} {source} {head_dim}{factor}: RoPE rotates pairs of dimensions; allowed: an "
            "even rotary dimension"
        )


def check_section(section: Mapping[str, Any], where: str, vocab: int | None = None) -> None:
    """Refuse a ``dloom`` section whose conventions (:data:`SECTION_FIELDS`) or token ids
    a decoder cannot take.

    :raises ModelError: naming the field (``dloom.shift``), its value and what is allowed.
    """
    for key, allowed in SECTION_FIELDS.items():
        if key not in section:
            continue
        value = section[key]
        if isinstance(allowed, Limit):
            if not _is_int(value) or not allowed.low <= value <= allowed.high:
                raise ModelError(
                    f"{where} dloom.{key} is {_shown(value)}; allowed: an integer {allowed.low} .. {allowed.high}"
                )
        elif not any(value is choice or value == choice and type(value) is type(choice) for choice in allowed):
            raise ModelError(
                f"{where} dloom.{key} is {_shown(value)}; allowed: "
                + ", ".join(json_text(choice) for choice in allowed)
            )
    kernel = section.get("kernel")
    if kernel is not None and not (isinstance(kernel, str) and kernel.isidentifier()):
        raise ModelError(f"{where} dloom.kernel is {_shown(kernel)}; allowed: a kernel name such as 'absorbing' or 'revisable'")
    check_token_ids(section, where, prefix="dloom.", vocab=vocab)


def json_text(value: Any) -> str:
    """``value`` as it is written in JSON (``true``, ``"causal"``)."""
    return json.dumps(value)


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
            raise ModelError(
                f"{where} {key} is {_shown(value)}; allowed: an integer {limit.low} .. {limit.high}"
            )
    _check_kinds(raw, where)
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
    _check_rope(raw, where)
    vocab = vocabulary_size(raw)
    check_token_ids(raw, where, vocab=vocab)
    check_section(raw.get("dloom") or {}, where, vocab)


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
