"""Token-to-token editing rows (``dloom_training.edit_rows``, ``dllm_loss``'s ``edit_*``): the
corrupted positions hold wrong tokens, the labels are the right tokens, the prompt is never
corrupted, and the wrong tokens come from the model's own drafts or from uniform noise."""

from __future__ import annotations

import pytest
import torch

from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import Example
from dloom_training.codec import CHARACTERS
from dloom_training.edit_rows import (
    draft_edits,
    noise_edits,
    threshold_draft,
    wrong_tokens,
)
from dloom_training.losses import dllm_loss
from dloom_training.rows import answer_region, encode_prompts

G, K = 32, 8  # a region of four blocks of 8
BATCH = [Example("copy", f"copy {i:02d} abc", f"{i:02d} abc defg hij") for i in range(12)]


class _Drafter(torch.nn.Module):
    """A stand-in dLLM (unshifted) that predicts ``draft`` at every region position, surely
    (logit 10 against -10), and records the ``input_ids`` of every call."""

    def __init__(self, draft: torch.Tensor) -> None:
        super().__init__()
        self.draft = draft
        self.calls: list[torch.Tensor] = []
        self.bias = torch.nn.Parameter(torch.zeros(()))  # something for the loss to reach

    def forward(self, input_ids, attention_mask, position_ids):
        self.calls.append(input_ids.clone())
        logits = torch.full((*input_ids.shape, CHARACTERS.size), -10.0)
        region = logits[:, -G:]
        region.scatter_(-1, self.draft[: len(input_ids), :, None].expand(len(input_ids), G, 1), 10.0)
        return type("Out", (), {"logits": logits + self.bias})()


def _answers(batch=BATCH):
    return answer_region([e.answer for e in batch], G, CHARACTERS)


def _wrong_everywhere(right: torch.Tensor) -> torch.Tensor:
    """A draft that is wrong at every even position (the next character id), right elsewhere."""
    shifted = torch.where(right + 1 == tok.MASK_ID, right + 2, right + 1) % CHARACTERS.size
    shifted = torch.where((shifted == tok.PAD_ID) | (shifted == tok.MASK_ID), right + 3, shifted)
    return torch.where(torch.arange(G) % 2 == 0, shifted, right)


def test_wrong_tokens_are_never_the_right_one_nor_pad_or_mask_and_cover_the_vocabulary():
    right = torch.randint(3, CHARACTERS.size, (4000,), generator=torch.Generator().manual_seed(0))
    right[:50] = tok.EOS_ID
    wrong = wrong_tokens(right, CHARACTERS.size, torch.Generator().manual_seed(1))
    assert (wrong != right).all()
    assert not ((wrong == tok.PAD_ID) | (wrong == tok.MASK_ID)).any()
    assert set(wrong.tolist()) == set(range(CHARACTERS.size)) - {tok.PAD_ID, tok.MASK_ID}


