"""Model families: the conventions a checkpoint's own config implies, and how dloom calls it.

A :class:`ModelProfile` records what dloom must know about one family of released dLLM
checkpoints (LLaDA, Dream, SDAR, DiffusionGemma) beyond what its ``config.json`` says: the
mask token, the EOS ids, whether logits are shifted by one, the attention kind, the block size
of a block-causal model, whether the checkpoint ships its own modelling code
(``trust_remote_code``) and what its forward accepts. :func:`detect_profile` picks the
profile from the config alone (``model_type``, ``architectures``, ``auto_map``);
:func:`dloom.load_model` uses it for defaults that explicit arguments and the config's
``dloom`` section override.

Remote-code forwards do not all take dloom's ``model(input_ids=, attention_mask=,
position_ids=)`` call. :func:`wrap_forward` puts a :class:`ConventionForward` around such a
model that translates the call (see each profile's ``padding``, ``takes_position_ids``,
``kv_cache`` and ``cache_kwargs``); the translation is pure tensor code, with no host
synchronisation.

The facts below come from the released checkpoints' configs and code (see ``docs/models.md``
for the sources); none was verified against real weights here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from dloom.errors import ModelError

PADDING_MODES = ("2d", "4d", "refuse")


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
    :ivar eos_token_ids: ids that end a generation, added to the config's and tokenizer's.
    :ivar shift_logits: ``True`` when the output at ``i`` predicts token ``i + 1``; ``None``
        leaves it to the config.
    :ivar attention: ``"bidirectional"``, ``"block-causal"`` or ``"causal"``; ``None`` leaves it
        to the config (``is_causal``).
    :ivar block_length: the block size a block-causal model was trained with; the decoder's
        default block length.
    :ivar trust_remote_code: the checkpoint ships its own modelling code.
    :ivar padding: how a left-padded batch reaches the forward: ``"2d"`` a ``(B, L)`` padding
        mask, ``"4d"`` a ``(B, 1, Q, K)`` bool mask, ``"refuse"`` not at all (the forward
        ignores masks or cannot shift positions; padded batches raise :class:`ModelError`).
    :ivar takes_position_ids: the forward accepts ``position_ids``.
    :ivar kv_cache: the forward reads and extends a ``transformers`` cache, so dloom's
        ``prefix`` and ``dual`` cache modes can run.
    :ivar cache_kwargs: extra keyword arguments for a forward that is given a cache.
    :ivar no_mask_value: what the forward is given when no row is padded (``None`` or the
        family's own marker, e.g. Dream's ``"full"``).
    :ivar attn_implementation: attention implementation to load the model with, if the
        family needs one.
    :ivar chat_template: the family's instruct checkpoints expect the tokenizer's chat
        template (``apply_chat_template(messages, add_generation_prompt=True,
        tokenize=False)``, then ordinary tokenisation).
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
    trust_remote_code: bool = False
    padding: str = "2d"
    takes_position_ids: bool = True
    kv_cache: bool = True
    cache_kwargs: tuple[tuple[str, Any], ...] = ()
    no_mask_value: Any = None
    attn_implementation: str | None = None
    chat_template: bool = False
    unsupported: str | None = None

    def __post_init__(self) -> None:
        if self.padding not in PADDING_MODES:
            raise ValueError(f"padding {self.padding!r}; allowed: {', '.join(PADDING_MODES)}")

    @property
    def needs_wrapper(self) -> bool:
        """Whether the forward needs :class:`ConventionForward` to take dloom's call."""
        return (
            self.padding != "2d" or not self.takes_position_ids or bool(self.cache_kwargs)
            or self.no_mask_value is not None
        )

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
    trust_remote_code=True,
    padding="refuse",
    takes_position_ids=False,
    kv_cache=False,
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
    trust_remote_code=True,
    padding="4d",
    no_mask_value="full",
    attn_implementation="sdpa",
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
    trust_remote_code=True,
    padding="4d",
    cache_kwargs=(("store_kv", True),),
    attn_implementation="sdpa",
    chat_template=True,
)

