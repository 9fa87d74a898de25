"""Model families: the conventions a checkpoint's own config implies.

A :class:`ModelProfile` records what dloom must know about one family of released dLLM
checkpoints (LLaDA, Dream, SDAR, SDAR-MoE, Fast-dLLM v2, LLaDA2.x, ...) beyond what its ``config.json`` says: the
mask token, the EOS ids, whether logits are shifted by one, the attention kind, where a
block-causal model's block size is written and how its blocks are laid out.
:func:`dloom.load_model` uses the profile of the checkpoint's family for defaults that
explicit arguments and the checkpoint's own files override, and loads the known families
onto ``transformers``' own classes (:mod:`dloom.model.checkpoints`), never running their
code. A family is a profile and its layout, registered through the
``dloom_register_families`` hook (:mod:`dloom.model.families`; the built-in ones below in
:mod:`dloom.model.builtin_families`), and recognised from the config alone
(``model_type``, ``architectures``, ``auto_map``) by :meth:`dloom.model.families.FamilyTable.detect`.

The facts below come from the released checkpoints' configs and code (``docs/models.md``
cites the sources) and are checked against the published code on tiny checkpoints in the
real format (``tests/model/test_real_families.py``); none was run on real weights here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dloom.model.config_limits import BLOCK_ALIGNMENTS, check_config


@dataclass(frozen=True)
class ModelProfile:
    """The conventions of one model family.

    :ivar name: short name (``"llada"``), recorded on the adapter.
    :ivar family: human-readable family name.
    :ivar model_types: lower-case ``model_type`` values that identify the family.
    :ivar architectures: ``architectures`` entries that identify it.
    :ivar code_modules: remote-code module names (``auto_map`` targets ``module.Class``) that
        identify it.
    :ivar mask_token_id: the family's mask id, used when neither the config nor the tokenizer
        declares one.
    :ivar mask_token: the mask token's text, looked up in the tokenizer's vocabulary before
        falling back to ``mask_token_id``.
    :ivar eos_token_ids: ids that end a generation, added to the checkpoint's own.
    :ivar shift_logits: ``True`` when the output at ``i`` predicts token ``i + 1``; ``None``
        leaves it to the config.
    :ivar attention: ``"bidirectional"``, ``"block-causal"`` or ``"causal"``; ``None`` leaves it
        to the config (``is_causal``).
    :ivar block_length: the block size a block-causal model was trained with, when its config
        does not say.
    :ivar block_size_key: the config key that holds the trained block size (``block_size``,
        ``bd_size``); it overrides :attr:`block_length`.
    :ivar block_alignment: ``"prompt"`` (generated blocks start after the prompt) or
        ``"absolute"`` (block boundaries at multiples of the block size from each row's
        position 0, prompt included, as block-diffusion models are trained).
    :ivar ships_code: the released checkpoint ships its own modelling code (``auto_map``);
        dloom loads it onto a native class instead (:mod:`dloom.model.checkpoints`).
    :ivar chat_template: the family's instruct checkpoints expect the tokenizer's chat
        template (``apply_chat_template(messages, add_generation_prompt=True,
        tokenize=False)``, then ordinary tokenisation).
    :ivar kernel: the transition kernel the family decodes with (a name in
        :data:`dloom.decode.transition.KERNELS`): ``"absorbing"`` for masked-diffusion
        models, whose committed tokens are final.
    :ivar model_class: the ``transformers`` class the family loads onto when its config's
        auto class is not a causal LM (``"DiffusionGemmaForBlockDiffusion"``), or ``None``.
    :ivar unsupported: why dloom cannot decode the family, or ``None``.
    """

    name: str
    family: str
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    code_modules: tuple[str, ...] = ()
    mask_token_id: int | None = None
    mask_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    shift_logits: bool | None = None
    attention: str | None = None
    block_length: int | None = None
    block_size_key: str | None = None
    block_alignment: str = "prompt"
    ships_code: bool = False
    chat_template: bool = False
    kernel: str = "absorbing"
    model_class: str | None = None
    unsupported: str | None = None

    def __post_init__(self) -> None:
        if self.block_alignment not in BLOCK_ALIGNMENTS:
            raise ValueError(
                f"block_alignment {self.block_alignment!r}; allowed: {', '.join(BLOCK_ALIGNMENTS)}"
            )

    @property
    def has_mask_token(self) -> bool:
        """Whether the family's models have a mask token: all but those of the uniform-noise
        kernel, whose canvases start as random tokens."""
        return self.kernel != "uniform"

    def matches(self, config: Mapping[str, Any]) -> bool:
        """Whether a config (as a dict) belongs to this family."""
        model_type = str(config.get("model_type") or "").lower()
        if model_type in self.model_types:
            return True
        if any(a in self.architectures for a in config.get("architectures") or ()):
            return True
        targets = (config.get("auto_map") or {}).values()
        modules = {str(t).split("--")[-1].split(".")[0] for t in targets if isinstance(t, str)}
        return bool(modules & set(self.code_modules))

    def trained_block_length(self, config: Mapping[str, Any]) -> int | None:
        """The block size the checkpoint was trained with: its config's
        :attr:`block_size_key`, else :attr:`block_length`."""
        if self.block_size_key is not None and config.get(self.block_size_key) is not None:
            return int(config[self.block_size_key])
        return self.block_length


LLADA = ModelProfile(
    name="llada",
    family="LLaDA (GSAI-ML LLaDA-8B-Base / -Instruct, LLaDA-1.5)",
    model_types=("llada",),
    architectures=("LLaDAModelLM",),
    code_modules=("modeling_llada", "configuration_llada"),
    mask_token_id=126336,
    mask_token="<|mdm_mask|>",
    eos_token_ids=(126081, 126348),  # <|endoftext|>, <|eot_id|>
    shift_logits=False,
    attention="bidirectional",
    ships_code=True,
    chat_template=True,
)

DREAM = ModelProfile(
    name="dream",
    family="Dream (Dream-org Dream-v0-Base-7B / -Instruct-7B)",
    model_types=("dream",),
    architectures=("DreamModel",),
    code_modules=("modeling_dream", "configuration_dream"),
    mask_token_id=151666,
    mask_token="<|mask|>",
    eos_token_ids=(151643,),  # <|endoftext|>
    shift_logits=True,
    attention="bidirectional",
    ships_code=True,
    chat_template=True,
)

SDAR = ModelProfile(
    name="sdar",
    family="SDAR (JetAstra SDAR-*-Chat)",
    model_types=("sdar",),
    architectures=("SDARForCausalLM",),
    code_modules=("modeling_sdar", "configuration_sdar"),
    mask_token="<|MASK|>",
    shift_logits=False,
    attention="block-causal",
    block_length=4,
    block_size_key="block_size",
    block_alignment="absolute",
    ships_code=True,
    chat_template=True,
)

SDAR_MOE = replace(  # SDAR's conventions on a Qwen3-MoE network
    SDAR,
    name="sdar-moe",
    family="SDAR-MoE (JetLM SDAR-30B-A3B-Chat / -Sci, Qwen3-30B-A3B block diffusion)",
    model_types=("sdar_moe",),
    architectures=("SDARMoeForCausalLM",),
    code_modules=("modeling_sdar_moe", "configuration_sdar_moe"),
)

FAST_DLLM_V2 = ModelProfile(
    name="fast-dllm-v2",
    family="Fast-dLLM v2 (NVlabs / Efficient-Large-Model Fast_dLLM_v2_7B, Qwen2.5 block diffusion)",
    model_types=("fast_dllm_qwen",),
    architectures=("Fast_dLLM_QwenForCausalLM",),
    mask_token_id=151665,
    mask_token="|<MASK>|",
    eos_token_ids=(151645,),  # <|im_end|>, the stop token of its generate
    shift_logits=True,
    attention="block-causal",
    block_length=32,
    block_size_key="bd_size",
    block_alignment="absolute",
    ships_code=True,
    chat_template=True,
)

LLADA2 = ModelProfile(
    name="llada2",
    family="LLaDA2.0 / LLaDA2.1 (inclusionAI LLaDA2.x-mini / -flash, a BailingMoeV2 MoE)",
    model_types=("llada2_moe", "dloom_bailing_moe_v2"),  # the released config, dloom's saved one
    architectures=("LLaDA2MoeModelLM",),
    code_modules=("modeling_llada2_moe", "configuration_llada2_moe"),
    mask_token_id=156895,  # <|mask|>
    mask_token="<|mask|>",
    eos_token_ids=(156892,),  # <|endoftext|>
    shift_logits=False,
    attention="block-causal",
    block_length=32,  # its generate()'s default
    block_alignment="absolute",  # generate() aligns its block mask at position 0
    ships_code=True,
    chat_template=True,
    kernel="revisable",  # LLaDA2.1 edits filled tokens (joint_threshold); fill rules decode as on "absorbing"
)

DIFFUSION_GEMMA = ModelProfile(
    name="diffusion-gemma",
    family="DiffusionGemma (transformers' DiffusionGemmaForBlockDiffusion)",
    model_types=("diffusion_gemma", "diffusion_gemma_text"),
    architectures=("DiffusionGemmaForBlockDiffusion",),
    model_class="DiffusionGemmaForBlockDiffusion",  # transformers' own; the prompt to its encoder, the canvas to its decoder
    eos_token_ids=(1,),  # <eos>
    attention="block-causal",  # a causal prefix (the encoder's cache), a bidirectional canvas
    block_size_key="canvas_length",
    chat_template=True,
    kernel="uniform",  # no mask token: canvases start as random tokens and are renoised
)

CAUSAL_LM = ModelProfile(
    name="causal-lm",
    family="causal language model (e.g. Qwen2.5-Instruct), an autoregressive target",
    shift_logits=True,
    attention="causal",
    chat_template=True,
)

TRANSFORMERS = ModelProfile(
    name="transformers",
    family="native transformers model (conventions from its config, e.g. the toy zoo)",
)


def config_dict(config: Any) -> dict[str, Any]:
    """A config as a plain dict: a mapping, a ``transformers`` config or a directory (whose
    ``config.json`` is read and checked by :func:`dloom.model.config_limits.check_config`)."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, Path)):
        return check_config(Path(config))
    return config.to_dict()
