"""DiffusionGemma loads onto transformers' own class and decodes on the uniform kernel.

``tests/fixtures/real-families/diffusion_gemma/`` holds a tiny random
``DiffusionGemmaForBlockDiffusion`` checkpoint exactly as ``save_pretrained`` writes it (no
``.py`` files) and what transformers 5.25.0 computed on it (``reference.json`` describes
every entry and, in ``decoding_notes``, the order of the random draws). Here dloom must give the same canvas logits (float32, 1e-4) on every recorded input: without and with
self-conditioning, and a left-padded batch; and, on the uniform kernel with the
``entropy_bound`` rule and the same seed, the same tokens as transformers' ``generate`` on
every batch-1 run, step by step the same state (the decoder's input canvas, the accepted
positions, the renoised canvas, the argmax canvas, the entropies, the stopping). A batch
decodes every row as it would alone (per-row random streams; the fixture's batched runs draw
from one global stream and are not reproduced).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from dloom import DiffusionDecoder, load_model
from dloom.cli.commands import app
from dloom.decode import transition
from dloom.decode.uniform import UniformKernel, UniformSettings, entropy
from dloom.errors import ConfigurationError
from dloom.hooks.registry import get_registry

FIXTURE = Path(__file__).parents[1] / "fixtures" / "real-families" / "diffusion_gemma"
CHECKPOINT = FIXTURE / "checkpoint"
ATOL = 1e-4


@cache
def reference() -> dict:
    return json.loads((FIXTURE / "reference.json").read_text())


@cache
def recorded() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "reference.safetensors")


@cache
def adapter():
    return load_model(CHECKPOINT)


def assert_logits_match(name: str, logits: torch.Tensor) -> None:
    """``logits`` ``(B, C, V)`` against entry ``name``: the recorded columns, and the argmax,
    max and logsumexp over the whole vocabulary."""
    tensors = recorded()
    columns = tensors["columns"]
    torch.testing.assert_close(logits[..., columns], tensors[f"{name}.logits_cols"], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits.amax(-1), tensors[f"{name}.max"], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits.logsumexp(-1), tensors[f"{name}.logsumexp"], rtol=0, atol=ATOL)
    assert torch.equal(logits.argmax(-1), tensors[f"{name}.argmax"])


def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    entry = reference()["inputs"][name]
    return torch.tensor([entry["prompt"]]), torch.tensor([entry["canvas"]])


def test_the_family_is_registered_and_loads_onto_transformers_own_class():
    from transformers import DiffusionGemmaForBlockDiffusion

    family = get_registry().families.detect(CHECKPOINT)
    assert family.name == "diffusion-gemma" and family.plugin == "families"
    model = adapter()
    assert type(model.model) is DiffusionGemmaForBlockDiffusion
    assert not list(CHECKPOINT.glob("*.py"))
    assert (model.mask_token_id, model.pad_token_id, model.eos_token_ids) == (None, 0, (1,))
    assert (model.kernel, model.attention, model.default_block_length) == ("uniform", "block-causal", 8)
    assert model.max_context == 4096


@pytest.mark.parametrize("name", ["pair0", "pair1", "pair2"])
def test_canvas_logits_match_with_and_without_self_conditioning(name):
    prompt, canvas = pair(name)
    model = adapter()
    plain = model.canvas_logits(prompt, torch.ones_like(prompt), canvas)
    assert_logits_match(name, plain)
    conditioned = model.canvas_logits(prompt, torch.ones_like(prompt), canvas, plain)
    assert_logits_match(f"{name}_sc", conditioned)


def test_canvas_logits_of_a_left_padded_batch_match():
    """Positions ignore left padding here (the reference's do not): rotary attention sees
    relative positions only, so the rows' logits are the same."""
    entry = reference()["logits"]["padded_batch"]
    ids, mask = torch.tensor(entry["input_ids"]), torch.tensor(entry["attention_mask_2d"])
    logits = adapter().canvas_logits(ids, mask, torch.tensor(entry["decoder_input_ids"]))
    assert_logits_match("padded_batch", logits)


# --- decoding: the uniform kernel against generate ---------------------------------------------


def single_runs() -> list[dict]:
    return [run for run in reference()["decoding"] if run["attention_mask"] is None]


def eos_ids() -> dict[str, int]:
    """The EOS id each ``*_eos_*`` run set (``decoding_notes.eos_setting``'s ``eos ids used``)."""
    text = reference()["decoding_notes"]["eos_setting"]
    return json.loads(text.split("eos ids used: ")[1].replace("'", '"'))


def decoder_for(run: dict, **kwargs) -> DiffusionDecoder:
    """A decoder with ``run``'s settings: its schedule and stopping in the generation config,
    its EOS (or the model's, which random weights never produce), ``gamma`` its bound."""
    settings = run["settings"]
    names = ("t_min", "t_max", "stability_threshold", "confidence_threshold", "max_denoising_steps")
    model = dataclasses.replace(adapter(), generation={name: settings[name] for name in names})
    if run["name"] in eos_ids():
        model = dataclasses.replace(model, eos_token_ids=(eos_ids()[run["name"]],))
    return DiffusionDecoder(
        model, "entropy_bound", gen_length=settings["max_new_tokens"], params={"gamma": settings["entropy_bound"]},
        seed=run["seed"], **kwargs,
    )


@pytest.mark.parametrize("run", single_runs(), ids=lambda run: run["name"])
def test_generate_is_reproduced_token_for_token(run):
    result = decoder_for(run).generate([run["prompt"]])
    width = len(run["prompt"])
    length = int(result.generated_lengths[0])
    expected = run["generated"]
    assert result.sequences[0, : width + length].tolist() == run["output_ids"][: width + length]
    assert all(token == 0 for token in expected[length:])  # generate pads after the EOS
    assert length == (len(expected) if run["name"] not in eos_ids() else expected.index(eos_ids()[run["name"]]) + 1)
    assert int(result.nfe[0]) == run["denoising_steps"]


class RecordingKernel(UniformKernel):
    """The uniform kernel, recording every step's state under the fixture's names."""

    made: list[RecordingKernel] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.record: dict[str, list[torch.Tensor]] = {}
        RecordingKernel.made.append(self)

    def __call__(self, block, logits, advance):
        before, given = self.canvas.clone(), self.conditioned.clone()
        out = super().__call__(block, logits, advance)
        values = {
            "current_canvas": before, "self_conditioning_given": given, "raw_argmax": logits.argmax(-1),
            "entropy": entropy(self.conditioning), "accepted_mask": self.accepted,
            "renoised_canvas": self.canvas, "argmax_canvas": self.draft, "finished_after": self.stopped,
        }
        for name, value in values.items():
            self.record.setdefault(name, []).append(value.clone())
        return out


@pytest.mark.parametrize("run", single_runs(), ids=lambda run: run["name"])
def test_every_step_matches_the_recorded_state(run, monkeypatch):
    monkeypatch.setitem(transition.KERNELS, "uniform", RecordingKernel)
    monkeypatch.setattr(RecordingKernel, "made", [])
    decoder_for(run).generate([run["prompt"]])
    (kernel,) = RecordingKernel.made
    steps, prefix = recorded(), f"decode.{run['name']}."
    assert torch.equal(steps[prefix + "initial_canvas"][:, 0], torch.stack(kernel.record["current_canvas"])[
        steps[prefix + "step_cur_step"] == run["settings"]["max_denoising_steps"], 0])
    for name, values in kernel.record.items():
        mine, theirs = torch.stack(values), steps[prefix + "step_" + name]
        if name == "self_conditioning_given":
            assert torch.equal(mine.flatten(), theirs), name
        elif name == "entropy":
            torch.testing.assert_close(mine, theirs, rtol=0, atol=ATOL)
        else:
            assert torch.equal(mine, theirs), name


def batch_decoders(eos: int | None = None) -> DiffusionDecoder:
    (run,) = [run for run in reference()["decoding"] if run["name"] == "generate_eb0.1_batched_leftpad"]
    decoder = decoder_for(run)
    if eos is not None:
        decoder.model = dataclasses.replace(decoder.model, eos_token_ids=(eos,))
    return decoder


@pytest.mark.parametrize("with_eos", [False, True], ids=["no-eos", "eos"])
def test_each_row_of_a_batch_decodes_as_it_would_alone(with_eos):
    """Left-padded rows of different lengths (with EOS: one finishing a canvas early while the
    other runs on): every row's tokens and forwards are those of decoding it alone from its
    own stream (``row_offset``)."""
    prompts = reference()["prompts"]
    eos = None
    if with_eos:  # a token of row 0's first canvas that row 1 never decodes
        plain = batch_decoders().generate(prompts)
        eos = next(t for t in plain.generated[0, :4].tolist() if t not in plain.generated[1].tolist())
    together = batch_decoders(eos).generate(prompts)
    for row, prompt in enumerate(prompts):
        alone = batch_decoders(eos).generate([prompt], row_offset=row)
        length = int(alone.generated_lengths[0])
        assert int(together.generated_lengths[row]) == length
        assert together.generated[row, :length].tolist() == alone.generated[0, :length].tolist()
        assert int(together.nfe[row]) == int(alone.nfe[0])
    if with_eos:
        assert together.generated_lengths.tolist()[0] <= 4 < together.generated_lengths.tolist()[1]
        assert int(together.nfe[0]) < int(together.nfe[1])


def test_a_canvas_streams_only_when_it_is_final():
    """Until a canvas ends the sequence holds the placeholder at its columns; the block
    callback then receives its final tokens, once."""
    (run,) = [run for run in single_runs() if run["name"] == "generate_eb3.0_stop_p0"]
    blocks = []
    decoder = decoder_for(run)
    from dloom.decode.session import DecodeSession

    session = DecodeSession(decoder, on_block=lambda record: blocks.append(record.tokens.clone()))
    session.admit([run["prompt"]])
    steps = 0
    while session.size:
        before = session.x[0, len(run["prompt"]):].clone() if session.forward is not None else None
        session.step()
        steps += 1
        if before is not None and session.size:
            after = session.x[0, len(run["prompt"]):]
            assert torch.equal(after[before != 0], before[before != 0])
            assert int((after != 0).sum()) % 8 == 0  # whole canvases only
    assert torch.cat(blocks, dim=-1).flatten().tolist() == run["generated"]
    assert steps == run["denoising_steps"]


def test_strategies_without_the_uniform_kernel_are_refused_naming_both():
    for strategy in ("quota", "threshold", "frechet", "spiffy", "failfast", "joint_threshold"):
        with pytest.raises(ConfigurationError, match=f"strategy '{strategy}' supports .* not the model's 'uniform' kernel"):
            DiffusionDecoder(adapter(), strategy, gen_length=16)


def test_a_recording_cache_and_static_shapes_are_refused():
    decoder = DiffusionDecoder(adapter(), "entropy_bound", gen_length=16, steps=4, cache="prefix", seed=0)
    with pytest.raises(ConfigurationError, match="cache 'prefix'.*allowed: cache='none'"):
        decoder.generate([[5, 6, 7]])
    static = DiffusionDecoder(adapter(), "entropy_bound", gen_length=16, steps=4, static_shapes=True, seed=0)
    with pytest.raises(ConfigurationError, match="static_shapes.*allowed: static_shapes=False"):
        static.generate([[5, 6, 7]])


def test_the_step_budget_defaults_to_the_generation_config():
    model = dataclasses.replace(adapter(), generation={"max_denoising_steps": 3})
    assert DiffusionDecoder(model, "entropy_bound", gen_length=16).steps == 6
    assert DiffusionDecoder(adapter(), "entropy_bound", gen_length=16).steps == 96  # transformers' 48 per canvas


@pytest.mark.parametrize(
    "values, match",
    [
        ({"t_min": 0.8, "t_max": 0.4}, "allowed: 0 < t_min < t_max"),
        ({"t_min": 0.0}, "allowed: 0 < t_min < t_max"),
        ({"stability_threshold": -1}, "stability_threshold is -1; allowed: an int >= 0"),
        ({"confidence_threshold": 0.0}, "confidence_threshold is 0.0; allowed: > 0"),
    ],
)
def test_bad_settings_are_refused(values, match):
    with pytest.raises(ConfigurationError, match=match):
        UniformSettings.from_generation({"t_min": None, **values})


def test_the_command_line_decodes_it_with_the_entropy_bound(tmp_path):
    """``dloom generate --strategy entropy_bound --param gamma=... --seed ...`` on the
    checkpoint as it is: the tokens of ``generate`` with the same seed, canvas length, schedule
    and step budget (transformers' defaults but 8 steps, set in the generation config)."""
    (run,) = [run for run in single_runs() if run["name"] == "generate_eb0.1_p0"]
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, checkpoint)
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps({**generation, "max_denoising_steps": 8}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": run["prompt"]}) + "\n")
    result = CliRunner().invoke(app, [
        "generate", "--model", str(checkpoint), "--prompts", str(prompts), "--strategy", "entropy_bound",
        "--param", "gamma=0.1", "--seed", str(run["seed"]), "--gen-length", "16", "--json",
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["tokens"] == run["generated"]


def test_a_row_joining_a_running_batch_decodes_as_it_would_alone():
    """Continuous batching: a longer prompt joins after three steps of another (the batch
    widens); each row's tokens and forwards are those of decoding it alone from its stream."""
    from dloom.decode.session import DecodeSession

    first, second = reference()["prompts"]
    decoder = batch_decoders()
    session = DecodeSession(decoder)
    session.admit([first], row_offset=0)
    finished = {}
    for _ in range(3):
        done = session.step()
        assert done is None
    session.admit([second], row_offset=1)
    while session.size:
        done = session.step()
        if done is not None:
            for row, lengths, nfe, tokens in zip(done.rows.tolist(), done.lengths.tolist(), done.nfe.tolist(),
                                                 done.token_lists()):
                finished[row] = (tokens[:lengths], nfe)
    for row, prompt in enumerate((first, second)):
        alone = batch_decoders().generate([prompt], row_offset=row)
        length = int(alone.generated_lengths[0])
        assert finished[row] == (alone.generated[0, :length].tolist(), int(alone.nfe[0]))


def test_a_cancelled_row_leaves_the_others_as_they_would_be_alone():
    from dloom.decode.session import DecodeSession

    prompts = reference()["prompts"]
    session = DecodeSession(batch_decoders())
    session.admit(prompts)
    for _ in range(3):
        session.step()
    session.cancel([0])
    results = []
    while session.size:
        done = session.step()
        if done is not None:
            results.append((done.rows.tolist(), done.token_lists(), done.nfe.tolist()))
    alone = batch_decoders().generate([prompts[1]], row_offset=1)
    length = int(alone.generated_lengths[0])
    assert results == [([1], [alone.generated[0, :length].tolist()], alone.nfe.tolist())]


def test_gamma_defaults_to_the_generation_configs_entropy_bound():
    """transformers saves the sampler config as a dict; its ``entropy_bound`` is ``gamma``'s
    default for the model, a given ``gamma`` wins, and a bad one is refused."""
    sampler = {"entropy_bound": 3.0, "_cls_name": "EntropyBoundSamplerConfig"}
    model = dataclasses.replace(adapter(), generation={"sampler_config": sampler})
    params = lambda decoder: decoder.composition.params()["entropy_bound"]  # noqa: E731
    assert params(DiffusionDecoder(model, "entropy_bound", gen_length=16))["gamma"] == 3.0
    assert params(DiffusionDecoder(model, "entropy_bound", gen_length=16, gamma=0.2))["gamma"] == 0.2
    assert params(DiffusionDecoder(adapter(), "entropy_bound", gen_length=16))["gamma"] == 0.1
    bad = dataclasses.replace(adapter(), generation={"sampler_config": {"entropy_bound": -1.0}})
    with pytest.raises(ConfigurationError, match="gamma"):
        DiffusionDecoder(bad, "entropy_bound", gen_length=16)
