"""DiffusionGemma through every front-end: ``dloom eval``, ``dloom serve`` (the ``openai``
client, streaming only final tokens) and Ray batch decoding accept the DiffusionGemma fixture
with the names its users know, ``--strategy entropy_bound --param gamma=0.1`` and a seed, and
give the tokens of an offline ``generate`` with that seed (prompt ``i`` of a run draws from
random stream ``i`` of the seed, a request's prompt ``i`` from stream ``i`` of its seed).

The fixture checkpoint ships no tokenizer (DiffusionGemma's has 262,144 tokens); the text
front-ends get one covering the whole vocabulary (:func:`family_front_ends.write_tokenizer`),
with Gemma's ``<pad>``, ``<eos>`` and ``<bos>`` at ids 0, 1 and 2 and the letters after them.
Its generation config caps a canvas at 4 denoising steps (transformers' default of 48 would
only make the tests slower); the uniform kernel has no mask token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import family_front_ends as front_ends
import openai
import pytest
from typer.testing import CliRunner

import dloom
from dloom.cli.commands import app
from dloom.evaluation import select_examples
from dloom.zoo.tasks import ALPHABET

FIXTURE = Path(__file__).parents[1] / "fixtures" / "real-families" / "diffusion_gemma" / "checkpoint"
STRATEGY = "entropy_bound"
PARAMS = ("gamma=0.1",)
SEED = 3
GEN_LENGTH = 16
STEPS_PER_CANVAS = 4
EXAMPLES = 2
FIRST_LETTER = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The DiffusionGemma fixture with a tokenizer of its whole vocabulary and 4 steps a canvas."""
    path = tmp_path_factory.mktemp("diffusion_gemma") / "diffusion_gemma"
    shutil.copytree(FIXTURE, path)
    size = json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]
    front_ends.write_tokenizer(
        path, size, {0: "<pad>", 1: "<eos>", 2: "<bos>"}, eos="<eos>", pad="<pad>", first_letter=FIRST_LETTER,
    )
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "max_denoising_steps": STEPS_PER_CANVAS}))
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    loaded = dloom.load_model(checkpoint)
    assert loaded.kernel == "uniform" and loaded.mask_token_id is None and loaded.tokenizer is not None
    return loaded


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [example.prompt for example in select_examples("all", EXAMPLES, seed=SEED)]


def offline(model, prompts: list[str], seed: int = SEED) -> dloom.GenerationResult:
    """``prompts`` decoded offline in one batch, prompt ``i`` from stream ``i`` of ``seed``."""
    decoder = dloom.DiffusionDecoder(model, STRATEGY, params=front_ends.typed(PARAMS), gen_length=GEN_LENGTH, seed=seed)
    result = decoder.generate(prompts)
    assert result.texts is not None
    return result


def test_the_tokenizer_spells_out_every_id(model):
    assert model.encode(["ab"])[0] == [FIRST_LETTER, FIRST_LETTER + 1]
    assert model.tokenizer.decode([FIRST_LETTER + 5, 1, 100000, 0]) == f"{ALPHABET[5]}<eos><100000><pad>"


def test_dloom_eval_decodes_as_offline_generate(model, checkpoint, prompts):
    result = CliRunner().invoke(app, [
        "eval", "--model", str(checkpoint), *front_ends.cli_params(STRATEGY, PARAMS), "--seed", str(SEED),
        "-n", str(EXAMPLES), "--tasks", "all", "--gen-length", str(GEN_LENGTH), "--json", "--outputs",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["config"]["strategy"] == STRATEGY and report["complete"]
    assert report["config"]["params"][STRATEGY]["gamma"] == 0.1
    outputs = report["outputs"]
    assert [o["prompt"] for o in outputs] == prompts
    expected = offline(model, prompts)
    assert [o["text"] for o in outputs] == expected.texts
    assert [o["nfe"] for o in outputs] == expected.nfe.tolist()
    assert all("<" in o["text"] for o in outputs)  # not vacuous: tokens were generated
    assert offline(model, prompts, seed=SEED + 1).texts != expected.texts  # not vacuous: the seed matters


@pytest.fixture(scope="module")
def served(checkpoint):
    """``dloom serve`` with the entropy bound as its default strategy."""
    with front_ends.served([
        "--model", str(checkpoint), *front_ends.cli_params(STRATEGY, PARAMS), "--gen-length", str(GEN_LENGTH),
    ]) as client:
        yield client


def test_dloom_serve_answers_and_streams_whole_canvases_only(served, model, prompts):
    """A request's answer is the offline decode of its prompt alone with its ``seed``; its
    stream sends each canvas once it has ended, so its chunks join to the same text, a whole
    canvas (8 tokens) at a time."""
    name = served.models.list().data[0].id
    for prompt in prompts:
        expected = offline(model, [prompt])
        tokens = expected.token_lists[0][: int(expected.generated_lengths[0])]
        text = model.decode([t for t in tokens if t not in model.eos_token_ids])
        answer = served.completions.create(model=name, prompt=prompt, seed=SEED)
        assert answer.usage.strategy == STRATEGY and answer.usage.nfe == int(expected.nfe[0])
        assert answer.choices[0].text == text
        chunks = [c.choices[0].text for c in served.completions.create(model=name, prompt=prompt, seed=SEED, stream=True)]
        canvases = [model.decode([t for t in tokens[i : i + 8] if t not in model.eos_token_ids]) for i in (0, 8)]
        assert [c for c in chunks if c] == canvases and all(canvases)  # each canvas once it ended, whole
    other = served.completions.create(model=name, prompt=prompts[0], seed=SEED + 1)
    assert other.choices[0].text != offline(model, [prompts[0]]).texts[0]  # not vacuous: the seed matters


def test_dloom_serve_refuses_a_token_id_past_the_text_models_vocabulary(served):
    """The vocabulary is the text model's (the composite config has none of its own)."""
    name = served.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="token id 262144; allowed: 0..262143"):
        served.completions.create(model=name, prompt=[[5, 262144]], seed=SEED)


@pytest.fixture(scope="module")
def ray_runtime():
    with front_ends.ray_runtime():
        yield


@pytest.mark.slow  # a local Ray runtime and two actors loading the model: about 30 s
def test_ray_decodes_as_offline_generate(ray_runtime, checkpoint, model, prompts):
    from dloom.ray import DecodeSpec, decode_prompts

    spec = DecodeSpec(
        model=str(checkpoint), strategy=STRATEGY, params=PARAMS, settings={"gen_length": GEN_LENGTH, "seed": SEED},
    )
    rows = decode_prompts(prompts, spec, actors=2, batch_size=1)  # prompt 1 alone, from stream 1
    assert [row["index"] for row in rows] == list(range(len(prompts)))
    expected = offline(model, prompts)
    assert [row["tokens"] for row in rows] == expected.token_lists
    assert [row["nfe"] for row in rows] == expected.nfe.tolist()
