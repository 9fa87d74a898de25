"""Zoo model construction: a fresh model of a spec, and a dLLM made from a causal checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dloom.zoo import tokenizer as tok

from .workloads import SHORT, SPECS

__all__ = ["build_config", "build_model", "dllm_from_ar", "n_params"]


def build_model(name: str) -> LlamaForCausalLM:
    """A freshly initialised zoo model (call ``torch.manual_seed`` first to reproduce it)."""
    return LlamaForCausalLM(build_config(name))


def build_config(name: str) -> LlamaConfig:
    """The transformers config of zoo model ``name``, with its ``dloom`` section (a long-answer
    model's also names its decoding ``block_length``, a model trained to edit its ``kernel``)."""
    spec = SPECS[name]
    workload = spec.workload
    bidirectional = spec.kind == "dllm"
    blocks = {} if workload is SHORT else {"block_length": workload.block_length}
    kernel = {} if spec.kernel == "absorbing" else {"kernel": spec.kernel}
    config = LlamaConfig(  # type: ignore[call-arg]  # extra keys are kept as config attributes
        vocab_size=workload.codec.size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=workload.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tok.PAD_ID,
        eos_token_id=tok.EOS_ID,
        bos_token_id=None,
        mask_token_id=tok.MASK_ID,
        is_causal=not bidirectional,
        dloom={
            "kind": spec.kind,
            "attention": "bidirectional" if bidirectional else "causal",
            "shift": not bidirectional,
            "gen_length": workload.gen_length,
            **blocks,
            **kernel,
        },
    )
    return config


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

_SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def dllm_from_ar(checkpoint: Path, name: str = "toy-dllm") -> LlamaForCausalLM:
    """A causal zoo checkpoint turned into the initialisation of a masked-diffusion model.

    Dream's recipe (Dream 7B starts from Qwen2.5 7B): the weights are kept, attention becomes
    bidirectional (``is_causal=False``) and the logits stay shifted -- the output at ``i``
    predicts token ``i + 1``, as in the causal model -- so what the causal model learnt
    carries over.  The checkpoint must have the architecture of zoo model ``name``.  A dLLM
    checkpoint made so (``long-dllm``) is taken as it is: a new dLLM trained on from it
    (``long-dllm-par`` from ``long-dllm``).

    :raises ValueError: naming the mismatch, for a checkpoint that is neither a causal nor a
        shifted dLLM zoo checkpoint, or another shape.
    """
    source = LlamaConfig.from_pretrained(checkpoint, local_files_only=True)
    kind = getattr(source, "dloom", {}).get("kind")
    if kind not in ("ar", "dllm"):
        raise ValueError(f"{checkpoint}: expected a zoo checkpoint (dloom kind 'ar' or 'dllm'), got {kind!r}")
    if kind == "dllm" and not source.dloom.get("shift", False):
        raise ValueError(f"{checkpoint}: a dLLM checkpoint to start from must have shifted logits (Dream style)")
    config = build_config(name)
    shape = {k: getattr(config, k) for k in _SHAPE}
    wrong = {k: getattr(source, k) for k in _SHAPE if getattr(source, k) != shape[k]}
    if wrong:
        raise ValueError(f"{checkpoint}: architecture {wrong} differs from {name}'s {shape}")
    config.dloom["shift"] = True
    return LlamaForCausalLM.from_pretrained(checkpoint, config=config, local_files_only=True, dtype=torch.float32)