DIFFUSION_GEMMA = ModelProfile(
    name="diffusion-gemma",
    family="DiffusionGemma (transformers' DiffusionGemmaForBlockDiffusion)",
    model_types=("diffusion_gemma", "diffusion_gemma_text"),
    architectures=("DiffusionGemmaForBlockDiffusion",),
    chat_template=True,
    unsupported=(
        "DiffusionGemma is a uniform-noise block diffusion model, not a masked one: it has no "
        "mask token (each canvas starts as random tokens), every denoising step re-predicts "
        "and may renoise every canvas position (commits are not final), each step's forward "
        "takes the previous step's logits as self-conditioning input, and the forward takes "
        "the prompt and the canvas separately (input_ids for the encoder's KV cache, "
        "decoder_input_ids for the canvas). dloom's kernel decodes absorbing-state (masked) "
        "models only; use DiffusionGemmaForBlockDiffusion.generate from transformers "
        "(see docs/models.md)"
    ),
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

#: Families recognised from a config, tried in order.
FAMILIES: tuple[ModelProfile, ...] = (LLADA, DREAM, SDAR, DIFFUSION_GEMMA)


def config_dict(config: Any) -> dict[str, Any]:
    """A config as a plain dict: a mapping, a ``transformers`` config or a directory."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, Path)):
        path = Path(config) / "config.json"
        if not path.exists():
            raise ModelError(f"no config.json in {str(config)!r}")
        return json.loads(path.read_text())
    return config.to_dict()


def detect_profile(config: Any) -> ModelProfile:
    """The profile of a checkpoint, from its config alone.

    A known family (:data:`FAMILIES`) is recognised by ``model_type``, ``architectures`` or
    the ``auto_map`` module names. Otherwise a config without a mask token whose attention
    is not declared bidirectional (``is_causal`` is not ``False``, no ``dloom`` section) is a
    :data:`CAUSAL_LM`; anything else is a :data:`TRANSFORMERS` model whose conventions all
    come from the config.

    :param config: a mapping, a ``transformers`` config or a checkpoint directory.
    """
    values = config_dict(config)
    for profile in FAMILIES:
        if profile.matches(values):
            return profile
    if (
        values.get("mask_token_id") is None
        and values.get("is_causal", True) is not False
        and not values.get("dloom")
    ):
        return CAUSAL_LM
    return TRANSFORMERS


def needs_remote_code(config: Mapping[str, Any], profile: ModelProfile) -> bool:
    """Whether loading the checkpoint runs code shipped with it: a remote-code family, or an
    ``auto_map`` for a ``model_type`` that ``transformers`` does not know."""
    if profile.trust_remote_code:
        return True
    if not config.get("auto_map"):
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return config.get("model_type") not in CONFIG_MAPPING


class ConventionForward(torch.nn.Module):
    """Calls a remote-code model the way its family expects, given dloom's call.

    dloom calls ``model(input_ids=, attention_mask=, position_ids=)`` with ``attention_mask``
    ``None`` (no padding), a ``(B, K)`` padding mask (1 = real token) or a ``(B, 1, Q, K)``
    bool mask (block-causal). This wrapper passes it on per :attr:`profile`:

    - ``padding="2d"``: unchanged; ``"4d"``: a 2-D mask becomes the ``(B, 1, Q, K)`` bool mask
      that hides padded keys; ``"refuse"``: a mask (so a padded batch) raises
      :class:`ModelError`.
    - a float 4-D mask (the additive form :func:`dloom.attention.model_mask` gives eager
      attention) goes back to bool for a ``"4d"`` family, whose forward takes bool masks.
    - ``position_ids`` are dropped when the forward takes none (dloom passes
      ``0 .. L-1`` then, because it never pads such a batch).
    - no mask becomes :attr:`ModelProfile.no_mask_value`.

    :ivar inner: the wrapped model (``adapter.model.inner``).
    """

    def __init__(self, model: torch.nn.Module, profile: ModelProfile) -> None:
        super().__init__()
        self.inner = model
        self.profile = profile

    @property
    def config(self) -> Any:
        return self.inner.config

    def _mask(self, attention_mask: torch.Tensor | None, query_length: int) -> Any:
        profile = self.profile
        if attention_mask is None:
            return profile.no_mask_value
        if profile.padding == "refuse":
            raise ModelError(
                f"the {profile.family} forward ignores attention masks and takes no position "
                "ids, so a left-padded batch would attend to padding and shift positions; "
                "decode prompts of equal token length together, or one at a time "
                "(--batch-size 1)"
            )
        if profile.padding == "2d":
            return attention_mask
        if attention_mask.dim() == 2:
            keys = attention_mask.bool()[:, None, None, :]
            return keys.expand(keys.shape[0], 1, query_length, keys.shape[-1])
        if attention_mask.dtype != torch.bool:
            return attention_mask == 0
        return attention_mask

    def _kwargs(self, input_ids, attention_mask, position_ids) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": self._mask(attention_mask, input_ids.shape[1]),
        }
        if self.profile.takes_position_ids:
            kwargs["position_ids"] = position_ids
        return kwargs

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> Any:
        """The wrapped model's output (with ``.logits``) for dloom's uncached call."""
        return self.inner(**self._kwargs(input_ids, attention_mask, position_ids))


class CachedConventionForward(ConventionForward):
    """:class:`ConventionForward` for a family whose forward reads and extends a KV cache;
    the cache is passed as ``past_key_values`` with the family's :attr:`cache_kwargs`."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
    ) -> Any:
        """The wrapped model's output for dloom's call, with a cache when one is given."""
        kwargs = self._kwargs(input_ids, attention_mask, position_ids)
        if past_key_values is not None:
            kwargs.update(past_key_values=past_key_values, use_cache=use_cache)
            kwargs.update(dict(self.profile.cache_kwargs))
        return self.inner(**kwargs)


def wrap_forward(model: torch.nn.Module, profile: ModelProfile) -> torch.nn.Module:
    """``model`` itself when it takes dloom's call as is, else a :class:`ConventionForward`
    (:class:`CachedConventionForward` when the family supports a KV cache)."""
    if not profile.needs_wrapper:
        return model
    wrapper = CachedConventionForward if profile.kv_cache else ConventionForward
    return wrapper(model, profile).eval()
