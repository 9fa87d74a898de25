"""What the real-family front-end tests share: a tokenizer covering a fixture's whole
vocabulary, ``dloom serve`` run from its command line, and a local Ray runtime.

The real-family fixture checkpoints ship no tokenizer (the families' own have hundreds of
thousands of tokens); the text front-ends get one written by :func:`write_tokenizer`: the toy
task alphabet one character per token, every other id its own token ``<id>``, and the
family's special tokens at their ids. Decoded texts then spell out every generated id, so equal
texts are equal tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import uvicorn
from typer.testing import CliRunner

from dloom.cli.commands import app
from dloom.zoo.tasks import ALPHABET


def write_tokenizer(
    checkpoint: Path, vocab_size: int, special: dict[int, str], *, eos: str, pad: str, mask: str | None = None,
    first_letter: int = 0,
) -> None:
    """Save into ``checkpoint`` a tokenizer of ``vocab_size`` ids: ``special`` (id -> token)
    at their ids, :data:`~dloom.zoo.tasks.ALPHABET` from id ``first_letter`` on, one character
    per token, and every other id ``<id>``; ``eos``, ``pad`` and ``mask`` name special tokens,
    unknown characters read as ``eos``. Texts are split into characters; prompts are encoded
    with no special token added, and padded on the left."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = {first_letter + i: letter for i, letter in enumerate(ALPHABET)}
    clash = sorted(set(letters) & set(special))
    if clash:
        raise ValueError(f"ids {clash} are both special and letters; allowed: first_letter past the special ids")
    names = {**special, **letters}
    vocab = {names.get(i, f"<{i}>"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=eos))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=eos, pad_token=pad, mask_token=mask, padding_side="left",
    ).save_pretrained(checkpoint)


def cli_params(strategy: str, params: tuple[str, ...]) -> list[str]:
    """``--strategy strategy --param p ...``."""
    return ["--strategy", strategy, *(arg for p in params for arg in ("--param", p))]


def typed(params: tuple[str, ...]) -> dict[str, float | int]:
    """``name=value`` parameters, typed (as a JSON request body gives them)."""
    return {name: json.loads(value) for name, value in (p.split("=") for p in params)}


@contextmanager
def served(arguments: list[str]) -> Iterator[openai.OpenAI]:
    """An ``openai`` client of ``dloom serve arguments``: the command line read by the command
    itself, and the app it would run served on a free port until the context exits."""
    from dloom.serve.background import BackgroundServer

    apps = []
    patch = pytest.MonkeyPatch()
    patch.setattr(uvicorn, "run", lambda application, **options: apps.append(application))
    try:
        result = CliRunner().invoke(app, ["serve", *arguments])
    finally:
        patch.undo()
    assert result.exit_code == 0, result.output
    server = BackgroundServer(apps[0].state.service.config)
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        server.stop()


@contextmanager
def ray_runtime() -> Iterator[None]:
    """A local Ray runtime of two CPUs (the test is skipped without the optional extra)."""
    ray = pytest.importorskip("ray", reason="the Ray tests need the optional extra ray (pip install -e '.[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()
