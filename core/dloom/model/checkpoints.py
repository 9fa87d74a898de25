"""Released dLLM checkpoints loaded onto ``transformers``' own classes, without their code.

LLaDA, Dream, SDAR, SDAR-MoE and Fast-dLLM v2 ship their own modelling code (``auto_map``),
which no longer runs on ``transformers`` 5. Their architectures are nevertheless
``transformers``' Llama, Qwen2, Qwen3 and Qwen3-MoE with another attention pattern, so dloom
loads each checkpoint onto the native class instead:

- the checkpoint's ``config.json`` is translated into the native config
  (:func:`native_config`), with ``is_causal=False`` for the bidirectional families;
- the tensor names are renamed at load time by ``from_pretrained(key_mapping=...)``
  (:attr:`NativeLayout.key_mapping`); the weights are read in place, never rewritten.

The native classes keep SDPA (and flash attention where it is installed), ``transformers``
caches and ``device_map`` working, and they compute RoPE's ``inv_freq`` themselves (the
buffers that ``transformers`` 5 leaves uninitialised in the remote code).
LLaDA2.x (BailingMoeV2) has no ``transformers`` class: its layout names dloom's own
(:mod:`dloom.model.bailing`), registered with ``transformers``' auto classes, onto which the
checkpoint loads under its own tensor names.
Each layout is registered with its family's profile as one
:class:`dloom.model.families.FamilyRegistration` (:mod:`dloom.model.builtin_families`), and
:func:`dloom.model.tensor_check.check_tensors` checks a checkpoint's tensor names, shapes and
dtypes against the native model before any weight is read; a checkpoint's ``.py`` files
are never imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dloom.errors import ModelError


@dataclass(frozen=True)
class NativeLayout:
    """How one family's checkpoint maps onto a native ``transformers`` class.

    :ivar family: the name of the profile it is registered with (``"llada"``), used in
        messages.
    :ivar model_type: the native ``model_type`` (``"llama"``, ``"qwen2"``, ``"qwen3"``,
        ``"qwen3_moe"``).
    :ivar convert: the checkpoint's config dict -> keyword arguments of the native config.
    :ivar key_mapping: regex -> replacement for the checkpoint's tensor names (applied by
        ``from_pretrained``); empty when the names already match.
    """

    family: str
    model_type: str
    convert: Callable[[Mapping[str, Any]], dict[str, Any]]
    key_mapping: dict[str, str] = field(default_factory=dict)


def _common(raw: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The config keys that carry over under the same name (when present)."""
    return {k: raw[k] for k in keys if k in raw}


def _rope(raw: Mapping[str, Any], theta_key: str = "rope_theta") -> dict[str, Any]:
    """``rope_parameters`` of the native config from the checkpoint's RoPE fields.

    :raises ModelError: for a RoPE scaling dloom does not translate.
    """
    scaling = raw.get("rope_scaling")
    if scaling:
        raise ModelError(
            f"rope_scaling {scaling!r} in the checkpoint's config is not translated to a native "
            "config; only default RoPE (rope_scaling null) is supported"
        )
    return {"rope_parameters": {"rope_type": "default", "rope_theta": float(raw.get(theta_key, 10000.0))}}


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")
QWEN_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "hidden_act",
    "tie_word_embeddings", "attention_dropout", "initializer_range", *SPECIAL_IDS,
)

#: LLaDA config values the bidirectional Llama reproduces; any other value is refused.
LLADA_REQUIRED = {
    "block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True,
    "alibi": False, "attention_layer_norm": False, "include_bias": False, "scale_logits": False,
    "input_emb_norm": False, "clip_qkv": None,
}


