"""The toy model zoo: small trained models loaded offline by name.

Models (``MODEL_NAMES``), transformers ``LlamaForCausalLM`` checkpoints (float16
safetensors) with a character tokenizer or, for the four ``long-dllm-words*`` ones, a word
tokenizer. The three ``toy-*`` models (``SHIPPED``) ship inside the package, in
``models/<name>/``; the seven ``long-*`` ones (``IN_CHECKOUT``) live in
``training/checkpoints/<name>/`` of the source repository, where a git checkout finds them
(:func:`model_path`), and an installed wheel does not carry them:

* ``toy-dllm`` — bidirectional masked-diffusion model (``is_causal=False``), ~1.8M params,
  adapted from a causal model of the same shape (Dream-style: its logits stay shifted);
* ``toy-ar`` — causal next-token model, ~3.8M params (the speculative-decoding target);
* ``toy-ar-small`` — causal, ~0.5M params, clearly weaker;
* ``long-dllm`` — the long-answer workload's dLLM (:mod:`dloom.zoo.long_tasks`), ~2.2M
  params, bidirectional with shifted logits, made from a causal model of its shape and trained
  on (among others) the states a one-token-per-step block decoder reaches;
* ``long-ar`` — the long workload's causal target, ~5.1M params;
* ``long-ar-small`` — the long workload's small causal drafter, ~0.6M params;
* ``long-dllm-words`` — the long workload's dLLM in word and number tokens
  (:func:`dloom.zoo.tokenizer.build` with ``long_tasks.WORD_TOKENS``), ~2.7M params, trained
  also on the states dloom's threshold decoder reaches, so that it decodes several tokens a
  forward without losing accuracy;
* ``long-dllm-words-ar`` — the causal model ``long-dllm-words`` was made from, same shape
  and tokenizer (its FailFast target);
* ``long-dllm-words-ar-small`` — causal, ``long-ar-small``'s shape with the word tokenizer,
  ~0.94M params (the assistant of assisted generation next to FailFast);
* ``long-dllm-words-edit`` — ``long-dllm-words`` trained on to revise its own drafts
  (LLaDA2.1's token-to-token rows): it decodes on the revisable kernel (its ``dloom`` entry
  names ``"kernel": "revisable"``), where editing rules such as ``joint_threshold`` run.

The ``toy-*`` models decode the toy suite (:mod:`dloom.zoo.tasks`), the ``long-*`` ones the
long-answer suite; the three character-level ``long-*`` share one tokenizer, which writes
every character of the toy one with the same ids.

Each ``config.json`` carries ``mask_token_id`` (1), ``pad_token_id`` (0), ``eos_token_id``
(2) and a plain-JSON ``dloom`` entry: ``{"kind": "dllm" | "ar", "attention":
"bidirectional" | "causal", "shift": false | true, "gen_length": 32}`` (``shift``: logits
at position ``i`` predict token ``i + 1``).  ``models/<name>/eval.json`` records how it was
trained and its greedy held-out accuracy.

Encoding contract (how prompts and answers are laid out; training used exactly this):

* Tokens are characters (``tokenizer``); ``<pad>`` = 0, ``<mask>`` = 1, ``<eos>`` = 2; no BOS.
* Input = prompt ids, then the answer region.  A batch LEFT-pads prompts with ``<pad>`` to a
  common length; ``attention_mask`` is 0 on those pads and 1 elsewhere, and
  ``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)`` (always pass them: the
  models were trained with random extra left padding under this convention).
* dLLM: the answer region is ``GEN_LENGTH`` = 32 positions, the answer followed by ``<eos>``
  repeated to fill them (at least one ``<eos>`` always follows the answer; answers are at
  most 31 characters).  Decoding starts from 32 ``<mask>`` tokens after the prompt; logits
  are shifted (position ``i``'s logits predict position ``i + 1``, so the prompt's last
  position predicts the first answer token).
* AR: prompt ids, answer ids, one ``<eos>``; next-token logits (shifted); generation stops
  at ``<eos>``.
* The answer text is everything before the first ``<eos>``; ``tasks.FAMILIES[f].check``
  grades it.

The ``long-*`` models follow the same contract with the 99-token tokenizer of
``long_tasks.ALPHABET`` (the same ids for the characters the two share), ``gen_length`` 128
decoded in blocks of ``block_length`` 32 (both in their ``dloom`` config entry), answers of at
most 127 characters graded by ``long_tasks.FAMILIES[f].check``; the four ``long-dllm-words*``
ones with the 2,351-token word tokenizer (the same 99 character ids, then
``long_tasks.WORD_TOKENS``), ``gen_length`` 64 in blocks of 16, answers of at most 63
tokens.  They are trained by
``PYTHONPATH=training python -m dloom_training.train --model long-…`` into ``training/checkpoints/`` of the source
repository, and loaded from there (``training/README.md`` has the commands).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dloom.errors import ModelError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["CHECKOUT_DIR", "IN_CHECKOUT", "MODEL_NAMES", "PARTNERS", "SHIPPED", "ZOO_DIR", "load", "locate", "model_path"]

ZOO_DIR = Path(__file__).resolve().parent / "models"
"""Directory holding one sub-directory of weights and tokenizer files per shipped model."""

CHECKOUT_DIR = Path(__file__).resolve().parents[3] / "training" / "checkpoints"
"""Where a source checkout keeps the ``IN_CHECKOUT`` models (``training/checkpoints/``);
absent beside an installed package."""

SHIPPED = ("toy-dllm", "toy-ar", "toy-ar-small")
"""The models inside the package (the wheel)."""
IN_CHECKOUT = ("long-dllm", "long-ar", "long-ar-small", "long-dllm-words", "long-dllm-words-ar",
               "long-dllm-words-ar-small", "long-dllm-words-edit")
"""The models of the source repository's ``training/checkpoints/``, not in the wheel."""
MODEL_NAMES = SHIPPED + IN_CHECKOUT
PARTNERS: dict[str, tuple[str, str | None]] = {
    "toy-dllm": ("toy-ar", "toy-ar-small"),
    "long-dllm": ("long-ar", "long-ar-small"),
    "long-dllm-words": ("long-dllm-words-ar", "long-dllm-words-ar-small"),
}
"""Each zoo dLLM's AR target and small AR assistant, models with its tokenizer (FailFast
drafts for the target; assisted generation drafts with the assistant); ``None``: the zoo has
no such model."""


