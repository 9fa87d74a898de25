"""Text to token ids and back, as a zoo checkpoint's own tokenizer does it.

The trainer encodes prompts and answers with the same ``tokenizers.Tokenizer`` it saves into
every checkpoint (:func:`dloom.zoo.tokenizer.build`), so a model is trained on exactly the ids
``AutoTokenizer.from_pretrained`` gives it at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from dloom.zoo import long_tasks
from dloom.zoo import tokenizer as tok

__all__ = ["CHARACTERS", "Codec"]


class Codec:
    """Encode and decode with a zoo ``tokenizer`` (its pre-tokenizer and vocabulary; the zoo's
    tokens are literal text, so decoding joins them)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._tokens = sorted(vocab, key=vocab.__getitem__)
        self.encode = lru_cache(maxsize=1 << 16)(self._encode)
        """``encode(text) -> list[int]`` (cached: answers and prompts repeat across batches)."""

    @classmethod
    def over(cls, alphabet: str, words: Sequence[str] = ()) -> Codec:
        """The codec of ``tok.build(alphabet, words)``: one token per character without ``words``."""
        return cls(tok.build(alphabet, words))

    @classmethod
    def saved(cls, directory: str | Path) -> Codec:
        """The codec of the ``tokenizer.json`` a checkpoint in ``directory`` saved."""
        return cls(Tokenizer.from_file(str(Path(directory) / "tokenizer.json")))

    @property
    def size(self) -> int:
        """The vocabulary size, special tokens included."""
        return len(self._tokens)

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` up to the first ``<eos>``; ``<pad>`` and ``<mask>`` read as ``\\ufffd``."""
        out = []
        for i in ids:
            if i == tok.EOS_ID:
                break
            out.append(self._tokens[i] if i > tok.EOS_ID else "\ufffd")
        return "".join(out)


CHARACTERS = Codec.over(long_tasks.ALPHABET)
"""One token per character of the long alphabet, which starts with the short one: a toy-zoo
string gets the ids of its own tokenizer too."""