def _llada_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """LLaDA's OLMo-style config (``d_model``, ``n_heads``, ...) as a bidirectional Llama's.

    :raises ModelError: for a LLaDA variant the Llama block does not compute (ALiBi, QKV
        biases, layer norms other than RMS, another activation, ...), naming the key.
    """
    for key, allowed in LLADA_REQUIRED.items():
        if key in raw and raw[key] != allowed:
            raise ModelError(
                f"LLaDA config {key}={raw[key]!r} has no native equivalent (a bidirectional "
                f"Llama needs {key}={allowed!r}); load this checkpoint with --trust-remote-code"
            )
    if raw.get("include_qkv_bias"):
        raise ModelError(
            "LLaDA config include_qkv_bias=True has no native equivalent (Llama's attention_bias "
            "also biases the output projection); load this checkpoint with --trust-remote-code"
        )
    heads = int(raw["n_heads"])
    kv_heads = raw.get("n_kv_heads") or (1 if raw.get("multi_query_attention") else heads)
    mlp = raw.get("mlp_hidden_size") or int(raw.get("mlp_ratio", 4)) * int(raw["d_model"])
    return {
        "vocab_size": int(raw.get("embedding_size") or raw["vocab_size"]),
        "hidden_size": int(raw["d_model"]),
        "intermediate_size": int(mlp),
        "num_hidden_layers": int(raw["n_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "max_position_embeddings": int(raw.get("max_sequence_length", 4096)),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
        "hidden_act": "silu",
        "tie_word_embeddings": bool(raw.get("weight_tying", False)),
        "attention_bias": False,
        "mlp_bias": False,
        "is_causal": False,
        **_rope(raw),
        **_common(raw, SPECIAL_IDS),
    }


def _qwen_config(causal: bool) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """Converter for a Qwen2/Qwen3-shaped config (Dream, SDAR, Fast-dLLM v2, and SDAR-MoE's
    attention keys)."""

    def convert(raw: Mapping[str, Any]) -> dict[str, Any]:
        if raw.get("use_sliding_window"):
            raise ModelError(
                "use_sliding_window=True in the checkpoint's config: dloom's native loading "
                "supports full attention only"
            )
        values = {**_common(raw, QWEN_KEYS), **_rope(raw), "is_causal": causal}
        values.update(_common(raw, ("head_dim", "attention_bias")))
        values["use_sliding_window"] = False
        values["sliding_window"] = None
        return values

    return convert


#: The mixture-of-experts keys of an SDAR-MoE config that the native Qwen3-MoE needs and has
#: no safe default for (its class defaults, 128 experts and no top-k renormalisation, would
#: load a different model without a word).
SDAR_MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")


def _sdar_moe_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """SDAR-MoE's config (Qwen3-MoE's keys plus SDAR's) as a causal ``Qwen3MoeConfig``.

    The keys are those the published SDAR-MoE loaders read (JetEngine's
    ``jetengine/models/sdar_moe.py``, SGLang's ``srt/models/sdar_moe.py``): Qwen3's attention
    keys, ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``norm_topk_prob``, ``decoder_sparse_step`` and ``mlp_only_layers`` (layers with a dense
    MLP of ``intermediate_size``).

    :raises KeyError: for a missing :data:`SDAR_MOE_REQUIRED` key (reported by
        :func:`native_config`).
    :raises ModelError: for a value with no native equivalent (as for dense SDAR).
    """
    values = _qwen_config(causal=True)(raw)
    values.update({
        "num_experts": int(raw["num_experts"]),
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw["norm_topk_prob"]),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [int(i) for i in raw.get("mlp_only_layers") or ()],
        "output_router_logits": False,
    })
    return values


#: LLaDA2.x config values the BailingMoeV2 class computes; any other value is refused.
LLADA2_REQUIRED = {
    "score_function": "sigmoid", "norm_topk_prob": True, "use_sliding_window": False,
    "norm_head": False, "norm_softmax": False, "use_rmsnorm": True, "tie_word_embeddings": False,
}
LLADA2_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "partial_rotary_factor", "rms_norm_eps",
    "hidden_act", "use_qkv_bias", "use_bias", "use_qk_norm", "num_experts", "num_experts_per_tok",
    "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "num_shared_experts",
    "first_k_dense_replace", "max_position_embeddings", "initializer_range", *SPECIAL_IDS,
)