def model_path(name: str) -> Path:
    """The directory of zoo model ``name``: in the package for a ``SHIPPED`` model, in
    :data:`CHECKOUT_DIR` for the others (whether or not it holds the checkpoint; see
    :func:`locate`).

    :raises ValueError: ``name`` is not one of ``MODEL_NAMES``.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown zoo model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    return (ZOO_DIR if name in SHIPPED else CHECKOUT_DIR) / name


def locate(name: str) -> Path:
    """:func:`model_path` of ``name``, which must hold a checkpoint (a ``config.json``).

    :raises ValueError: ``name`` is not one of ``MODEL_NAMES``.
    :raises ModelError: an ``IN_CHECKOUT`` model that is not there (an installed package
        without the source repository), saying where to get it.
    """
    path = model_path(name)
    if name in IN_CHECKOUT and not (path / "config.json").is_file():
        raise ModelError(
            f"zoo model {name!r} is not in the installed package: it lives in "
            f"training/checkpoints/{name}/ of the dloom source repository, and {path} holds no "
            f"checkpoint; run from a clone of the repository, or pass the checkpoint's directory "
            f"instead of the name (train it with `PYTHONPATH=training python -m dloom_training.train --model {name} "
            "--out training/checkpoints`)"
        )
    return path


def load(
    name_or_path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a zoo model (by name, or any local checkpoint directory) and its tokenizer.

    Never touches the network (``local_files_only=True``).  The float16 weights on disk are
    cast to ``dtype`` (default ``torch.float32``); the model is returned in eval mode on
    ``device``.

    :raises ValueError: an unknown name that is not an existing directory; a
        :class:`~dloom.errors.ModelError` for an ``IN_CHECKOUT`` model that is not there.
    :raises FileNotFoundError: the model's files are missing (e.g. not yet trained).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(name_or_path, str) and name_or_path in MODEL_NAMES:
        path = locate(name_or_path)
    elif Path(name_or_path).is_dir():
        path = Path(name_or_path)
    else:
        model_path(str(name_or_path))  # raises the ValueError listing known names
        raise AssertionError("unreachable")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint in {path} (run `PYTHONPATH=training python -m dloom_training.train`)")
    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32 if dtype is None else dtype
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]  # transformers wraps .to() untyped
