"""Model adapters: what the decoder needs to know about a Hugging Face model.

A :class:`ModelAdapter` wraps any ``transformers`` model that returns logits and records the
conventions a decoder depends on: the mask token, the EOS ids, whether logits are shifted by
one (Dream-style: the output at position ``i`` predicts token ``i + 1``), the attention kind
and the context length. :func:`load_model` builds one from a local directory or a toy-zoo
name; it never downloads anything. The defaults of a known family (LLaDA, Dream, SDAR, ...)
come from its :class:`dloom.model.profiles.ModelProfile`, recognised from the config alone.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dloom.errors import ModelError
from dloom.model.checkpoints import NativeLayout, native_config
from dloom.model.config_limits import (
    ATTENTION_KINDS,
    BLOCK_ALIGNMENTS,
    check_size_against_weights,
    check_token_ids,
    vocabulary_size,
)
from dloom.model.families import needs_remote_code
from dloom.model.files import check_model_files, tensor_headers
from dloom.model.json_files import MAX_TOKENIZER_BYTES, read_json, read_json_object
from dloom.model.profiles import ModelProfile, config_dict
from dloom.model.tensor_check import check_tensors

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` positions that ignore left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def padding_or_none(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """``attention_mask`` if some position is padding, else ``None`` (a model then needs no
    mask). One host read: call it when a batch is laid out, not per step."""
    return attention_mask if bool((attention_mask == 0).any()) else None


def output_logits(out: Any) -> torch.Tensor:
    """The logits of a model's forward output: ``out.logits``, or the first element of a
    tuple output (models without a ``transformers`` output class)."""
    return out.logits if hasattr(out, "logits") else out[0]


def left_pad_prompts(
    model: ModelAdapter, prompts: Any, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(B, P)`` prompt ids and their ``(B, P)`` padding mask on the model's device.

    :param prompts: texts (encoded with the model's tokenizer), token-id lists, or a
        ``(B, P)`` tensor of left-padded ids with its ``attention_mask``.
    :raises ModelError: for no prompts, an empty prompt or a tensor that is not 2-D.
    """
    device = model.device
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ModelError(f"prompt tensor must be (B, P); got shape {tuple(prompts.shape)}")
        ids = prompts.to(device=device, dtype=torch.long)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(device).long()
        return ids, mask
    if len(prompts) == 0:
        raise ModelError("no prompts given")
    rows = (
        model.encode(prompts) if isinstance(prompts[0], str) else [list(map(int, p)) for p in prompts]
    )
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise ModelError(f"prompt {empty[0]} is empty; every prompt needs at least one token")
    width = max(len(r) for r in rows)
    pad = model.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids.to(device), mask.to(device)


