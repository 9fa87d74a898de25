"""The zoo's character-level tokenizer (one token per character, spaces included).

Built with the ``tokenizers`` library: a ``WordLevel`` model whose vocabulary is the special
tokens followed by every character of ``tasks.ALPHABET``, a pre-tokenizer that isolates
every character, and a ``Fuse`` decoder so that ``decode(encode(s)) == s`` (no spaces are
inserted between characters).  ``save(directory)`` writes ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json``;
``transformers.AutoTokenizer.from_pretrained(directory)`` then loads it as a fast tokenizer
with ``pad_token``, ``mask_token`` and ``eos_token`` set and left padding.
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


def vocab() -> dict[str, int]:
    """Token -> id: ``<pad>`` 0, ``<mask>`` 1, ``<eos>`` 2, then ``ALPHABET`` in order."""
    return {token: i for i, token in enumerate((*SPECIALS, *ALPHABET))}


def build() -> Tokenizer:
    """The character-level ``tokenizers.Tokenizer`` (no post-processor: no BOS, no EOS)."""
    tokenizer = Tokenizer(models.WordLevel(vocab(), unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


def save(directory: str | Path) -> None:
    """Write the tokenizer files that ``AutoTokenizer.from_pretrained`` reads."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build().save(str(directory / "tokenizer.json"))
    specials = {"pad_token": PAD, "mask_token": MASK, "eos_token": EOS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128,
    }
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
        (directory / name).write_text(json.dumps(content, indent=2) + "\n")
