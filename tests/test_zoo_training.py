"""The zoo's training losses (``dloom.zoo.train``): what each position of the loss weighs."""

from __future__ import annotations

import pytest
import torch

from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import GEN_LENGTH, Example
from dloom.zoo.train import build_model, dllm_loss

BATCH = [Example("copy", "copy ab cd efg", "ab cd efg"), Example("sort", "sort 93027185", "01235789")]


class _Fixed(torch.nn.Module):
    """A stand-in model that predicts ``<eos>`` at every position (logit 10 against -10)."""

    def forward(self, input_ids, attention_mask, position_ids):
        logits = torch.full((*input_ids.shape, len(tok.vocab())), -10.0)
        logits[..., tok.EOS_ID] = 10.0
        return type("Out", (), {"logits": logits})()


def _loss(model, pad_weight):
    return dllm_loss(model, BATCH, 0, torch.Generator().manual_seed(0), pad_weight)


def test_pad_weight_one_is_the_plain_mean_over_masked_positions(monkeypatch):
    from dloom.zoo import train

    per_position = []
    cross_entropy = torch.nn.functional.cross_entropy

    def recording_cross_entropy(*args, **kwargs):
        losses = cross_entropy(*args, **kwargs)
        per_position.append(losses.detach())
        return losses

    monkeypatch.setattr(train.F, "cross_entropy", recording_cross_entropy)
    torch.manual_seed(0)
    loss = _loss(build_model("toy-dllm"), 1.0)
    assert loss.item() == pytest.approx(per_position[0].mean().item())  # LLaDA's plain mean


def test_lower_pad_weight_shifts_the_loss_to_the_answer_tokens():
    # The stand-in predicts <eos> everywhere: right on the padding, wrong on the answer. A
    # lower pad weight must raise the mean loss towards the answer tokens' loss.
    model = _Fixed()
    plain, weighted, tiny = _loss(model, 1.0), _loss(model, 0.2), _loss(model, 1e-6)
    assert plain < weighted < tiny
    # With the padding (almost) ignored, the loss is that of the masked answer positions
    # (20 nats on each, all wrong) and first <eos>s (~0): most of them are answer positions.
    assert tiny.item() > 10.0 > plain.item()


class _Recording(_Fixed):
    """``_Fixed`` that also keeps the ``input_ids`` it was given."""

    def forward(self, input_ids, attention_mask, position_ids):
        self.input_ids = input_ids
        return super().forward(input_ids, attention_mask, position_ids)


def _masked_fraction(t_max: float) -> float:
    model = _Recording()
    batch = [Example("copy", f"copy {i:02d}", "abcdefgh" * 3) for i in range(256)]
    dllm_loss(model, batch, 0, torch.Generator().manual_seed(0), 1.0, t_max)
    return (model.input_ids[:, -GEN_LENGTH:] == tok.MASK_ID).float().mean().item()


def test_t_max_caps_the_mask_ratio():
    # t is stratified over [0.02, t_max]: the mean masked share of the 32-position answer
    # region is about (0.02 + t_max) / 2.
    assert _masked_fraction(1.0) == pytest.approx(0.51, abs=0.03)
    assert _masked_fraction(0.3) == pytest.approx(0.16, abs=0.03)


@pytest.mark.parametrize("bad", ["0", "0.01", "1.5"])
def test_t_max_outside_its_range_is_refused(bad, capsys):
    from dloom.zoo.train import main

    with pytest.raises(SystemExit):
        main(["--model", "toy-dllm", "--t-max", bad])
    assert f"--t-max must be in (0.02, 1], got {float(bad)}" in capsys.readouterr().err


def test_reevaluate_replaces_the_accuracy_and_keeps_the_training_record(tmp_path):
    import json

    from dloom.zoo.train import main, save_model

    torch.manual_seed(0)
    save_model(build_model("toy-ar-small"), tmp_path / "toy-ar-small")
    record = {"model": "toy-ar-small", "steps": 123, "overall": 0.99, "per_family": {"add": 0.99}, "n": 350}
    (tmp_path / "toy-ar-small" / "eval.json").write_text(json.dumps(record))
    main(["--model", "toy-ar-small", "--eval-only", "--out", str(tmp_path), "--eval-n", "7", "--threads", "1"])
    updated = json.loads((tmp_path / "toy-ar-small" / "eval.json").read_text())
    assert updated["steps"] == 123 and updated["n"] == 7  # the record kept, the figures new
    assert set(updated["per_family"]) == {"add", "sort", "reverse", "copy", "lookup", "code", "story"}
    assert updated["overall"] < 0.5  # an untrained model, not the 0.99 written before
    assert "reevaluated" in updated


# --- a dLLM initialised from a causal checkpoint (Dream's recipe) ---------------------------
def _saved(tmp_path, name):
    from dloom.zoo.train import save_model

    torch.manual_seed(0)
    model = build_model(name).eval()
    save_model(model, tmp_path / name)
    return model, tmp_path / name


def _forward(model, ids):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1])[None]).logits