@dataclass
class ModelAdapter:
    """A model plus the conventions needed to decode with it.

    :ivar model: the ``torch.nn.Module``; called (by :meth:`raw_logits` alone) as
        ``model(input_ids=, attention_mask=, position_ids=)`` and expected to return an
        object with ``.logits`` ``(B, L, V)`` or a tuple whose first element they are.
    :ivar mask_token_id: id of the mask token, or ``None`` for a model without one (an AR
        target).
    :ivar eos_token_ids: ids that end a generation.
    :ivar pad_token_id: id used for left padding.
    :ivar shift_logits: ``True`` when the output at ``i`` predicts token ``i + 1``.
    :ivar attention: one of :data:`ATTENTION_KINDS`.
    :ivar max_context: the longest sequence the model accepts, or ``None`` if unknown.
    :ivar tokenizer: the model's tokenizer, if one was found.
    :ivar name: where the model came from (a zoo name or a path).
    :ivar default_gen_length: the generation length the checkpoint recommends, if any.
    :ivar default_block_length: the block length the model was trained with (block-causal
        models), the decoder's default.
    :ivar block_alignment: where a block-causal model's blocks start: ``"prompt"``
        (generated blocks start after the prompt, which is one block) or ``"absolute"``
        (boundaries at multiples of the block length from each row's position 0, prompt
        included, so the prompt's last partial block is decoded with the first generated
        positions: SDAR, Fast-dLLM v2).
    :ivar can_pad: whether the forward honours a padding mask, so that left-padded batches
        can be decoded (every model ``load_model`` returns does; ``False`` for a hand-wrapped
        forward that ignores masks).
    :ivar profile: name of the model family's :class:`dloom.model.profiles.ModelProfile`.
    :ivar kernel: the transition kernel the model decodes with (its profile's; a name in
        :data:`dloom.decode.transition.KERNELS`).
    :ivar generation: the checkpoint's ``generation_config.json`` (``{}`` without one): the
        uniform kernel's schedule and step budget (:class:`dloom.decode.uniform.UniformSettings`).
    """

    model: torch.nn.Module
    mask_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    shift_logits: bool = False
    attention: str = "bidirectional"
    max_context: int | None = None
    tokenizer: Any = None
    name: str = "model"
    default_gen_length: int | None = None
    default_block_length: int | None = None
    block_alignment: str = "prompt"
    can_pad: bool = True
    profile: str = "transformers"
    kernel: str = "absorbing"
    generation: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ModelError(
                f"attention kind {self.attention!r} is not supported; allowed: "
                + ", ".join(ATTENTION_KINDS)
            )
        if self.block_alignment not in BLOCK_ALIGNMENTS:
            raise ModelError(
                f"block_alignment {self.block_alignment!r} is not supported; allowed: "
                + ", ".join(BLOCK_ALIGNMENTS)
            )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @functools.cached_property
    def _forward_parameters(self) -> frozenset[str]:
        return frozenset(inspect.signature(self.model.forward).parameters)

    @property
    def shift(self) -> int:
        """1 when the output at column ``i`` predicts token ``i + 1`` (``shift_logits``), else
        0: the offset between a column and the raw output that predicts it."""
        return int(self.shift_logits)

    @property
    def cache_argument(self) -> str | None:
        """The name under which the model's forward takes a ``transformers`` KV cache
        (``cache`` in ``transformers`` 5, ``past_key_values`` in older and remote-code
        models), or ``None`` when it takes none."""
        for name in ("cache", "past_key_values"):
            if name in self._forward_parameters:
                return name
        return None

    def check_takes_cache(self) -> str:
        """The forward's cache argument (:attr:`cache_argument`).

        :raises ModelError: when the model's forward takes no ``transformers`` KV cache.
        """
        if self.cache_argument is None:
            raise ModelError(f"model {self.name!r} does not take a KV cache; use cache='none'")
        return self.cache_argument

    @property
    def takes_logits_to_keep(self) -> bool:
        """Whether the forward takes ``logits_to_keep`` (then :meth:`raw_logits` computes the
        head only on the kept columns)."""
        return "logits_to_keep" in self._forward_parameters

    def raw_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        cache: Any = None,
        logits_to_keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's outputs of one forward, without gradient, as the model aligns them:
        the only place dloom calls a model.

        :param input_ids: ``(B, Q)`` long.
        :param attention_mask: ``(B, Q)`` or ``(B, C)`` padding mask, a 4-D mask
            (:func:`dloom.model.attention.model_mask`), or ``None``.
        :param position_ids: ``(B, Q)`` long, or ``None`` (the model's own).
        :param cache: a ``transformers`` cache the forward reads and extends (passed under
            :attr:`cache_argument`, with ``use_cache=True``), or ``None``: the forward then
            asks for no cache where the model takes the flag (``transformers``' models
            otherwise fill a cache nothing reads).
        :param logits_to_keep: ``(Q',)`` long columns whose outputs to compute; ignored by a
            model that does not take it (:attr:`takes_logits_to_keep`).
        :return: ``(B, Q, V)``, or ``(B, Q', V)`` with kept columns: at column ``i`` the
            distribution of token ``i + shift``.
        :raises ModelError: for a cache given to a model whose forward takes none.
        """
        kwargs: dict[str, Any] = {}
        if cache is not None:
            kwargs = {"use_cache": True, self.check_takes_cache(): cache}
        elif "use_cache" in self._forward_parameters:
            kwargs["use_cache"] = False
        if logits_to_keep is not None and self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        with torch.no_grad():
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
            )
        return output_logits(out)

    def canvas_logits(
        self,
        prefix: torch.Tensor,
        prefix_mask: torch.Tensor,
        canvas: torch.Tensor,
        self_conditioning: torch.Tensor | None = None,
        conditioned: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The canvas logits of one forward of an encoder-prefix/canvas model (DiffusionGemma),
        without gradient: the encoder writes the prefix into a fresh cache, the decoder reads it
        and the canvas. With :meth:`raw_logits`, the only places dloom calls a model.

        Positions ignore left padding (:func:`position_ids_from_mask`): the canvas follows each
        row's last real prefix token.

        :param prefix: ``(B, P)`` long, every row's prompt and finished canvases, left-padded.
        :param prefix_mask: ``(B, P)`` padding mask (1 = real token).
        :param canvas: ``(B, C)`` long, the canvas being denoised.
        :param self_conditioning: ``(B, C, V)`` float, the previous step's processed logits of
            each row, or ``None`` on a canvas's first step (no self-conditioning signal).
        :param conditioned: ``(B,)`` bool, the rows ``self_conditioning`` is given for (the
            others get no signal, exactly as with ``None``); ``None``: every row.
        :return: ``(B, C, V)`` float32 logits (after the model's soft-capping).
        """
        from transformers import DynamicCache

        text_config = self.model.config.get_text_config(decoder=True)  # type: ignore[union-attr, operator]
        positions = position_ids_from_mask(prefix_mask)
        lengths = prefix_mask.long().sum(-1, keepdim=True)
        canvas_positions = lengths + torch.arange(canvas.shape[1], device=canvas.device)
        mask = prefix_mask.bool()
        with torch.no_grad():
            out = self.model(
                input_ids=prefix, attention_mask=mask, position_ids=positions,
                decoder_input_ids=canvas, decoder_position_ids=canvas_positions,
                decoder_attention_mask=torch.nn.functional.pad(mask, (0, canvas.shape[1]), value=True),
                self_conditioning_logits=self_conditioning, self_conditioning_mask=conditioned,
                cache=DynamicCache(config=text_config),
            )
        return output_logits(out)

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits aligned so that ``logits[:, i]`` is the distribution of token ``i``.

        :param input_ids: ``(B, L)`` long.
        :param attention_mask: ``(B, L)`` padding mask (1 = real token) or ``None`` when no
            row is padded.
        :param position_ids: ``(B, L)`` long; derived from ``attention_mask`` when omitted.
        :return: ``(B, L, V)`` logits in the model's dtype. For a shifted model position 0
            repeats the first output (it is never a generated position).
        """
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_from_mask(attention_mask)
        logits = self.raw_logits(input_ids, attention_mask, position_ids)
        if self.shift:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits

    @property
    def tokenizer_sha256(self) -> str | None:
        """SHA-256 of the tokenizer's vocabulary (token -> id, sorted), or ``None`` without
        a tokenizer: two models can share drafts only when these agree."""
        if self.tokenizer is None:
            return None
        if "tokenizer_sha256" not in self.extra:
            vocab = sorted(self.tokenizer.get_vocab().items())
            digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
            self.extra["tokenizer_sha256"] = digest
        return self.extra["tokenizer_sha256"]

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt with the tokenizer's default special tokens."""
        if self.tokenizer is None:
            raise ModelError(
                f"model {self.name!r} has no tokenizer; pass token ids instead of text"
            )
        return [list(self.tokenizer(p)["input_ids"]) for p in prompts]

    def chat_prompts(self, prompts: Sequence[str]) -> list[str]:
        """Each prompt as a single user turn in the tokenizer's chat template, ready for the
        assistant's reply (``apply_chat_template(..., add_generation_prompt=True,
        tokenize=False)``, as LLaDA's and Dream's instruct examples do); encode the result
        as any text prompt.

        :raises ModelError: without a tokenizer or a chat template, or as
            :meth:`render_chat`.
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ModelError(
                f"model {self.name!r} has no tokenizer chat template; drop --chat or give the "
                "checkpoint a tokenizer_config.json with a chat_template"
            )
        return [self.render_chat([{"role": "user", "content": p}]) for p in prompts]

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        """The conversation ``messages`` (``{"role", "content"}`` each) in the tokenizer's
        chat template, ready for the assistant's reply; the one place the CLI and the server
        apply a template.

        :raises ModelError: in one line, when the template raises: its own refusal
            (``raise_exception``), a syntax error, or an operation its sandbox forbids.
        """
        try:
            return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        except Exception as error:  # noqa: BLE001 - any error of a template is the checkpoint's or the caller's
            reason = " ".join(str(error).split()) or type(error).__name__
            raise ModelError(f"the model's chat template refused the conversation: {reason}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens ('' when no tokenizer is known)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _resolve_path(name_or_path: str | os.PathLike) -> tuple[Path, str]:
    from dloom import zoo

    text = str(name_or_path)
    if text in zoo.MODEL_NAMES:
        return zoo.locate(text), text
    path = Path(text).expanduser()
    if path.is_dir():
        return path, str(path)
    raise ModelError(
        f"no model directory at {text!r}, and it is not a toy-zoo name "
        f"({', '.join(zoo.MODEL_NAMES)}); dloom loads local checkpoints only"
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _mask_from_tokenizer(tokenizer: Any, profile: ModelProfile) -> int | None:
    """The tokenizer's mask token, or the family's mask token text if the vocabulary has it."""
    if tokenizer is None:
        return None
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if profile.mask_token is not None:
        found = tokenizer.get_vocab().get(profile.mask_token)
        if found is not None:
            return int(found)
    return None


def _generation_config(path: Path, vocab: int | None) -> dict[str, Any]:
    """The checkpoint's ``generation_config.json`` as a dict (``{}`` without one), its
    token ids checked (inside a vocabulary of ``vocab`` tokens, when known).

    :raises ModelError: when the file is not a JSON object, or an id is not one.
    """
    file = path / "generation_config.json"
    if not file.exists():
        return {}
    values = read_json_object(file)
    check_token_ids(values, repr(str(file)), vocab=vocab)
    return values


def _eos_ids(
    raw: dict[str, Any], generation: dict[str, Any], tokenizer: Any, profile: ModelProfile
) -> tuple[int, ...]:
    """EOS ids, first seen first: ``config.json``, ``generation_config.json`` (SDAR's and
    Qwen's instruct stop token ``<|im_end|>`` is only there), the tokenizer, the profile."""
    eos = _as_ids(raw.get("eos_token_id")) + _as_ids(generation.get("eos_token_id"))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos += (int(tokenizer.eos_token_id),)
    return tuple(dict.fromkeys(eos + profile.eos_token_ids))


def _load_network(
    path: Path, raw: dict[str, Any], profile: ModelProfile, layout: NativeLayout | None,
    model_kwargs: dict[str, Any],
) -> tuple[Any, torch.nn.Module]:
    """The checkpoint's config and model: onto the family's native class when its family
    has a ``layout`` (no remote code), onto the ``transformers`` class its profile names
    (:attr:`~dloom.model.profiles.ModelProfile.model_class`), else as ``transformers`` loads it. Before any weight
    is read, the config's size is checked against the bytes
    of its tensors (:func:`dloom.model.config_limits.check_size_against_weights`) and the
    tensors' names, shapes and dtypes against the model built from it on the ``meta``
    device (:func:`dloom.model.tensor_check.check_tensors`); only a checkpoint that runs its own
    modelling code (``auto_map`` with ``trust_remote_code``) is loaded unchecked."""
    import transformers

    where = repr(str(path / "config.json"))
    if layout is not None:
        config = native_config(layout, raw)
        described = f"the {layout.family} layout (native {layout.model_type})"
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(
                path, local_files_only=True, trust_remote_code=model_kwargs["trust_remote_code"]
            )
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ModelError(f"{where} is no config transformers can build a model from: {error}") from None
        described = f"the {config.model_type} model transformers builds from {where}"
    if not (model_kwargs["trust_remote_code"] and raw.get("auto_map")):  # not its own code
        headers = tensor_headers(path)
        check_size_against_weights(config, sum(h.nbytes for h in headers.values()), where)
        check_tensors(
            config, headers, described, layout.key_mapping if layout is not None else None, profile.model_class
        )
    if layout is not None:
        kwargs = {**model_kwargs, "trust_remote_code": False, "config": config}
        if layout.key_mapping:
            kwargs["key_mapping"] = layout.key_mapping
        return config, transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if profile.model_class is not None:
        return config, getattr(transformers, profile.model_class).from_pretrained(path, **model_kwargs)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **model_kwargs)
    except ValueError:
        model = transformers.AutoModel.from_pretrained(path, **model_kwargs)
    return config, model


#: The tokenizer files ``transformers`` reads as JSON, checked first with dloom's bounded reader.
TOKENIZER_JSON_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "chat_template.json",
)


def _tokenizer_at(path: Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of checkpoint directory ``path``; ``None`` when it has no tokenizer files.

    :raises ModelError: naming the file for a tokenizer file that is not JSON (or too large
        or deep), and the directory for one ``transformers`` cannot build a tokenizer from.
    """
    import transformers

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    for name in TOKENIZER_JSON_FILES:
        if (path / name).exists():
            read_json(path / name, max_bytes=MAX_TOKENIZER_BYTES)
    try:
        return transformers.AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises bare Exception
        raise ModelError(
            f"the tokenizer files in {str(path)!r} do not make a tokenizer: "
            f"{type(error).__name__}: {str(error)[:300]}"
        ) from None


def load_tokenizer(name_or_path: str | os.PathLike) -> Any:
    """The tokenizer of a local checkpoint directory or toy-zoo name, without loading its
    weights (never its own code); ``None`` when the checkpoint has no tokenizer files.

    :raises ModelError: for a missing directory that is not a toy-zoo name.
    """
    path, _ = _resolve_path(name_or_path)
    return _tokenizer_at(path)


def load_model(
    name_or_path: str | os.PathLike,
    *,
    mask_token_id: int | None = None,
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    shift_logits: bool | None = None,
    attention: str | None = None,
    require_mask: bool = True,
    device_map: str | dict[str, Any] | None = None,
) -> ModelAdapter:
    """Load a model and its tokenizer from a local directory or a toy-zoo name.

    The model's family is recognised from its ``config.json`` among the registered families
    (:meth:`dloom.model.families.FamilyTable.detect`; plugins add families through
    ``dloom_register_families``). A known family (LLaDA, Dream, SDAR, SDAR-MoE, Fast-dLLM v2, or a
    plugin's with a layout) is loaded onto ``transformers``' own class with its config and
    tensor names translated (its :class:`~dloom.model.checkpoints.NativeLayout`), LLaDA2.x
    onto dloom's own BailingMoeV2 class (:mod:`dloom.model.bailing`); its ``.py``
    files are never imported, whatever
    ``trust_remote_code`` says. Conventions come from, in order: the arguments, the config's
    ``dloom`` section (``mask_token_id``, ``eos_token_ids``, ``shift``, ``attention``,
    ``block_length``, ``block_alignment``, ``gen_length``), the config's own fields
    (``mask_token_id``, ``eos_token_id``, ``is_causal``, the family's block-size key), the
    tokenizer (``mask_token``, ``eos_token``) and last the family's profile. EOS ids from the
    config, ``generation_config.json``, the tokenizer and the profile are all kept (unless
    the ``dloom`` section lists them).

    :param mask_token_id: overrides every other source of the mask token.
    :param trust_remote_code: allow the modelling code of a checkpoint from a family dloom
        does not know (only when asked).
    :param dtype: a name from :data:`DTYPES` or a ``torch.dtype``.
    :param require_mask: raise when no mask token is found (dLLMs); ``False`` for AR models.
        Never for a uniform-noise family (DiffusionGemma), which has none.
    :param device_map: passed to ``from_pretrained`` (e.g. ``"auto"`` to spread a large model
        over the visible GPUs); ``device`` is then ignored.
    :raises ModelError: for a missing directory, an unknown dtype, no mask token, an
        unknown checkpoint with its own code without ``trust_remote_code``, a config value
        with no native equivalent, or a family dloom cannot decode (a profile's ``unsupported``).
    """
    check_model_files(name_or_path, device, device_map, trust_remote_code)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    path, name = _resolve_path(name_or_path)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ModelError(f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    from dloom.hooks.registry import get_registry

    raw = config_dict(path)
    family = get_registry().families.detect(raw)
    profile = family.profile
    if profile.unsupported:
        raise ModelError(f"model {name!r} is {profile.family}; {profile.unsupported}")
    if needs_remote_code(raw, family) and not trust_remote_code:
        raise ModelError(
            f"model {name!r} (model_type {raw.get('model_type')!r}) ships its own modelling "
            "code (auto_map in config.json) and is no family dloom knows; dloom never runs it "
            "unless asked: read the .py files in the checkpoint, then pass --trust-remote-code "
            "(trust_remote_code=True)"
        )
    remote = trust_remote_code and family.layout is None
    model_kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True, "trust_remote_code": remote}
    if device_map is not None:
        if not transformers.utils.is_accelerate_available():
            raise ModelError(
                f"device_map={device_map!r} needs the accelerate package (pip install "
                "accelerate); or load on one device with --device"
            )
        model_kwargs["device_map"] = device_map
    # every JSON file is read (bounded) before the network is built
    generation = _generation_config(path, vocabulary_size(raw))
    tokenizer = _tokenizer_at(path, remote)
    config, model = _load_network(path, raw, profile, family.layout, model_kwargs)
    if device_map is None:
        model = model.to(device)
    model = model.eval()
    section = dict(raw.get("dloom") or {})

    if mask_token_id is None:
        mask_token_id = section.get("mask_token_id", raw.get("mask_token_id"))
    if mask_token_id is None:
        mask_token_id = _mask_from_tokenizer(tokenizer, profile)
    if mask_token_id is None:
        mask_token_id = profile.mask_token_id
    if mask_token_id is None and require_mask and profile.has_mask_token:
        raise ModelError(
            f"model {name!r} declares no mask token: pass --mask-token-id "
            "(mask_token_id=...), or set mask_token_id in its config.json, or give its "
            "tokenizer a mask token"
        )
    if "eos_token_ids" in section:
        eos = _as_ids(section["eos_token_ids"])
    else:
        eos = _eos_ids(raw, generation, tokenizer, profile)
    pad = raw.get("pad_token_id")
    if pad is None:  # a composite config (DiffusionGemma) keeps its text model's ids there
        pad = (raw.get("text_config") or {}).get("pad_token_id")
    if pad is None:
        pad = generation.get("pad_token_id")
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    if shift_logits is None:
        shift_logits = bool(section.get("shift", profile.shift_logits))
    if attention is None:
        attention = section.get("attention", profile.attention)
    if attention is None:
        causal = getattr(config, "is_causal", None)
        attention = "causal" if causal or (causal is None and mask_token_id is None) else "bidirectional"
    return ModelAdapter(
        model=model,
        mask_token_id=None if mask_token_id is None else int(mask_token_id),
        eos_token_ids=eos,
        pad_token_id=int(pad),
        shift_logits=shift_logits,
        attention=attention,
        max_context=getattr(config.get_text_config(), "max_position_embeddings", None),
        tokenizer=tokenizer,
        name=name,
        default_gen_length=section.get("gen_length"),
        default_block_length=section.get("block_length", profile.trained_block_length(raw)),
        block_alignment=section.get("block_alignment", profile.block_alignment),
        profile=profile.name,
        kernel=section.get("kernel", profile.kernel),
        generation=generation,
    )
