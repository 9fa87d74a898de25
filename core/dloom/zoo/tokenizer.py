"""The zoo's character-level tokenizers (one token per character, spaces included).

Built with the ``tokenizers`` library: a ``WordLevel`` model whose vocabulary is the special
tokens followed by every character of an alphabet, a pre-tokenizer that isolates every
character, and a ``Fuse`` decoder so that ``decode(encode(s)) == s`` (no spaces are
inserted between characters).  ``save(directory)`` writes ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json``;
``transformers.AutoTokenizer.from_pretrained(directory)`` then loads it as a fast tokenizer
with ``pad_token``, ``mask_token`` and ``eos_token`` set and left padding.

Two alphabets: ``tasks.ALPHABET`` (the default, 54 characters: the shipped ``toy-*`` models)
and ``long_tasks.ALPHABET`` (96 characters: printable ASCII and the newline, shared by every
long-answer model).  The wide one starts with the narrow one, so the characters they share
have the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from .tasks import ALPHABET

__all__ = ["EOS", "EOS_ID", "MASK", "MASK_ID", "PAD", "PAD_ID", "SPECIALS", "build", "save", "vocab"]

PAD, MASK, EOS = "<pad>", "<mask>", "<eos>"
SPECIALS = (PAD, MASK, EOS)
PAD_ID, MASK_ID, EOS_ID = 0, 1, 2


def vocab(alphabet: str = ALPHABET) -> dict[str, int]:
    """Token -> id: ``<pad>`` 0, ``<mask>`` 1, ``<eos>`` 2, then ``alphabet`` in order."""
    return {token: i for i, token in enumerate((*SPECIALS, *alphabet))}


def build(alphabet: str = ALPHABET) -> Tokenizer:
    """The character-level ``tokenizers.Tokenizer`` (no post-processor: no BOS, no EOS).

    Oniguruma's ``.`` does not match a newline, so an alphabet with one splits on
    ``[\\s\\S]``; the default alphabet keeps ``.``, byte for byte the shipped models' file.
    """
    tokenizer = Tokenizer(models.WordLevel(vocab(alphabet), unk_token=None))
    character = r"[\s\S]" if "\n" in alphabet else "."
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(character), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


def save(directory: str | Path, alphabet: str = ALPHABET, max_length: int = 128) -> None:
    """Write the tokenizer files that ``AutoTokenizer.from_pretrained`` reads
    (``max_length``: the ``model_max_length`` they declare)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build(alphabet).save(str(directory / "tokenizer.json"))
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