def test_noise_edits_replace_filled_block_positions_with_wrong_tokens_and_keep_the_labels():
    gen = torch.Generator().manual_seed(0)
    target = _answers()
    current = torch.arange(len(target)) % (G // K)
    block = (torch.arange(G) // K)[None, :] == current[:, None]
    masked = block & (torch.rand(target.shape, generator=gen) < 0.5)
    masked[0] = block[0]  # a row with nothing filled: one position is filled and replaced
    lengths = torch.full((len(target),), 9)
    edits = noise_edits(target, masked, block, lengths, 0.3, CHARACTERS.size, gen)
    assert torch.equal(edits.target, target) and torch.equal(edits.lengths, lengths)  # the labels: the answer
    assert (edits.corrupted.sum(-1) >= 1).all()  # at least one wrong token a row
    assert not (edits.corrupted & ~block).any() and not (edits.corrupted & edits.masked).any()
    assert (edits.shown[edits.corrupted] != target[edits.corrupted]).all()
    assert torch.equal(edits.shown[~edits.corrupted], target[~edits.corrupted])
    assert torch.equal(edits.masked[1:], masked[1:]) and int((masked[0] & ~edits.masked[0]).sum()) == 1
    many = noise_edits(target, masked, block, lengths, 1.0, CHARACTERS.size, gen).corrupted.sum()
    assert int(many) > int(edits.corrupted.sum())  # a higher rate replaces more


def test_a_threshold_draft_fills_the_whole_block_with_the_model_s_tokens():
    target = _answers()
    draft = _wrong_everywhere(target)
    model = _Drafter(draft)
    prompt_ids, prompt_mask = encode_prompts([e.prompt for e in BATCH])
    current = torch.arange(len(target)) % (G // K)
    state = threshold_draft(model, prompt_ids, prompt_mask, target, current, K, torch.full((len(target),), 0.5))
    block_of = torch.arange(G) // K
    for row in range(len(target)):
        inside = block_of == current[row]
        assert torch.equal(state[row, inside], draft[row, inside])  # its own tokens, wrong ones too
        assert torch.equal(state[row, block_of < current[row]], target[row, block_of < current[row]])
        assert (state[row, block_of > current[row]] == tok.MASK_ID).all()


def test_draft_edits_show_the_draft_s_wrong_tokens_and_label_them_with_the_answer():
    target = _answers()
    model = _Drafter(_wrong_everywhere(target))
    prompt_ids, prompt_mask = encode_prompts([e.prompt for e in BATCH])
    current = torch.arange(len(target)) % (G // K)
    block = (torch.arange(G) // K)[None, :] == current[:, None]
    masked = block & (torch.arange(G) % K >= 5)  # the block's last three positions stay masked
    gen = torch.Generator().manual_seed(0)
    edits = draft_edits(model, BATCH, prompt_ids, prompt_mask, target, masked, current, K,
                        torch.full((len(target),), 9), torch.full((len(target),), 0.3), gen, CHARACTERS)
    even = (torch.arange(G) % 2 == 0)[None, :]
    assert torch.equal(edits.corrupted, block & ~masked & even)  # the draft's wrong tokens, where shown
    assert torch.equal(edits.target, target) and torch.equal(edits.masked, masked)
    assert (edits.shown[edits.corrupted] != target[edits.corrupted]).all()
    assert torch.equal(edits.shown[~edits.corrupted], target[~edits.corrupted])


@pytest.mark.parametrize("draft_share", [0.0, 1.0])
def test_edit_rows_in_the_loss_show_wrong_tokens_score_the_right_ones_and_never_touch_the_prompt(
    draft_share, monkeypatch
):
    from dloom_training import losses

    target = _answers()
    model = _Drafter(_wrong_everywhere(target))
    scored_targets = []
    cross_entropy = torch.nn.functional.cross_entropy
    monkeypatch.setattr(losses.F, "cross_entropy",
                        lambda *a, **k: scored_targets.append(a[1]) or cross_entropy(*a, **k))
    prompt_ids, _ = encode_prompts([e.prompt for e in BATCH])
    loss = dllm_loss(model, BATCH, 0, torch.Generator().manual_seed(3), 1.0, 1.0, G, K, loss_mean="row",
                     edit_share=1.0, edit_draft_share=draft_share, edit_rate=0.5)
    assert torch.isfinite(loss)
    shown = model.calls[-1]  # the scored forward: every row is an edit row
    p = prompt_ids.shape[1]
    assert torch.equal(shown[:, :p], prompt_ids)  # the prompt, never corrupted
    region = shown[:, p:]
    wrong = (region != tok.MASK_ID) & (region != target)
    assert wrong.any(-1).sum() >= len(BATCH) // 2  # wrong tokens shown in the rows
    block_of = torch.arange(G) // K
    current = block_of[(region == tok.MASK_ID).int().argmax(-1)]  # masks in the drawn block, or after it
    drawn = torch.stack([block_of == c for c in current.tolist()])
    assert not (wrong & (block_of[None, :] < current[:, None])).any()  # earlier blocks stay the answer
    # the whole drawn block is scored, against the answer: wrong tokens restored, right ones kept
    assert torch.equal(scored_targets[-1], target[drawn])


def test_no_edit_share_leaves_the_loss_as_it_was():
    model = _Drafter(_answers())
    args = (model, BATCH, 0)
    plain = dllm_loss(*args, torch.Generator().manual_seed(4), 1.0, 1.0, G, K)
    zero = dllm_loss(*args, torch.Generator().manual_seed(4), 1.0, 1.0, G, K, edit_share=0.0,
                     edit_draft_share=0.0)
    assert torch.equal(plain, zero)


@pytest.mark.parametrize(("options", "message"), [
    ({"edit_share": 0.5, "masks": "uniform"}, "edit_share 0.5 needs block masks"),
    ({"edit_share": 0.6, "decoder_share": 0.5}, "their sum must be at most 1"),
    ({"edit_draft_share": 0.5}, "edit_draft_share 0.5 is a share of the edit rows: it needs an edit_share"),
    ({"edit_share": 0.5, "edit_taus": (0.5, 1.0)}, r"edit_taus \[0.5, 1.0\] are thresholds"),
    ({"edit_share": 0.5, "edit_rate": 0.0}, r"edit_rate 0.0 .* must be in \(0, 1\]"),
])
def test_bad_edit_options_are_refused_before_training(options, message, tmp_path):
    from dloom_training.run import train_one

    options = {"masks": "block", **options}
    with pytest.raises(ValueError, match=message):
        train_one("long-dllm-words-edit", None, 1, 0, tmp_path, 4, **options)
    assert not (tmp_path / "long-dllm-words-edit").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--edit-share", "0.5", "--edit-rate", "2"], "--edit-rate is the largest share"),
    (["--monitor-tau", "1.5"], "--monitor-tau is a threshold: it must be in (0, 1), got 1.5"),
    (["--monitor-every", "0"], "--monitor-every must be at least 1, got 0"),
])
def test_bad_edit_and_monitor_options_are_named_on_the_command_line(argv, message, capsys):
    from dloom_training.train import main

    with pytest.raises(SystemExit):
        main(["--model", "long-dllm-words-edit", "--masks", "block", "--steps", "1", *argv])
    assert message in capsys.readouterr().err


def test_resuming_an_unfinished_edit_run_keeps_its_edit_and_monitor_options(tmp_path):
    import json

    from dloom_training.run import plan_run

    record = {"seed": 31, "pad_weight": 1.0, "t_max": 1.0, "init_from": None, "train_weights": {"chain": 2.0},
              "peak_lr": 1e-4, "budget_seconds": 600.0, "total_steps": None, "steps": 33, "train_seconds": 300.0,
              "history": [], "loss_curve": [], "monitor_curve": [], "monitor_threshold_curve": [[30, 0.9, 12.0, {}]],
              "masks": "block", "edit_share": 0.4, "edit_draft_share": 0.6, "edit_taus": [0.3, 0.5], "edit_rate": 0.2,
              "monitor_n": 100, "monitor_tau": 0.9, "monitor_every": 100, "finished": False}
    (tmp_path / "progress.json").write_text(json.dumps(record))
    given = {"pad_weight": 1.0, "t_max": 1.0, "edit_rate": 0.25}
    plan = plan_run("long-dllm-words-edit", None, None, 0, tmp_path, True, None, None, given, None, None)
    plan.check()
    rows = plan.rows
    assert (rows.edit_share, rows.edit_draft_share, rows.edit_taus, rows.edit_rate) == (0.4, 0.6, (0.3, 0.5), 0.25)
    assert (plan.monitor_n, plan.monitor_tau, plan.monitor_every, plan.start_step) == (100, 0.9, 100, 33)
    assert plan.curves["monitor_threshold_curve"] == [[30, 0.9, 12.0, {}]]


def test_a_model_trained_to_edit_names_the_revisable_kernel():
    """``long-dllm-words-edit``'s config names the revisable kernel, so dloom offers its
    editing rules on it; the model it starts from keeps the absorbing one."""
    from dloom_training.models import build_config

    assert build_config("long-dllm-words-edit").dloom["kernel"] == "revisable"
    assert "kernel" not in build_config("long-dllm-words").dloom
