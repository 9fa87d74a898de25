"""The zoo's training losses (``dloom.zoo.train``): what each position of the loss weighs."""

from __future__ import annotations

import pytest
import torch

from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import Example
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