def _llada2_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """LLaDA2.x's config (``llada2_moe``) as dloom's own BailingMoeV2 config
    (:mod:`dloom.model.bailing`, registered with ``transformers``' auto classes here).

    :raises ModelError: for a value the class does not compute (another router score
        function, a sliding window, a normalised head, RoPE scaling, ...), naming the key.
    """
    from dloom.model import bailing

    for key, allowed in LLADA2_REQUIRED.items():
        if key in raw and raw[key] != allowed:
            raise ModelError(
                f"LLaDA2 config {key}={raw[key]!r} is not computed by dloom's BailingMoeV2 "
                f"class (it needs {key}={allowed!r})"
            )
    bailing.register()
    rope = _rope(raw)["rope_parameters"]
    return {**_common(raw, LLADA2_KEYS), "rope_theta": rope["rope_theta"]}


def _block(i: str) -> str:
    return rf"^model\.transformer\.blocks\.(\d+)\.{i}\."


#: LLaDA's tensor names (``model.transformer.blocks.N.q_proj``, ...) -> Llama's.
LLADA_KEYS = {
    r"^model\.transformer\.wte\.": "model.embed_tokens.",
    r"^model\.transformer\.ln_f\.": "model.norm.",
    r"^model\.transformer\.ff_out\.": "lm_head.",
    _block("q_proj"): r"model.layers.\1.self_attn.q_proj.",
    _block("k_proj"): r"model.layers.\1.self_attn.k_proj.",
    _block("v_proj"): r"model.layers.\1.self_attn.v_proj.",
    _block("attn_out"): r"model.layers.\1.self_attn.o_proj.",
    _block("attn_norm"): r"model.layers.\1.input_layernorm.",
    _block("ff_norm"): r"model.layers.\1.post_attention_layernorm.",
    _block("ff_proj"): r"model.layers.\1.mlp.gate_proj.",
    _block("up_proj"): r"model.layers.\1.mlp.up_proj.",
    _block("ff_out"): r"model.layers.\1.mlp.down_proj.",
}

LLADA_LAYOUT = NativeLayout("llada", "llama", _llada_config, LLADA_KEYS)
DREAM_LAYOUT = NativeLayout("dream", "qwen2", _qwen_config(causal=False))
SDAR_LAYOUT = NativeLayout("sdar", "qwen3", _qwen_config(causal=True))
# Tensor names are Qwen3-MoE's own (``mlp.gate``, ``mlp.experts.E.{gate,up,down}_proj``);
# transformers' qwen3_moe weight conversion stacks the experts at load time.
SDAR_MOE_LAYOUT = NativeLayout("sdar-moe", "qwen3_moe", _sdar_moe_config)
FAST_DLLM_V2_LAYOUT = NativeLayout("fast-dllm-v2", "qwen2", _qwen_config(causal=True))
# No transformers class: dloom's own (dloom.model.bailing), tensor names as published.
LLADA2_LAYOUT = NativeLayout("llada2", "dloom_bailing_moe_v2", _llada2_config)


def native_config(layout: NativeLayout, raw: Mapping[str, Any]) -> Any:
    """The native ``transformers`` config of a checkpoint whose config dict is ``raw``.

    :raises ModelError: when a key the native class needs is missing or a value has no
        native equivalent.
    """
    from transformers import AutoConfig

    try:
        values = layout.convert(raw)
    except KeyError as missing:
        raise ModelError(
            f"the checkpoint's config.json lacks {missing.args[0]!r}, which a {layout.family} "
            "config always has"
        ) from None
    config = AutoConfig.for_model(layout.model_type, **values)
    if "mask_token_id" in raw:
        config.mask_token_id = raw["mask_token_id"]
    return config
