"""LLaDA2.x through every front-end: ``dloom eval``, ``dloom serve`` (the ``openai``
client, streaming only final tokens) and Ray batch decoding accept the LLaDA2 fixture with
the names its users know, and give the tokens of an offline ``generate``:

- ``--strategy threshold --param tau=0.95`` (LLaDA2.0's decode);
- ``--strategy joint_threshold --param tau=0.7 --param edit_tau=0.5 --param max_post_steps=16``
  (LLaDA2.1's quality mode, editing filled tokens on the revisable kernel).

The fixture checkpoint ships no tokenizer (LLaDA2's is 157,184 tokens); the text front-ends
get one covering the whole vocabulary (:func:`family_front_ends.write_tokenizer`), with
LLaDA2's ``<|endoftext|>`` (EOS and pad) and ``<|mask|>`` at their ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import family_front_ends as front_ends
import pytest
from typer.testing import CliRunner

import dloom
from dloom.cli.commands import app
from dloom.evaluation import select_examples
from dloom.zoo.tasks import ALPHABET

FIXTURE = Path(__file__).parents[1] / "fixtures" / "real-families" / "llada2" / "checkpoint"
SETTINGS = {"gen_length": 16, "block_length": 4}
STRATEGIES = {
    "threshold": ("tau=0.95",),
    "joint_threshold": ("tau=0.7", "edit_tau=0.5", "max_post_steps=16"),
}
EXAMPLES = 3


def params_of(strategy: str) -> dict[str, float | int]:
    """The strategy's parameters, typed (as a JSON request body gives them)."""
    return front_ends.typed(STRATEGIES[strategy])


def cli_params(strategy: str) -> list[str]:
    return front_ends.cli_params(strategy, STRATEGIES[strategy])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The LLaDA2 fixture with a tokenizer covering its whole vocabulary (module docstring)."""
    path = tmp_path_factory.mktemp("llada2") / "llada2"
    shutil.copytree(FIXTURE, path)
    size = json.loads((path / "config.json").read_text())["vocab_size"]
    front_ends.write_tokenizer(
        path, size, {156892: "<|endoftext|>", 156895: "<|mask|>"}, eos="<|endoftext|>", pad="<|endoftext|>",
        mask="<|mask|>",
    )
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    loaded = dloom.load_model(checkpoint)
    assert loaded.kernel == "revisable" and loaded.tokenizer is not None
    return loaded


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [example.prompt for example in select_examples("all", EXAMPLES, seed=0)]


def offline(model, strategy: str, prompts: list[str]) -> dloom.GenerationResult:
    """``prompts`` decoded offline, each alone (as a server or an actor may batch them)."""
    decoder = dloom.DiffusionDecoder(model, strategy, params=params_of(strategy), **SETTINGS)
    rows = [decoder.generate([prompt]) for prompt in prompts]
    assert all(row.texts is not None for row in rows)
    return rows


def test_the_tokenizer_spells_out_every_id(model):
    ids = [5, 156892, 100000, 3]
    assert model.encode(["ab"])[0] == [ALPHABET.index("a"), ALPHABET.index("b")]
    assert model.tokenizer.decode(ids) == f"{ALPHABET[5]}<|endoftext|><100000>{ALPHABET[3]}"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_dloom_eval_decodes_as_offline_generate(model, checkpoint, prompts, strategy):
    result = CliRunner().invoke(app, [
        "eval", "--model", str(checkpoint), *cli_params(strategy), "-n", str(EXAMPLES), "--tasks", "all",
        "--gen-length", "16", "--block-length", "4", "--json", "--outputs",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["config"]["strategy"] == strategy and report["complete"]
    assert params_of(strategy).items() <= report["config"]["params"][strategy].items()
    outputs = report["outputs"]
    assert [o["prompt"] for o in outputs] == prompts
    rows = offline(model, strategy, prompts)
    assert [o["text"] for o in outputs] == [row.texts[0] for row in rows]
    assert [o["nfe"] for o in outputs] == [int(row.nfe[0]) for row in rows]
    assert all("<" in o["text"] for o in outputs)  # not vacuous: tokens were generated


@pytest.fixture(scope="module")
def served(checkpoint, prompts):
    """``dloom serve`` with LLaDA2.1's quality mode as its default strategy, its command line
    read by the command itself and the app it would run served on a free port."""
    with front_ends.served([
        "--model", str(checkpoint), *cli_params("joint_threshold"), "--gen-length", "16", "--block-length", "4",
    ]) as client:
        yield client


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_dloom_serve_answers_and_streams_final_tokens_only(served, model, prompts, strategy):
    """Each answer is the offline decode (its first ``gen_length`` tokens: blocks aligned at
    position 0 end past ``gen_length``, and a server answers ``max_tokens <= gen_length``); a
    stream is its blocks as they settle, so its chunks join to the same text (a stream that
    sent a token an edit later rewrote would not)."""
    name = served.models.list().data[0].id
    request = {} if strategy == "joint_threshold" else {
        "extra_body": {"strategy": strategy, "params": params_of(strategy)},
    }
    rows = offline(model, strategy, prompts)
    for prompt, row in zip(prompts, rows):
        answer = served.completions.create(model=name, prompt=prompt, **request)
        assert answer.usage.strategy == strategy and answer.usage.nfe == int(row.nfe[0])
        tokens = row.token_lists[0][: SETTINGS["gen_length"]]
        text = model.decode([t for t in tokens if t not in model.eos_token_ids])
        assert answer.choices[0].text == text
        chunks = [c.choices[0].text for c in served.completions.create(model=name, prompt=prompt, stream=True, **request)]
        assert "".join(chunks) == text
        assert len([c for c in chunks if c]) > 1  # block by block
    if strategy == "joint_threshold":  # not vacuous: edits changed some answer
        unedited = dloom.DiffusionDecoder(
            model, strategy, params={**params_of(strategy), "edit_tau": 1.0, "max_post_steps": 0}, **SETTINGS,
        ).generate(prompts)
        assert unedited.token_lists != [row.token_lists[0] for row in rows]


@pytest.fixture(scope="module")
def ray_runtime():
    with front_ends.ray_runtime():
        yield


@pytest.mark.slow  # a local Ray runtime and two actors loading the model: about 30 s
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_ray_decodes_as_offline_generate(ray_runtime, checkpoint, model, prompts, strategy):
    from dloom.ray import DecodeSpec, decode_prompts

    spec = DecodeSpec(model=str(checkpoint), strategy=strategy, params=STRATEGIES[strategy], settings=SETTINGS)
    rows = decode_prompts(prompts, spec, actors=2, batch_size=2)
    assert [row["index"] for row in rows] == list(range(len(prompts)))
    expected = offline(model, strategy, prompts)
    assert [row["tokens"] for row in rows] == [r.token_lists[0] for r in expected]
    assert [row["nfe"] for row in rows] == [int(r.nfe[0]) for r in expected]
