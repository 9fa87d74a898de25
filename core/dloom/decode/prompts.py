"""Checks on what a decoder is asked to decode, run before any forward.

* :func:`check_lengths` refuses lengths that are zero, negative or not integers (a zero
  must never fall back to a default);
* :func:`check_special_ids` refuses a mask, EOS or pad id outside the model's vocabulary
  (it would index past the embedding: an ``IndexError`` on the CPU, a device-side assert
  on a GPU);
* :func:`check_prompts` refuses prompts that cannot be decoded as given: text with
  characters the tokenizer cannot encode, token ids that are not integers (a float or a
  bool would be truncated silently) or lie outside ``[0, vocab)``, mixed batches, and prompts
  made only of the mask token (:func:`check_not_mask_only`).

A bare string is one prompt: ``decoder.generate("copy ab")`` decodes ``["copy ab"]`` (as
a tokenizer does with one text), never one prompt per character. Every message names the
prompt (``prompt 3``, or the ``file:line`` the caller passes as ``sources``) and the bad
value.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from dloom.errors import ConfigurationError, ModelError


def vocabulary_size(model: Any) -> int | None:
    """Rows of the model's input embedding (the ids it accepts), else ``config.vocab_size``;
    ``None`` when neither is known. ``model`` is a :class:`dloom.ModelAdapter`."""
    module = model.model
    embeddings = getattr(module, "get_input_embeddings", None)
    try:
        table = embeddings() if callable(embeddings) else None
    except NotImplementedError:
        table = None
    if table is not None and hasattr(table, "num_embeddings"):
        return int(table.num_embeddings)
    size = getattr(getattr(module, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def check_lengths(**lengths: Any) -> None:
    """Refuse any given length (``None`` means "use the default") that is not a positive
    integer, e.g. ``check_lengths(gen_length=0)``.

    :raises ConfigurationError: naming the setting and its value.
    """
    for name, value in lengths.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ConfigurationError(
                f"{name} is {value!r}; allowed: a positive integer (or None for the default)"
            )


def check_special_ids(model: Any) -> None:
    """Refuse a mask, EOS or pad token id outside ``[0, vocab)``.

    :raises ModelError: naming the id, the model and its vocabulary size.
    """
    size = vocabulary_size(model)
    if size is None:
        return
    named = [("mask token id", model.mask_token_id), ("pad token id", model.pad_token_id)]
    named += [("EOS token id", eos) for eos in model.eos_token_ids]
    for what, value in named:
        if value is not None and not 0 <= value < size:
            raise ModelError(
                f"{what} {value} is outside the vocabulary of model {model.name!r}; "
                f"allowed: 0 .. {size - 1}"
            )


def _bad_characters(model: Any, text: str) -> list[str]:
    """The characters of ``text`` that the tokenizer fails to encode on their own."""
    bad = []
    for char in dict.fromkeys(text):
        try:
            model.encode([char])
        except Exception:  # noqa: BLE001 - tokenizers raise bare Exception on a missing token
            bad.append(char)
    return bad


def _encode_text(model: Any, text: str, label: str) -> list[int]:
    if model.tokenizer is None:
        raise ModelError(f"{label} is text, but model {model.name!r} has no tokenizer; pass token ids instead of text")
    try:
        return model.encode([text])[0]
    except Exception as error:  # noqa: BLE001 - a tokenizer's failure, reported with the prompt
        bad = _bad_characters(model, text)
        found = (
            f"characters outside the vocabulary: {', '.join(repr(c) for c in bad)}"
            if bad else f"the tokenizer failed: {error}"
        )
        raise ModelError(
            f"{label} {text!r} cannot be encoded by the tokenizer of model {model.name!r}: "
            f"{found}"
        ) from None


def _check_ids(ids: Any, label: str, size: int | None) -> list[int]:
    if hasattr(ids, "tolist") and not isinstance(ids, (str, bytes)):  # a tensor or array row
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ConfigurationError(
            f"{label} is {ids!r}; allowed: a text or a list of token ids "
            "(a batch is a list of prompts, e.g. [[5, 6, 7]])"
        )
    checked = []
    for position, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigurationError(
                f"{label} has {value!r} ({type(value).__name__}) at position {position}; "
                "allowed: integer token ids"
            )
        if size is not None and not 0 <= int(value) < size:
            raise ModelError(
                f"{label} has token id {value} at position {position}, outside the "
                f"vocabulary; allowed: 0 .. {size - 1}"
            )
        checked.append(int(value))
    return checked


def check_not_mask_only(ids: Sequence[int], label: str, mask_token_id: int | None) -> None:
    """Refuse a prompt made only of the mask token: it gives the model nothing to condition
    on, every position's distribution is the same, and which position is decoded first is
    left to floating-point rounding, which differs with the batch's shape (padding), so its
    output would depend on the prompts it is batched with.

    :raises ConfigurationError: naming the prompt and the mask id.
    """
    if mask_token_id is not None and ids and all(int(t) == mask_token_id for t in ids):
        raise ConfigurationError(
            f"{label} is made only of the mask token (id {mask_token_id}); a dLLM has nothing to "
            "condition on and its output would depend on the batch; allowed: a prompt with at "
            "least one other token"
        )


def _check_tensor(
    prompts: torch.Tensor, attention_mask: torch.Tensor | None, size: int | None, mask_token_id: int | None,
) -> None:
    if prompts.dtype in (torch.bool,) or prompts.dtype.is_floating_point or prompts.is_complex():
        raise ConfigurationError(
            f"prompt tensor has dtype {prompts.dtype}; allowed: an integer dtype (token ids)"
        )
    if prompts.dim() != 2:
        raise ModelError(f"prompt tensor must be (B, P); got shape {tuple(prompts.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(prompts.shape):
        raise ConfigurationError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; allowed: the prompts' "
            f"shape {tuple(prompts.shape)}"
        )
    if not prompts.numel():
        return
    real = torch.ones_like(prompts, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    mask_id = -1 if mask_token_id is None else mask_token_id
    only_masks = ((prompts == mask_id) | ~real).all(-1) & real.any(-1)
    low, high, first_mask_only = torch.stack(  # one host sync
        [prompts.min().long(), prompts.max().long(), torch.where(only_masks.any(), only_masks.long().argmax(), -1)]
    ).tolist()
    if size is not None and (low < 0 or high >= size):
        value = low if low < 0 else high
        row, column = (prompts == value).nonzero()[0].tolist()
        raise ModelError(
            f"prompt {row} has token id {value} at position {column}, outside the "
            f"vocabulary; allowed: 0 .. {size - 1}"
        )
    if first_mask_only >= 0:
        check_not_mask_only([mask_id], f"prompt {first_mask_only}", mask_token_id)

def check_prompts(
    model: Any,
    prompts: Any,
    attention_mask: torch.Tensor | None = None,
    sources: Sequence[str] | None = None,
) -> Any:
    """Check ``prompts`` against ``model`` (a :class:`dloom.ModelAdapter`) and return them
    ready for :func:`dloom.model.adapter.left_pad_prompts`: a ``(B, P)`` tensor as given, else
    one token-id list per prompt (texts encoded here, once).

    :param prompts: texts, token-id lists, a bare string (one prompt) or a ``(B, P)``
        integer tensor.
    :param sources: one label per prompt for the messages (default ``"prompt i"``).
    :raises ConfigurationError: for no prompts, a mixed batch, ids that are not integers, or a
        prompt made only of the mask token.
    :raises ModelError: for text the tokenizer cannot encode or ids outside the vocabulary.
    """
    size = vocabulary_size(model)
    if isinstance(prompts, torch.Tensor):
        _check_tensor(prompts, attention_mask, size, model.mask_token_id)
        return prompts
    if isinstance(prompts, str):
        prompts = [prompts]
    elif hasattr(prompts, "tolist"):  # a NumPy array of ids
        prompts = prompts.tolist()
    if isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Sequence):
        raise ConfigurationError(
            f"prompts are a {type(prompts).__name__}; allowed: a text, a list of texts, a list "
            "of token-id lists or a (B, P) tensor"
        )
    if len(prompts) == 0:
        raise ModelError("no prompts given")
    labels = list(sources) if sources is not None else [f"prompt {i}" for i in range(len(prompts))]
    texts = [isinstance(p, str) for p in prompts]
    if any(texts) and not all(texts):
        mixed = texts.index(not texts[0])
        raise ConfigurationError(
            f"{labels[mixed]} is {'text' if texts[mixed] else 'token ids'} but {labels[0]} is "
            f"{'text' if texts[0] else 'token ids'}; allowed: one kind per batch"
        )
    rows = []
    for label, prompt in zip(labels, prompts):
        ids = _encode_text(model, prompt, label) if isinstance(prompt, str) else prompt
        ids = _check_ids(ids, label, size)
        if not ids:
            raise ModelError(f"{label} is empty; every prompt needs at least one token")
        check_not_mask_only(ids, label, model.mask_token_id)
        rows.append(ids)
    return rows
