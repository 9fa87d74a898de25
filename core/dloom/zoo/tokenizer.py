"""The zoo's tokenizers: one token per character, or whole words and numbers as well.

Built with the ``tokenizers`` library: a ``WordLevel`` model whose vocabulary is the special
tokens followed by every character of an alphabet, a pre-tokenizer that isolates every
character, and a ``Fuse`` decoder so that ``decode(encode(s)) == s`` (no spaces are
inserted between characters).  ``save(directory)`` writes ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json``;
``transformers.AutoTokenizer.from_pretrained(directory)`` then loads it as a fast tokenizer
with ``pad_token``, ``mask_token`` and ``eos_token`` set and left padding.

With ``words`` (multi-character tokens, e.g. ``long_tasks.WORD_TOKENS``: each word of the
long-answer suite with and without its leading space, the numbers 0..999 likewise, and a
newline with four spaces of indentation), the vocabulary continues with them and the
pre-tokenizer takes a listed word whole where it stands complete (the longest first; one
that ends in a lower-case letter or digit is not followed by another), every other character alone:
every text over the alphabet still encodes, and ``decode(encode(s)) == s``.

Two alphabets: ``tasks.ALPHABET`` (the default, 54 characters: the shipped ``toy-*`` models)
and ``long_tasks.ALPHABET`` (96 characters: printable ASCII and the newline, shared by every
long-answer model).  The wide one starts with the narrow one, so the characters they share
have the same ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from .tasks import ALPHABET

__all__ = ["EOS", "EOS_ID", "MASK", "MASK_ID", "PAD", "PAD_ID", "SPECIALS", "build", "save", "vocab"]

PAD, MASK, EOS = "<pad>", "<mask>", "<eos>"
SPECIALS = (PAD, MASK, EOS)
PAD_ID, MASK_ID, EOS_ID = 0, 1, 2


def vocab(alphabet: str = ALPHABET, words: Sequence[str] = ()) -> dict[str, int]:
    """Token -> id: ``<pad>`` 0, ``<mask>`` 1, ``<eos>`` 2, then ``alphabet`` in order, then
    ``words`` in order.

    :raises ValueError: a word of fewer than two characters, or listed twice.
    """
    short = [w for w in words if len(w) < 2]
    if short or len(set(words)) != len(words):
        raise ValueError(f"words must be distinct and of two characters or more; got {short or 'repeats'}")
    return {token: i for i, token in enumerate((*SPECIALS, *alphabet, *words))}


def _split_pattern(alphabet: str, words: Sequence[str]) -> str:
    """The pre-tokenizer's (Oniguruma) regular expression: the ``words`` longest first, each
    that ends in a lower-case letter or digit only where no lower-case letter or digit
    follows, then any one character.  Oniguruma's ``.`` does not match a newline, so an
    alphabet with one takes ``[\\s\\S]``; the default alphabet keeps ``.``, byte for byte the
    shipped models' file."""
    character = r"[\s\S]" if "\n" in alphabet else "."
    whole = [
        re.escape(word) + (r"(?![a-z0-9])" if word[-1].isalnum() else "")
        for word in sorted(words, key=len, reverse=True)
    ]
    return "|".join((*whole, character))


def build(alphabet: str = ALPHABET, words: Sequence[str] = ()) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` over ``alphabet`` and ``words`` (no post-processor: no
    BOS, no EOS)."""
    tokenizer = Tokenizer(models.WordLevel(vocab(alphabet, words), unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(_split_pattern(alphabet, words)), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


def save(directory: str | Path, alphabet: str = ALPHABET, max_length: int = 128, words: Sequence[str] = ()) -> None:
    """Write the tokenizer files that ``AutoTokenizer.from_pretrained`` reads
    (``max_length``: the ``model_max_length`` they declare)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build(alphabet, words).save(str(directory / "tokenizer.json"))
    specials = {"pad_token": PAD, "mask_token": MASK, "eos_token": EOS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
        (directory / name).write_text(json.dumps(content, indent=2) + "\n")