def test_dllm_from_ar_keeps_the_weights_and_makes_attention_bidirectional(tmp_path):
    from dloom.zoo.train import dllm_from_ar

    ar, path = _saved(tmp_path, "toy-dllm-ar")
    dllm = dllm_from_ar(path, "toy-dllm").eval()
    assert dllm.config.is_causal is False
    assert dllm.config.dloom == {**ar.config.dloom, "kind": "dllm", "attention": "bidirectional", "shift": True}
    ar_weights = {k: v.half().float() for k, v in ar.state_dict().items()}  # saved as float16
    assert all(torch.equal(v, ar_weights[k]) for k, v in dllm.state_dict().items())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    changed = ids.clone()
    changed[0, -1] = 10
    with torch.no_grad():
        # a later token changes the first position's output only with bidirectional attention
        assert not torch.allclose(_forward(dllm, ids)[0, 0], _forward(dllm, changed)[0, 0])
        assert torch.allclose(_forward(ar, ids)[0, 0], _forward(ar, changed)[0, 0], atol=1e-5)


@pytest.mark.parametrize("source", ["toy-dllm", "toy-ar-small"])
def test_dllm_from_ar_refuses_a_non_causal_or_differently_shaped_checkpoint(tmp_path, source):
    from dloom.zoo.train import dllm_from_ar

    _, path = _saved(tmp_path, source)
    expected = "expected a causal zoo checkpoint" if source == "toy-dllm" else "architecture .* differs"
    with pytest.raises(ValueError, match=expected):
        dllm_from_ar(path, "toy-dllm")


def test_a_shifted_dllm_is_scored_on_the_columns_before_the_answer():
    from dloom.zoo.train import region_logits

    logits = torch.arange(40.0).reshape(1, 40, 1)  # prompt of 8 columns, then 32 answer columns
    plain, shifted = _Fixed(), _Fixed()
    shifted.config = type("Config", (), {"dloom": {"shift": True}})()
    assert region_logits(plain, logits, 8)[0, :, 0].tolist() == list(range(8, 40))
    assert region_logits(shifted, logits, 8)[0, :, 0].tolist() == list(range(7, 39))


@pytest.mark.parametrize("argv", [["--model", "toy-ar"], ["--model", "toy-dllm", "--resume"]])
def test_init_from_is_refused_outside_a_new_dllm(argv, tmp_path, capsys):
    from dloom.zoo.train import main

    with pytest.raises(SystemExit):
        main([*argv, "--init-from", str(tmp_path)])
    assert "--init-from starts a new toy-dllm" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "toy-ar", "--resume"], "no checkpoint to resume: .*toy-ar"),
        (["--model", "all", "--eval-only"], "no checkpoint to evaluate: .*toy-dllm, .*toy-ar, .*toy-ar-small"),
        (["--model", "toy-dllm", "--init-from", "nowhere"], "--init-from nowhere: no such checkpoint directory"),
        (["--model", "toy-ar", "--minutes", "0"], "--minutes must be > 0, got 0.0"),
        (["--model", "toy-ar", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["--model", "all", "--resume"], "no checkpoint to resume: .*toy-dllm, .*toy-ar, .*toy-ar-small$"),
    ],
)
def test_a_missing_checkpoint_or_a_bad_budget_is_named_before_any_training(argv, message, tmp_path, capsys):
    import re

    from dloom.zoo.train import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--steps", "1", *argv])
    assert re.search(message, capsys.readouterr().err.strip())


def test_model_all_trains_the_dllm_from_the_causal_model_trained_before_it(tmp_path):
    import json

    from dloom.zoo.train import main

    out, stage = tmp_path / "zoo", tmp_path / "stage"
    main(["--model", "all", "--steps", "2", "--out", str(out), "--init-out", str(stage), "--eval-n", "7",
          "--threads", "1", "--seed", "5"])
    assert sorted(p.name for p in out.iterdir()) == ["toy-ar", "toy-ar-small", "toy-dllm"]  # the shipped three
    records = {p.name: json.loads((p / "eval.json").read_text()) for p in [*out.iterdir(), stage / "toy-dllm-ar"]}
    dllm = records["toy-dllm"]
    assert dllm["init_from"] == str(stage / "toy-dllm-ar") and dllm["seed"] == 6  # new data for the second stage
    assert [(run["model"], run["seed"]) for run in dllm["history"]] == [("toy-dllm-ar", 5)]
    assert dllm["peak_lr"] == 1e-3  # half of toy-dllm's from-scratch peak, as it starts from a checkpoint
    assert json.loads((out / "toy-dllm" / "config.json").read_text())["dloom"]["shift"] is True
    assert all(records[name]["init_from"] is None for name in ("toy-dllm-ar", "toy-ar", "toy-ar-small"))


@pytest.mark.parametrize(
    ("argv", "budgets"),
    [
        (["--model", "all"], {"toy-dllm-ar": 60, "toy-dllm": 75, "toy-ar": 150, "toy-ar-small": 15}),
        (["--model", "all", "--minutes", "10"], {"toy-dllm-ar": 2, "toy-dllm": 2.5, "toy-ar": 5, "toy-ar-small": 0.5}),
        (["--model", "toy-ar"], {"toy-ar": 150}),
        (["--model", "toy-ar", "--minutes", "10"], {"toy-ar": 10}),
    ],
)
def test_the_time_budget_is_split_by_the_recipe_shares(argv, budgets, monkeypatch, tmp_path):
    from dloom.zoo import train

    calls = {}
    monkeypatch.setattr(train, "train_one", lambda name, minutes, *rest: calls.setdefault(name, minutes))
    train.main([*argv, "--out", str(tmp_path)])
    assert calls == pytest.approx(budgets)
