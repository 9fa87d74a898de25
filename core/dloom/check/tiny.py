"""Tiny random models generated on the fly from a seed, for checks and plugin authors' tests.

Token ids follow the toy zoo: ``0`` pad, ``1`` mask, ``2`` EOS, ``3 ..`` plain tokens. The
models are ``transformers`` ``LlamaForCausalLM`` in float64 with random weights drawn from
``initializer_range`` 0.3 by default: logits have a spread of about
``sqrt(hidden) * initializer_range``, so with ``hidden = 16`` the distributions are far from
uniform and far from one-hot (confidences spread over (0, 1), every output has visible
probability), and the context matters enough that committing positions in a different order
or together changes the output distribution visibly.

* :func:`tiny_dllm`: bidirectional (``is_causal=False``), a masked-diffusion model.
* :func:`tiny_revisable_dllm`: the same weights decoding like LLaDA2.x: block-causal
  attention, blocks aligned at position 0 (the prompt's tail shares the first block with
  generated positions) and the revisable transition kernel.
* :func:`tiny_uniform_dllm`: a uniform-noise model decoding like DiffusionGemma (no mask
  token, transformers' ``DiffusionGemmaForBlockDiffusion``, the ``"uniform"`` kernel).
* :func:`tiny_ar`: causal, no mask token, next-token logits (an AR target).
* :func:`tiny_prompts`: random prompts of plain tokens.
* :func:`zoo_installed`: whether the toy zoo's trained models, which the greedy checks prefer
  to these, are there.

A model with ``vocab <= 8`` and ``gen_length <= 4`` is small enough for
:func:`dloom.check.enumerate.exact_distribution`.
"""

from __future__ import annotations

import dataclasses

import torch

from dloom.model.adapter import ModelAdapter

PAD_ID = 0
MASK_ID = 1
EOS_ID = 2
FIRST_PLAIN_ID = 3
DEFAULT_GEN_LENGTH = 8


def _llama(seed: int, vocab: int, hidden: int, layers: int, init: float, causal: bool, context: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    if vocab <= FIRST_PLAIN_ID:
        raise ValueError(f"vocab is {vocab}; allowed: at least {FIRST_PLAIN_ID + 1} (pad, mask, eos, a token)")
    config = LlamaConfig(  # type: ignore[call-arg]  # extra keys are kept as config attributes
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=context, initializer_range=init, is_causal=causal,
        mask_token_id=None if causal else MASK_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval().to(torch.float64)
    finally:
        torch.random.set_rng_state(state)


def tiny_dllm(
    seed: int = 0, vocab: int = 6, hidden: int = 16, layers: int = 1, init: float = 0.3,
    context: int = 32,
) -> ModelAdapter:
    """A float64 bidirectional dLLM with random weights (mask 1, EOS 2, pad 0); decoders
    default to ``gen_length`` 8 on it. The global torch random state is left as it was."""
    model = _llama(seed, vocab, hidden, layers, init, causal=False, context=context)
    return ModelAdapter(
        model, mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        attention="bidirectional", max_context=context, name=f"tiny-dllm(seed={seed}, vocab={vocab})",
        default_gen_length=DEFAULT_GEN_LENGTH,
    )


def tiny_revisable_dllm(
    seed: int = 0, vocab: int = 6, hidden: int = 16, layers: int = 1, init: float = 0.3,
    context: int = 32,
) -> ModelAdapter:
    """:func:`tiny_dllm` decoding as LLaDA2.x does: ``attention="block-causal"``,
    ``block_alignment="absolute"`` and the ``"revisable"`` kernel
    (:mod:`dloom.decode.revisable`), so that editing rules run on it and a prompt whose
    length is not a multiple of the block length puts prompt positions in the first block."""
    return dataclasses.replace(
        tiny_dllm(seed, vocab, hidden, layers, init, context), attention="block-causal",
        block_alignment="absolute", kernel="revisable", name=f"tiny-revisable-dllm(seed={seed}, vocab={vocab})",
    )


def tiny_uniform_dllm(
    seed: int = 0, vocab: int = 16, hidden: int = 16, canvas: int = 4, steps: int = 4, init: float = 0.8,
    context: int = 64,
) -> ModelAdapter:
    """A float32 DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``: a causal
    encoder for the prompt, a bidirectional decoder for the canvas, a mixture of experts,
    which runs in float32 at the least) with random weights decoding on the ``"uniform"``
    kernel (:mod:`dloom.decode.uniform`): canvases of ``canvas`` positions, at most ``steps``
    denoising steps each (``max_denoising_steps``), no mask token (EOS 2, pad 0, the
    placeholder of positions not yet final). The global torch random state is left as it was."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    if vocab <= FIRST_PLAIN_ID:
        raise ValueError(f"vocab is {vocab}; allowed: at least {FIRST_PLAIN_ID + 1} (pad, mask, eos, a token)")
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": hidden // 2}
    text = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": hidden,
        "num_experts": 4, "top_k_experts": 2, "num_hidden_layers": 2, "sliding_window": 2 * canvas,
        "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": context,
        "initializer_range": init, "pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "bos_token_id": FIRST_PLAIN_ID,
        **heads,
    }
    vision = {  # unused by text prompts; as small as the class allows
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 1, "patch_size": 4,
        "pooling_kernel_size": 3, "position_embedding_size": context, **heads,
    }
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas, initializer_range=init)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config).eval().to(torch.float32)
    finally:
        torch.random.set_rng_state(state)
    return ModelAdapter(
        model, mask_token_id=None, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID, attention="block-causal",
        max_context=context, name=f"tiny-uniform-dllm(seed={seed}, vocab={vocab})", default_gen_length=2 * canvas,
        default_block_length=canvas, kernel="uniform", generation={"max_denoising_steps": steps},
    )


def tiny_ar(
    seed: int = 0, vocab: int = 6, hidden: int = 16, layers: int = 1, init: float = 0.3,
    context: int = 32,
) -> ModelAdapter:
    """A float64 causal next-token model with random weights (no mask token; EOS 2, pad 0)."""
    model = _llama(seed, vocab, hidden, layers, init, causal=True, context=context)
    return ModelAdapter(
        model, mask_token_id=None, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        shift_logits=True, attention="causal", max_context=context,
        name=f"tiny-ar(seed={seed}, vocab={vocab})",
    )


def tiny_prompts(count: int, vocab: int = 6, length: int = 3, seed: int = 0) -> list[list[int]]:
    """``count`` random prompts of ``length`` plain tokens (ids ``3 .. vocab - 1``)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_PLAIN_ID, vocab, (count, length), generator=generator)
    return ids.tolist()


def zoo_installed(*names: str) -> bool:
    """Whether the weights of every toy zoo model ``names`` are installed."""
    from dloom import zoo

    return all((zoo.model_path(name) / "model.safetensors").exists() for name in names)
