"""The zoo's training losses (``dloom_training.train``): what each position of the loss weighs."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import GEN_LENGTH, Example
from dloom_training.codec import CHARACTERS
from dloom_training.losses import dllm_loss
from dloom_training.models import build_model

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
    from dloom_training import losses

    per_position = []
    cross_entropy = torch.nn.functional.cross_entropy

    def recording_cross_entropy(*args, **kwargs):
        losses = cross_entropy(*args, **kwargs)
        per_position.append(losses.detach())
        return losses

    monkeypatch.setattr(losses.F, "cross_entropy", recording_cross_entropy)
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


def test_block_masks_keep_earlier_blocks_clean_mask_later_ones_and_score_one_block(monkeypatch):
    from dloom_training import losses

    scored = []
    cross_entropy = torch.nn.functional.cross_entropy
    monkeypatch.setattr(losses.F, "cross_entropy", lambda *a, **k: scored.append(len(a[1])) or cross_entropy(*a, **k))
    model = _Recording()
    batch = [Example("copy", f"copy {i:02d}", "abcdefgh" * 3) for i in range(64)]
    dllm_loss(model, batch, 0, torch.Generator().manual_seed(0), 1.0, 1.0, GEN_LENGTH, 8)
    masked = (model.input_ids[:, -GEN_LENGTH:] == tok.MASK_ID).view(64, 4, 8)
    per_block = masked.sum(-1)
    current = (per_block > 0).int().argmax(-1)  # the drawn block: the first with a mask (it has one)
    blocks = torch.arange(4)[None, :]
    assert (per_block[blocks < current[:, None]] == 0).all()  # earlier blocks: clean
    assert (per_block[blocks > current[:, None]] == 8).all()  # later blocks: all masked
    assert scored == [int(per_block.gather(1, current[:, None]).sum())]  # the loss: the drawn block only
    assert set(current.tolist()) == {0, 1, 2, 3}  # every block is drawn
    partly = per_block.gather(1, current[:, None])[:, 0]
    assert 1 < partly.float().mean() < 7  # masked with probability t over [0.02, 1]


def test_prefix_rows_mask_their_block_from_a_cut_to_its_end():
    model = _Recording()
    batch = [Example("copy", f"copy {i:02d}", "abcdefgh" * 3) for i in range(64)]
    dllm_loss(model, batch, 0, torch.Generator().manual_seed(0), 1.0, 1.0, GEN_LENGTH, 8, 1.0)
    masked = (model.input_ids[:, -GEN_LENGTH:] == tok.MASK_ID).view(64, 4, 8)
    current = (masked.sum(-1) > 0).int().argmax(-1)
    block = masked[torch.arange(64), current].int()  # (64, 8): the drawn block of each row
    cut = 8 - block.sum(-1)
    assert torch.equal(block, (torch.arange(8)[None, :] >= cut[:, None]).int())  # a suffix, from the cut on
    assert len(set(cut.tolist())) > 4  # the cut varies


class _Calls(torch.nn.Module):
    """Wraps a model and keeps the ``input_ids`` of every call."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.calls = model, model.config, []

    def forward(self, input_ids, attention_mask, position_ids):
        self.calls.append(input_ids.clone())
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_decoder_rows_leave_masked_the_block_positions_the_model_is_least_sure_of():
    """A decoder row reveals, with their answer, the drawn block's positions the model
    itself ranks surest with the block masked, and masks the rest: every revealed position's
    confidence is at least every masked one's (a variant revealing at random, or the least
    sure first, breaks it)."""
    from dloom_training.rows import encode_prompts, position_ids, region_logits

    torch.manual_seed(0)
    model = _Calls(build_model("toy-dllm"))
    rng = torch.Generator().manual_seed(1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    answers = ["".join(letters[i] for i in torch.randint(26, (24,), generator=rng)) for _ in range(32)]
    batch = [Example("copy", f"copy {a}", a) for a in answers]
    dllm_loss(model, batch, 0, torch.Generator().manual_seed(0), 1.0, 1.0, GEN_LENGTH, 8, 0.0, 0.0, "token", 1.0)
    probe, scored = model.calls  # one forward without gradient, then the loss's
    assert len(probe) == 32  # every row is a decoder row
    region = scored[:, -GEN_LENGTH:]
    masked = (region == tok.MASK_ID).view(32, 4, 8)
    current = (masked.sum(-1) > 0).int().argmax(-1)
    assert torch.equal(probe[:, -GEN_LENGTH:] == tok.MASK_ID,  # the probe: the drawn block on, all masked
                       (torch.arange(GEN_LENGTH)[None, :] // 8 >= current[:, None]))
    prompt_ids, prompt_mask = encode_prompts([e.prompt for e in batch])
    attention = torch.cat([prompt_mask, torch.ones(32, GEN_LENGTH, dtype=prompt_mask.dtype)], 1)
    with torch.no_grad():
        logits = region_logits(model, model.model(input_ids=probe, attention_mask=attention,
                                                  position_ids=position_ids(attention)).logits, prompt_ids.shape[1])
    logits[..., [tok.PAD_ID, tok.MASK_ID]] = -float("inf")
    confidence = logits.softmax(-1).amax(-1).view(32, 4, 8)[torch.arange(32), current]  # (32, 8)
    block_masked = masked[torch.arange(32), current]
    for row in range(32):
        kept, hidden = confidence[row][~block_masked[row]], confidence[row][block_masked[row]]
        assert len(hidden) >= 1
        if len(kept):
            assert kept.min() >= hidden.max()
    assert len(set(block_masked.sum(-1).tolist())) > 4  # how many are revealed varies over 0 .. 7
    clean = probe[:, -GEN_LENGTH:] != tok.MASK_ID
    assert torch.equal(region[clean], probe[:, -GEN_LENGTH:][clean])  # earlier blocks as before: clean


def test_decoder_share_zero_draws_nothing_more():
    """Without decoder rows the masks and the loss are exactly those of before (no extra draw)."""
    torch.manual_seed(0)
    model = build_model("toy-dllm")
    batch = [Example("copy", f"copy {i:02d} ab", "abcdefgh" * 3) for i in range(16)]
    args = (model, batch, 1)
    settings = (1.0, 1.0, GEN_LENGTH, 8, 0.3, 0.3, "row")
    without = dllm_loss(*args, torch.Generator().manual_seed(3), *settings)
    zero = dllm_loss(*args, torch.Generator().manual_seed(3), *settings, 0.0)
    some = dllm_loss(*args, torch.Generator().manual_seed(3), *settings, 0.5)
    assert zero.item() == without.item() and some.item() != without.item()


def test_causal_rows_are_the_causal_stage_s_loss(tmp_path):
    """Rows trained causally see only the tokens before each position: on a dLLM made from a
    causal model, an all-causal batch has that model's own loss (a bidirectional mask on
    those rows would let every position see its answer)."""
    from dloom_training.checkpoints import save_model
    from dloom_training.losses import ar_loss
    from dloom_training.models import dllm_from_ar

    torch.manual_seed(0)
    causal_model = build_model("toy-dllm-ar")
    save_model(causal_model, tmp_path / "stage")
    dllm = dllm_from_ar(tmp_path / "stage", "toy-dllm")
    expected = ar_loss(causal_model, BATCH, 0)
    loss = dllm_loss(dllm, BATCH, 0, torch.Generator().manual_seed(0), 1.0, 1.0, GEN_LENGTH, 8, 0.0, 1.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-3)
    mixed = dllm_loss(dllm, BATCH * 8, 0, torch.Generator().manual_seed(0), 1.0, 1.0, GEN_LENGTH, 8, 0.0, 0.5)
    assert mixed.item() > loss.item()  # plus the masked rows' mean


def test_the_row_mean_weighs_every_row_the_same():
    import torch.nn.functional as F

    from dloom_training.losses import _weighted_mean

    target = torch.zeros(2, 4, dtype=torch.long)
    logits = torch.zeros(2, 4, 3)
    logits[0, :, 0] = 4.0  # row 0 sure and right, row 1 unsure: their losses differ
    scored = torch.tensor([[True, False, False, False], [True, True, True, True]])  # 1 and 4 masked
    weight = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.5, 0.5]])
    ce = F.cross_entropy(logits.reshape(-1, 3), target.reshape(-1), reduction="none").reshape(2, 4)
    by_token = (ce[0, 0] + (ce[1] * weight[1]).sum()) / 4.0  # every scored position by its weight
    by_row = (ce[0, 0] + (ce[1] * weight[1]).sum() / 3.0) / 2  # each row's weighted mean, then rows
    assert _weighted_mean(logits, target, weight, scored).item() == pytest.approx(by_token.item())
    assert _weighted_mean(logits, target, weight, scored, by_row=True).item() == pytest.approx(by_row.item())
    assert by_row.item() != pytest.approx(by_token.item())


@pytest.mark.parametrize("share", ["prefix_share", "decoder_share"])
def test_a_block_share_without_block_masks_is_refused(share, tmp_path):
    from dloom_training.run import train_one

    with pytest.raises(ValueError, match=f"{share} 0.5 needs block masks, the run's are 'uniform'"):
        train_one("toy-dllm", None, 1, 0, tmp_path, 4, masks="uniform", **{share: 0.5})


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "toy-ar", "--masks", "block"], "--masks is a dLLM's training option"),
    (["--model", "toy-ar", "--prefix-share", "0.5"], "--prefix-share is a dLLM's training option"),
    (["--model", "toy-dllm", "--prefix-share", "1.5"], "--prefix-share must be in [0, 1], got 1.5"),
    (["--model", "toy-dllm", "--causal-share", "-0.1"], "--causal-share must be in [0, 1], got -0.1"),
    (["--model", "toy-ar", "--causal-share", "0.5"], "--causal-share is a dLLM's training option"),
    (["--model", "toy-ar", "--loss-mean", "row"], "--loss-mean is a dLLM's training option"),
    (["--model", "toy-ar", "--decoder-share", "0.5"], "--decoder-share is a dLLM's training option"),
    (["--model", "toy-dllm", "--decoder-share", "2"], "--decoder-share must be in [0, 1], got 2.0"),
    (["--model", "toy-ar", "--decoder-fill", "model"], "--decoder-fill is a dLLM's training option"),
    (["--model", "toy-dllm", "--prefix-share", "0.6", "--decoder-share", "0.5"],
     "--prefix-share 0.6 and --decoder-share 0.5 are shares of the same rows: their sum must be at most 1"),
])
def test_bad_mask_options_are_refused_before_training(argv, message, capsys):
    from dloom_training.train import main

    with pytest.raises(SystemExit):
        main([*argv, "--steps", "1"])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "0.01", "1.5"])
def test_t_max_outside_its_range_is_refused(bad, capsys):
    from dloom_training.train import main

    with pytest.raises(SystemExit):
        main(["--model", "toy-dllm", "--t-max", bad])
    assert f"--t-max must be in (0.02, 1], got {float(bad)}" in capsys.readouterr().err


def test_reevaluate_replaces_the_accuracy_and_keeps_the_training_record(tmp_path):
    import json

    from dloom_training.checkpoints import save_model
    from dloom_training.train import main

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
    from dloom_training.checkpoints import save_model

    torch.manual_seed(0)
    model = build_model(name).eval()
    save_model(model, tmp_path / name)
    return model, tmp_path / name


def _forward(model, ids):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1])[None]).logits


def test_dllm_from_ar_keeps_the_weights_and_makes_attention_bidirectional(tmp_path):
    from dloom_training.models import dllm_from_ar

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
    from dloom_training.models import dllm_from_ar

    _, path = _saved(tmp_path, source)
    expected = "must have shifted logits" if source == "toy-dllm" else "architecture .* differs"
    with pytest.raises(ValueError, match=expected):
        dllm_from_ar(path, "toy-dllm")


def test_a_shifted_dllm_is_scored_on_the_columns_before_the_answer():
    from dloom_training.rows import region_logits

    logits = torch.arange(40.0).reshape(1, 40, 1)  # prompt of 8 columns, then 32 answer columns
    plain, shifted = _Fixed(), _Fixed()
    shifted.config = type("Config", (), {"dloom": {"shift": True}})()
    assert region_logits(plain, logits, 8)[0, :, 0].tolist() == list(range(8, 40))
    assert region_logits(shifted, logits, 8)[0, :, 0].tolist() == list(range(7, 39))


@pytest.mark.parametrize("argv", [["--model", "toy-ar"], ["--model", "toy-dllm", "--resume"]])
def test_init_from_is_refused_outside_a_new_dllm(argv, tmp_path, capsys):
    from dloom_training.train import main

    with pytest.raises(SystemExit):
        main([*argv, "--init-from", str(tmp_path)])
    assert "--init-from starts a new dLLM: use it with --model toy-dllm or long-dllm" in capsys.readouterr().err


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

    from dloom_training.train import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--steps", "1", *argv])
    assert re.search(message, capsys.readouterr().err.strip())


def test_model_all_trains_the_dllm_from_the_causal_model_trained_before_it(tmp_path):
    import json

    from dloom_training.train import main

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
    from dloom_training import train

    calls = {}
    monkeypatch.setattr(train, "train_one", lambda name, minutes, *rest: calls.setdefault(name, minutes))
    train.main([*argv, "--out", str(tmp_path)])
    assert calls == pytest.approx(budgets)


# --- the long-answer workload: configs, block decoding, checkpoints and resuming ------------
def test_long_models_share_one_wide_vocabulary_and_have_the_issue_s_shape():
    from dloom.zoo import long_tasks
    from dloom_training.models import build_config, n_params
    from dloom_training.workloads import SPECS

    configs = {name: build_config(name) for name in ("long-dllm-ar", "long-dllm", "long-ar", "long-ar-small")}
    assert {c.vocab_size for c in configs.values()} == {len(long_tasks.ALPHABET) + 3}
    assert {c.max_position_embeddings for c in configs.values()} == {256}
    assert configs["long-dllm"].dloom == {"kind": "dllm", "attention": "bidirectional", "shift": False,
                                          "gen_length": 128, "block_length": 32}
    sizes = {name: n_params(build_model(name)) for name in configs}
    assert sizes["long-dllm-ar"] == sizes["long-dllm"]  # the causal stage has the dLLM's shape
    assert 2 <= sizes["long-ar"] / sizes["long-dllm"] <= 4  # the AR target
    assert sizes["long-ar-small"] < sizes["long-dllm"] / 2  # the drafter
    assert build_config("toy-dllm").dloom == {"kind": "dllm", "attention": "bidirectional", "shift": False,
                                              "gen_length": GEN_LENGTH}  # the toy zoo's, unchanged
    assert SPECS["toy-dllm"].workload.name == "short"


class _Ramp(torch.nn.Module):
    """A stand-in dLLM over a region of 8 in blocks of 4 whose confidence grows with the
    position (later positions surer), recording which positions each forward saw masked."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"dloom": {"gen_length": 8, "block_length": 4, "shift": False}})()
        self.masked = []

    def forward(self, input_ids, attention_mask, position_ids):
        self.masked.append((input_ids[0, -8:] == tok.MASK_ID).tolist())
        logits = torch.zeros((*input_ids.shape, len(tok.vocab())))
        logits[..., 5] = torch.arange(input_ids.shape[1], dtype=torch.float)  # peakier further right
        return type("Out", (), {"logits": logits})()


def test_block_decoding_finishes_each_block_before_the_next():
    from dloom_training.decoding import decode_dllm

    model = _Ramp()
    decode_dllm(model, ["copy ab"])
    committed = [[i for i in range(8) if before[i] and not after[i]]
                 for before, after in zip(model.masked, [*model.masked[1:], [False] * 8])]
    # Inside a block the surest (rightmost) position first; the second block only after the first.
    assert committed == [[3], [2], [1], [0], [7], [6], [5], [4]]


def test_trace_reports_each_commit_step_in_either_order():
    from dloom_training.decoding import trace_dllm
    from dloom_training.rows import encode_prompts

    by_confidence = trace_dllm(_Ramp(), ["copy ab", "copy b"])
    assert by_confidence.step.tolist() == [[3, 2, 1, 0, 7, 6, 5, 4]] * 2  # the surest (rightmost) first
    model = _Ramp()
    left_to_right = trace_dllm(model, ["copy ab"], order="left-to-right")
    assert left_to_right.step.tolist() == [list(range(8))]  # the leftmost masked position, whatever its confidence
    assert left_to_right.region.tolist() == [[5] * 8]  # each position committed to its argmax
    # each commit's max-probability: the ramp's logit c at its column against the logits 0 of
    # the other tokens (<pad> and the mask excluded), 1 / (1 + (V - 3) e^-c)
    width = encode_prompts(["copy ab"])[0].shape[1] + 8
    columns = torch.arange(width - 8, width, dtype=torch.float)
    expected = 1 / (1 + (len(tok.vocab()) - 3) * torch.exp(-columns))
    assert torch.allclose(left_to_right.confidence[0], expected)
    with pytest.raises(ValueError, match="order is 'random'; allowed: confidence, left-to-right"):
        trace_dllm(model, ["copy ab"], order="random")


def _tiny_long_spec(monkeypatch):
    """long-dllm-ar made tiny (one layer of 16, batches of 4) so a run takes seconds."""
    import dataclasses

    from dloom_training.workloads import LONG, SPECS, ModelSpec

    tiny = dataclasses.replace(LONG, batch=4, monitor_per_family=1)
    spec = ModelSpec("ar", hidden=16, layers=1, heads=2, ffn=32, share=0.1, workload=tiny)
    monkeypatch.setitem(SPECS, "long-dllm-ar", spec)


def _killed_after(batches, n):
    """A batch stream that stops the process (``KeyboardInterrupt``) after ``n`` batches."""

    def stream(*args):
        yield from itertools.islice(batches(*args), n)
        raise KeyboardInterrupt  # the process is stopped mid-run

    return stream


def test_an_interrupted_run_saves_checkpoints_and_resume_continues_it(monkeypatch, tmp_path):
    import json

    from dloom_training import run, train

    _tiny_long_spec(monkeypatch)
    batches = run.training_batches
    monkeypatch.setattr(run, "training_batches", _killed_after(batches, 5))
    argv = ["--model", "long-dllm-ar", "--out", str(tmp_path), "--threads", "1", "--eval-n", "4", "--seed", "3"]
    with pytest.raises(KeyboardInterrupt):
        train.main([*argv, "--steps", "12", "--checkpoint-minutes", "1e-9"])  # a checkpoint every step
    directory = tmp_path / "long-dllm-ar"
    saved = json.loads((directory / "progress.json").read_text())
    assert (saved["steps"], saved["finished"], saved["total_steps"]) == (5, False, 12)
    assert not (directory / "eval.json").exists() and not (directory / ".partial").exists()
    weights_at_5 = LlamaForCausalLM.from_pretrained(directory).state_dict()

    started = []
    monkeypatch.setattr(run, "training_batches", lambda *args: started.append(args) or batches(*args))
    train.main([*argv, "--resume"])  # its own budget, seed, lr and mix
    record = json.loads((directory / "eval.json").read_text())
    assert record["steps"] == 12 and record["seed"] == 3 and record["peak_lr"] == saved["peak_lr"]
    assert started[0][3] == 5  # new data, drawn from step 5 on
    assert [point[0] for point in record["loss_curve"]] == [1, 6]  # first step of each part
    assert json.loads((directory / "progress.json").read_text())["finished"] is True
    assert set(record["per_family"]) == {"chain", "word", "tale", "prog"}
    resumed = LlamaForCausalLM.from_pretrained(directory).state_dict()
    assert any(not torch.equal(v, weights_at_5[k]) for k, v in resumed.items())  # it trained on


def test_finish_ends_an_unfinished_run_where_it_stopped_and_evaluates_its_weights(monkeypatch, tmp_path, capsys):
    import json

    from dloom_training import evaluation, run, train
    from dloom_training.checkpoints import unfinished_run

    _tiny_long_spec(monkeypatch)
    monkeypatch.setattr(run, "training_batches", _killed_after(run.training_batches, 3))
    argv = ["--model", "long-dllm-ar", "--out", str(tmp_path), "--threads", "1", "--eval-n", "4"]
    with pytest.raises(KeyboardInterrupt):
        train.main([*argv, "--steps", "10", "--checkpoint-minutes", "1e-9"])
    directory = tmp_path / "long-dllm-ar"
    weights = (directory / "model.safetensors").read_bytes()
    evaluated = []
    evaluate = evaluation.evaluate
    monkeypatch.setattr(evaluation, "evaluate", lambda *args, **kw: evaluated.append(args) or evaluate(*args, **kw))
    train.main([*argv, "--finish"])
    record = json.loads((directory / "eval.json").read_text())
    assert (record["steps"], record["total_steps"], record["ended_early"]) == (3, 10, True)
    assert set(record["per_family"]) == {"chain", "word", "tale", "prog"} and len(evaluated) == 1
    assert len(evaluated[0][2]) == 4  # --eval-n held-out prompts
    assert (directory / "model.safetensors").read_bytes() == weights  # the weights are not touched
    assert unfinished_run(directory) is None  # --resume would start a new run from them
    with pytest.raises(SystemExit):  # nothing left to end
        train.main([*argv, "--finish"])
    assert f"--finish: no unfinished run in {directory}" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--resume"], ["--eval-only"]])
def test_finish_takes_one_model_and_no_other_mode(extra, tmp_path, capsys):
    from dloom_training.train import main

    with pytest.raises(SystemExit):
        main(["--model", "long-dllm", "--out", str(tmp_path), "--finish", *extra])
    assert "--finish ends one model's unfinished run" in capsys.readouterr().err


def test_a_continued_run_warms_up_to_its_scheduled_rate():
    from dloom_training.schedule import WARMUP, learning_rate

    scheduled = learning_rate(5_000, 0.5, 2e-3)
    assert learning_rate(5_000, 0.5, 2e-3, start=5_000) == pytest.approx(scheduled / WARMUP)
    assert learning_rate(5_000 + WARMUP, 0.5, 2e-3, start=5_000) == pytest.approx(scheduled)
    assert learning_rate(0, 0.0, 2e-3) == pytest.approx(2e-3 / WARMUP)  # a new run: as before


def test_weights_outside_the_model_s_workload_are_refused(capsys):
    from dloom_training.train import main

    with pytest.raises(SystemExit):
        main(["--model", "long-dllm-ar", "--weights", "add=2", "--steps", "1"])
    assert "--weights: add not in long-dllm-ar's workload (chain, word, tale, prog, text, sums)" in capsys.readouterr().err


def test_the_long_dllm_stage_starts_from_its_causal_stage(monkeypatch, tmp_path):
    import dataclasses
    import json

    from dloom_training import run, train
    from dloom_training.workloads import SPECS

    _tiny_long_spec(monkeypatch)
    monkeypatch.setitem(SPECS, "long-dllm", dataclasses.replace(SPECS["long-dllm-ar"], kind="dllm"))
    common = ["--out", str(tmp_path), "--threads", "1", "--eval-n", "4", "--steps", "2"]
    train.main(["--model", "long-dllm-ar", *common])
    blocks = []
    loss = run.dllm_loss
    monkeypatch.setattr(run, "dllm_loss", lambda *args, **kw: blocks.append(args[-12:-1]) or loss(*args, **kw))
    train.main(["--model", "long-dllm", "--init-from", str(tmp_path / "long-dllm-ar"), "--seed", "1",
                "--masks", "block", "--prefix-share", "0.5", "--causal-share", "0.25", "--loss-mean", "row",
                "--decoder-share", "0.25", "--decoder-fill", "model", "--decoder-rounds", "3",
                "--first-forward-share", "0.5", "--label-smoothing", "0.05", *common])
    record = json.loads((tmp_path / "long-dllm" / "eval.json").read_text())
    assert (record["masks"], record["prefix_share"], record["causal_share"], record["loss_mean"],
            record["decoder_share"], record["decoder_fill"], record["decoder_rounds"], record["decoder_taus"],
            record["first_forward_share"], record["own_earlier_share"], record["label_smoothing"]) == (
        "block", 0.5, 0.25, "row", 0.25, "model", 3, [0.9, 0.95], 0.5, 0.0, 0.05)
    # block-order masks over the workload's blocks of 32
    assert blocks == [(32, 0.5, 0.25, "row", 0.25, "model", 3, (0.9, 0.95), 0.5, 0.0, 0.05)] * 2
    assert [run["model"] for run in record["history"]] == ["long-dllm-ar"]
    assert set(record["per_family"]) == {"chain", "word", "tale", "prog"} and record["n"] == 4
    config = json.loads((tmp_path / "long-dllm" / "config.json").read_text())
    assert config["dloom"] == {"kind": "dllm", "attention": "bidirectional", "shift": True,
                               "gen_length": 128, "block_length": 32}
    assert config["vocab_size"] == 99 and config["is_causal"] is False


def test_the_word_workload_counts_its_region_in_word_tokens_and_every_answer_fits():
    import random

    from dloom.zoo import long_tasks
    from dloom_training.data import MAX_EXTRA_PAD
    from dloom_training.models import build_config, n_params
    from dloom_training.rows import answer_lengths, answer_region, encode_prompts
    from dloom_training.workloads import LONG_WORDS

    config = build_config("long-dllm-words")
    assert config.vocab_size == LONG_WORDS.codec.size == 3 + 96 + len(long_tasks.WORD_TOKENS)
    assert config.dloom == {"kind": "dllm", "attention": "bidirectional", "shift": False,
                            "gen_length": 64, "block_length": 16}
    assert n_params(build_model("long-dllm-words")) < 1.25 * n_params(build_model("long-dllm"))
    rng = random.Random(11)
    examples = [f.generate(rng) for f in (*long_tasks.FAMILIES.values(), long_tasks.SUMS) for _ in range(500)]
    region = answer_region([e.answer for e in examples], 64, LONG_WORDS.codec)  # raises if one does not fit
    lengths = answer_lengths(region)
    assert 40 < int(lengths.max()) < 64 and float(lengths.float().mean()) < 45
    assert all(LONG_WORDS.codec.decode(row) == e.answer for row, e in zip(region.tolist(), examples))
    prompts, _ = encode_prompts([e.prompt for e in examples], MAX_EXTRA_PAD, LONG_WORDS.codec)
    assert prompts.shape[1] + 64 <= config.max_position_embeddings
    with pytest.raises(ValueError, match="a region of 8 holds 7"):
        answer_region([examples[0].answer], 8, LONG_WORDS.codec)


def test_a_word_model_trains_saves_its_tokenizer_and_decodes_through_dloom(monkeypatch, tmp_path, capsys):
    """A tiny word-token causal stage, then a dLLM from it with threshold rows (their targets
    encoded from each family's right answers): the saved tokenizer gives the trainer's ids, and
    ``dloom eval`` and the probes decode the checkpoint over its 64-token region."""
    import dataclasses
    import json

    from transformers import AutoTokenizer

    from dloom_training import train
    from dloom_training.workloads import LONG_WORDS, SPECS, ModelSpec

    tiny = dataclasses.replace(LONG_WORDS, batch=4, monitor_per_family=1)
    spec = ModelSpec("ar", hidden=16, layers=1, heads=2, ffn=32, share=0.1, workload=tiny)
    monkeypatch.setitem(SPECS, "long-dllm-words-ar", spec)
    monkeypatch.setitem(SPECS, "long-dllm-words", dataclasses.replace(spec, kind="dllm"))
    common = ["--out", str(tmp_path), "--threads", "1", "--eval-n", "4", "--steps", "2"]
    train.main(["--model", "long-dllm-words-ar", *common])
    train.main(["--model", "long-dllm-words", "--init-from", str(tmp_path / "long-dllm-words-ar"), "--masks",
                "block", "--decoder-share", "1", "--decoder-fill", "threshold", "--decoder-rounds", "3", *common])
    directory = tmp_path / "long-dllm-words"
    record = json.loads((directory / "eval.json").read_text())
    assert set(record["per_family"]) == {"chain", "word", "tale", "prog"} and record["n"] == 4
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    answer = "zoe went to the farm. there she saw a big dog."
    assert tokenizer(answer)["input_ids"] == tiny.codec.encode(answer) and len(tiny.codec.encode(answer)) == 13
    from typer.testing import CliRunner

    from dloom.cli.commands import app

    result = CliRunner().invoke(app, ["eval", "--model", str(directory), "--strategy", "threshold",
                                      "--param", "tau=0.9", "-n", "4", "--json"])
    assert result.exit_code == 0, result.output
    *rows, summary = (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))
    assert summary["n"] == 4 and {row["family"] for row in rows} == {"chain", "word", "tale", "prog"}
    assert all(row["nfe"] <= 64 for row in rows)  # one forward a token at most, over the 64-token region
    import probe  # training/probe.py reads the checkpoint with its own tokenizer

    model, codec = probe.load(directory)
    assert codec.encode(answer) == tiny.codec.encode(answer)
    probe.probe_families(model, codec, 1, "confidence")
    probe.probe_tales(model, codec, 1)
    assert "tale: 0/1 exact" in capsys.readouterr().out


def test_an_averaged_run_checkpoints_the_average_and_resume_continues_both(monkeypatch, tmp_path):
    import json

    from dloom_training import run, train
    from dloom_training.checkpoints import TRAINING_WEIGHTS

    _tiny_long_spec(monkeypatch)
    batches, load = run.training_batches, LlamaForCausalLM.from_pretrained
    monkeypatch.setattr(run, "training_batches", _killed_after(batches, 2))
    argv = ["--model", "long-dllm-ar", "--out", str(tmp_path), "--threads", "1", "--checkpoint-minutes", "1e-9"]
    with pytest.raises(KeyboardInterrupt):  # lr 5: warm-up steps of about 0.05, far above float16's rounding
        train.main([*argv, "--steps", "12", "--ema", "0.5", "--lr", "5"])
    directory = tmp_path / "long-dllm-ar"
    trained, averaged = (load(d).state_dict() for d in (directory / TRAINING_WEIGHTS, directory))
    assert any(not torch.equal(v, averaged[k]) for k, v in trained.items())  # two steps: an average

    loaded = []
    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained",
                        lambda path, **kw: loaded.append(Path(path)) or load(path, **kw))
    monkeypatch.setattr(run, "training_batches", _killed_after(batches, 1))
    with pytest.raises(KeyboardInterrupt):
        train.main([*argv, "--resume"])  # the run's own ema
    assert loaded == [directory / TRAINING_WEIGHTS, directory]  # the optimizer's weights, the average
    assert json.loads((directory / "progress.json").read_text())["ema"] == 0.5
    next_trained, next_averaged = (load(d).state_dict() for d in (directory / TRAINING_WEIGHTS, directory))
    for k, v in next_averaged.items():  # decay 0.5: halfway from the saved average to the new weights
        torch.testing.assert_close(v.float(), (averaged[k].float() + next_trained[k].float()) / 2,
                                   atol=2e-4, rtol=2e-3)
    assert max((next_averaged[k].float() - v.float()).abs().max() for k, v in next_trained.items()) > 0.01


@pytest.mark.parametrize("decay", ["1", "-0.1"])
def test_an_ema_decay_outside_its_range_is_refused(decay, capsys):
    from dloom_training.train import main

    with pytest.raises(SystemExit):
        main(["--model", "long-dllm", "--steps", "1", "--ema", decay])
    assert f"--ema is a decay per step: it must be in [0, 1), got {float(decay)}" in capsys.readouterr().err


def _tale(go: str) -> Example:
    return Example("tale", "tale sue cat park",
                   f"sue {go} to the park. there she saw a red cat. the cat sat down. she smiled and went home.")


def test_own_commits_target_the_right_answer_closest_to_the_model_s_guesses():
    """A decoder row whose revealed positions hold the model's guesses is trained towards the
    right answer that agrees with most of them, drawn uniformly among the closest: the row's
    own answer (``went``) is replaced by one with the guessed filler (``ran``); guesses no right
    answer fits all of (``sue xxn``) get the closest and are mistakes where they differ from
    it; a family without a listing keeps its answer, its wrong guesses mistakes too."""
    from dloom_training.decoder_states import own_commits
    from dloom_training.rows import answer_region

    went, ran = _tale("went"), _tale("ran")
    target = answer_region([went.answer, went.answer, "12-3=9"], 128)
    guess = answer_region([ran.answer, "sue xx" + ran.answer[6:], "12-3=8"], 128)
    revealed = torch.zeros(3, 128, dtype=torch.bool)
    revealed[:, :7] = True  # 'sue ran', 'sue xxn', '12-3=8'
    settled = torch.zeros(3, 128, dtype=torch.bool)
    rows = [went, went, Example("chain", "chain 12-3", "12-3=9")]
    lengths = torch.tensor([len(e.answer) for e in rows])
    chosen, chosen_lengths, mistaken = own_commits(rows, target, revealed, guess, settled, lengths,
                                                    torch.Generator().manual_seed(0))
    listed = long_tasks_answers(went.prompt)
    text = _decoded(chosen[0])
    assert text.startswith("sue ran to the park. ") and text in listed and chosen_lengths[0] == len(text)
    assert _decoded(chosen[1])[:7] in ("sue wen", "sue ran") and _decoded(chosen[1]) in listed
    assert torch.equal(chosen[2], target[2]) and chosen_lengths[2] == lengths[2]
    assert mistaken[0].nonzero()[:, 0].tolist() == []
    assert mistaken[1].nonzero()[:, 0].tolist() == [4, 5]
    assert mistaken[2].nonzero()[:, 0].tolist() == [5]  # '8' for '9'

    draws = [_decoded(own_commits(rows[:1], target[:1], revealed[:1] & False, guess[:1], settled[:1],
                                   lengths[:1], torch.Generator().manual_seed(seed))[0][0])
             for seed in range(600)]
    goes = [d.split(" ")[1] for d in draws]  # nothing revealed: every tale fits, so each filler is drawn
    from scipy.stats import chisquare

    assert chisquare([goes.count(g) for g in ("went", "walked", "ran")]).pvalue > 1e-3
    assert len(set(draws)) > 200


def _decoded(region: torch.Tensor) -> str:
    return CHARACTERS.decode(region.tolist())


def long_tasks_answers(prompt: str) -> list[str]:
    from dloom.zoo import long_tasks

    return long_tasks.FAMILIES["tale"].answers(prompt)


def test_decoder_rows_filled_by_the_model_hold_its_guesses(monkeypatch):
    """With ``decoder_fill="model"`` the state a decoder row is trained in holds the model's
    guesses at the revealed positions where a right answer fits them (``sue ran`` in the first
    block), and the row's answer with ``"answer"`` (``sue wen``)."""
    from dloom_training import losses
    from dloom_training.decoder_states import DECODER_FILLS
    from dloom_training.rows import answer_region

    went, ran = _tale("went"), _tale("ran")

    def surest(model, prompt_ids, prompt_mask, target, block, count, rounds, hold_guesses):
        assert (rounds, hold_guesses) == (1, fill == "model")
        first_seven = block & (torch.arange(128) % 32 < 7)  # reveal the drawn block's first 7
        return block & ~first_seven, answer_region([ran.answer] * len(block), 128)

    monkeypatch.setattr(losses, "least_confident", surest)
    model = _Calls(build_model("long-dllm"))
    states = {}
    for fill in DECODER_FILLS:
        model.calls.clear()
        dllm_loss(model, [went] * 16, 0, torch.Generator().manual_seed(5), 1.0, 1.0, 128, 32, 0.0, 0.0, "row",
                  1.0, fill)
        states[fill] = model.calls[-1][:, -128:]
    first_block = states["answer"][:, 7] == tok.MASK_ID  # rows that drew block 0
    assert 0 < int(first_block.sum()) < 16
    for row in first_block.nonzero()[:, 0].tolist():
        assert CHARACTERS.decode(states["model"][row, :7].tolist()) == "sue ran"
        assert CHARACTERS.decode(states["answer"][row, :7].tolist()) == "sue wen"
    # block 0 settled with 'went': the guesses of a later block are mostly mistakes, left masked
    later = ~first_block
    model_state, answer_state = states["model"][later], states["answer"][later]
    guessed = answer_region([ran.answer], 128).expand_as(model_state)
    kept = model_state != tok.MASK_ID  # the settled blocks' answer, or a guess a right answer agrees with
    assert ((model_state == answer_state) | (model_state == guessed))[kept].all()
    assert int((states["model"][later] == tok.MASK_ID).sum()) > int((states["answer"][later] == tok.MASK_ID).sum())


@pytest.mark.parametrize("family", ["word", "tale"])
def test_families_list_every_right_answer_and_only_right_ones(family):
    from dloom.zoo import long_tasks
    from dloom.zoo.tasks import held_out

    examples = [e for e in held_out(200, seed=0, suite=long_tasks.FAMILIES) if e.family == family][:20]
    for e in examples:
        listed = long_tasks.FAMILIES[family].answers(e.prompt)
        assert e.answer in listed and len(set(listed)) == len(listed)
        assert all(long_tasks.FAMILIES[family].check(e.prompt, a) for a in listed)
        steps = e.prompt.count(",")  # word: the events after the opening
        assert len(listed) == (360 if family == "tale" else 3 ** steps * 3)
    assert long_tasks.FAMILIES["chain"].answers(examples[0].prompt) is None


def test_a_model_fill_without_decoder_rows_is_refused(tmp_path):
    from dloom_training.run import train_one

    with pytest.raises(ValueError, match="decoder_fill 'model' fills the decoder rows: it needs a decoder_share"):
        train_one("toy-dllm", None, 1, 0, tmp_path, 4, masks="block", decoder_fill="model")
    assert not (tmp_path / "toy-dllm").exists()


@pytest.mark.parametrize("rounds", [32, 64])
def test_decoder_rounds_of_a_block_s_length_reach_the_one_token_per_step_decoder_s_state(rounds):
    """Revealed one position a forward (``rounds`` at least the block's length), each holding the
    model's guess, a decoder row's state after ``m`` reveals is the state the one-token-per-step
    confidence decoder (:func:`trace_dllm`) reaches after ``m`` steps: the same positions, the
    same tokens.  Revealing them all from one forward (``rounds=1``), or holding the answer's
    tokens instead of the guesses, reaches other states."""
    from dloom.zoo import long_tasks
    from dloom.zoo.tasks import held_out
    from dloom_training.decoder_states import least_confident
    from dloom_training.decoding import trace_dllm
    from dloom_training.rows import answer_region, encode_prompts

    torch.manual_seed(0)
    model = build_model("long-dllm").eval()
    batch = held_out(12, seed=0, suite=long_tasks.FAMILIES)
    prompt_ids, prompt_mask = encode_prompts([e.prompt for e in batch])
    target = answer_region([e.answer for e in batch], 128)
    block = (torch.arange(128) < 32)[None, :].expand(len(batch), -1)
    revealed = torch.tensor([[m] for m in (0, 1, 2, 5, 9, 13, 17, 21, 25, 28, 30, 31)])
    trace = trace_dllm(model, [e.prompt for e in batch])
    decoded = trace.step < revealed  # block 0 is decoded first: step k commits one of its positions

    def state(rounds, hold_guesses):
        masked, guess = least_confident(model, prompt_ids, prompt_mask, target, block, revealed, rounds,
                                         hold_guesses)
        return block & ~masked, guess

    shown, guess = state(rounds, True)
    assert torch.equal(shown, decoded)
    assert torch.equal(guess[shown], trace.region[decoded])
    for other in (state(1, True), state(rounds, False)):
        assert not torch.equal(other[0], decoded)


def test_decoder_rounds_below_one_or_without_decoder_rows_are_refused(tmp_path, capsys):
    from dloom_training.run import train_one
    from dloom_training.train import main

    with pytest.raises(ValueError, match="decoder_rounds 2 is the number of forwards .* needs a decoder_share"):
        train_one("toy-dllm", None, 1, 0, tmp_path, 4, masks="block", decoder_rounds=2)
    assert not (tmp_path / "toy-dllm").exists()
    with pytest.raises(SystemExit):
        main(["--model", "long-dllm", "--steps", "1", "--decoder-rounds", "0"])
    assert "--decoder-rounds is a number of forwards: it must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "long-ar", "--steps", "1", "--decoder-rounds", "4"])
    assert "--decoder-rounds is a dLLM's training option" in capsys.readouterr().err


def test_a_checkpoint_saved_without_an_average_drops_an_earlier_run_s_training_weights(tmp_path):
    """A run resumed with ``--ema 0`` after an averaged one saves the optimizer's weights at
    the top level; the averaged run's ``training-weights/`` would be stale, so it goes."""
    from dloom_training import checkpoints
    from dloom_training.workloads import SHORT

    torch.manual_seed(0)
    model, other = build_model("toy-ar-small"), build_model("toy-ar-small")
    checkpoints.save_checkpoint(model, tmp_path, SHORT, {"ema": 0.5}, training=other)
    assert (tmp_path / checkpoints.TRAINING_WEIGHTS / "model.safetensors").is_file()
    checkpoints.save_checkpoint(other, tmp_path, SHORT, {"ema": 0.0})
    assert not (tmp_path / checkpoints.TRAINING_WEIGHTS).exists()
    assert (tmp_path / "model.safetensors").is_file()
    assert json.loads((tmp_path / checkpoints.PROGRESS).read_text()) == {"ema": 0.0}



def _decoder_states(adapter, prompt_ids, tau):
    """The regions dloom's threshold decoder holds after 0, 1, 2, ... forwards on one prompt
    (until the row finishes and leaves the batch)."""
    import dloom
    from dloom.decode.session import DecodeSession

    session = DecodeSession(dloom.DiffusionDecoder(adapter, "threshold", tau=tau))
    session.admit([prompt_ids])
    states = [session.x[0, session.width:].clone()]
    while session.step() is None and session.size:
        states.append(session.x[0, session.width:].clone())
    return torch.stack(states)


def test_threshold_rows_hold_the_states_dloom_s_threshold_decoder_reaches():
    """A ``"threshold"`` decoder row's state -- its earlier blocks decoded by the model
    (``own_earlier``) or holding what it decoded there, then ``f`` forwards in the drawn block
    -- is the region ``dloom.DiffusionDecoder(model, "threshold", tau=τ)`` holds after the
    forwards that finish the earlier blocks and ``f`` more: the same positions, the same tokens,
    its commits kept, whatever the row's answer.  The answer-filled state of as many confidence-ordered reveals (the
    ``"answer"`` fill) is not.  On the shipped long-dllm, whose confidences vary as a trained
    model's do, so forwards commit one position or several."""
    import dloom
    from dloom.zoo import long_tasks, model_path
    from dloom.zoo.tasks import held_out
    from dloom_training.decoder_states import least_confident, threshold_rollout
    from dloom_training.rows import encode_prompts

    adapter = dloom.load_model("long-dllm")
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_path("long-dllm"), local_files_only=True,
                                             dtype=torch.float32).eval()
    ids = tok.vocab(long_tasks.ALPHABET)
    block_of = torch.arange(128) // 32
    compared, several, answer_fill_differs = 0, False, 0
    for tau, example in zip((0.9, 0.95, 0.7), held_out(12, seed=0, suite=long_tasks.FAMILIES)[::4]):
        states = _decoder_states(adapter, [ids[c] for c in example.prompt], tau)
        masks = states == tok.MASK_ID
        several |= bool(((masks[:-1] & ~masks[1:]).sum(-1) > 1).any())
        cases = []  # (drawn block, forwards in it, own earlier blocks, the decoder's state then)
        for current in range(4):
            done = (~masks[:, block_of < current].any(-1)).nonzero()[:, 0]
            if not len(done):
                continue  # the answer ended (the row left the decoder) before this block
            reached = int(done[0])
            for f in (0, 1, 2, 3, 5):
                later = reached + f
                if later < len(states) and masks[later, block_of == current].any():  # the block still open
                    cases += [(current, f, own, states[later]) for own in (True, False)]
        prompt_ids, prompt_mask = encode_prompts([example.prompt] * len(cases))
        current, forwards, own = (torch.tensor([c[k] for c in cases]) for k in range(3))
        expected = torch.stack([c[3] for c in cases])
        # the rows' "answers": what the decoder wrote before the drawn block, a token it never
        # writes from the block on (the rollout commits its own argmax, whatever the answer)
        given = torch.where(block_of[None, :] < current[:, None], states[-1][None], ids["~"])
        state = threshold_rollout(model, prompt_ids, prompt_mask, given, current, 32, forwards,
                                  torch.full((len(cases),), tau), own)
        assert torch.equal(state, expected)
        compared += len(cases)
        drawn = block_of[None, :] == current[:, None]
        shown = (expected != tok.MASK_ID) & drawn
        masked, _ = least_confident(model, prompt_ids, prompt_mask, given, drawn, shown.sum(-1, keepdim=True))
        answer_filled = torch.where(masked | (block_of[None, :] > current[:, None]), tok.MASK_ID, given)
        revealed = shown.any(-1)  # a forward in the block: the fills differ in what it committed
        assert torch.equal((answer_filled != expected).any(-1), revealed)
        answer_fill_differs += int(revealed.sum())
    assert several and compared >= 20 and answer_fill_differs >= compared / 2


def test_threshold_rows_read_their_own_commits_and_score_the_rest_of_their_block():
    """In the loss's forward a ``"threshold"`` row holds its rollout's commits (not the answer's
    tokens: the answers here are a letter the model never writes) and masks the rest of its
    block and every later block; ``first_forward_share`` 1 leaves every drawn block fully masked."""
    from dloom.zoo import long_tasks
    from dloom.zoo.tasks import held_out
    from dloom_training.rows import answer_region

    torch.manual_seed(0)
    model = _Calls(build_model("long-dllm"))
    batch = [Example(e.family, e.prompt, "~" * len(e.answer)) for e in held_out(8, seed=0, suite=long_tasks.FAMILIES)]
    tilde = tok.vocab(long_tasks.ALPHABET)["~"]
    block_of = torch.arange(128) // 32

    def scored_state(**options):
        model.calls.clear()
        dllm_loss(model, batch, 0, torch.Generator().manual_seed(0), 1.0, 1.0, 128, 32, 0.0, 0.0, "row", 1.0,
                  "threshold", 4, **options)
        return model.calls[-1][:, -128:]

    region = scored_state(decoder_taus=(0.9,))
    masked = region == tok.MASK_ID
    current = masked.int().argmax(-1) // 32  # every row is a decoder row: its block is the first with masks
    assert masked[block_of[None, :] > current[:, None]].all()
    in_block = block_of[None, :] == current[:, None]
    committed = in_block & ~masked
    assert committed.any() and not (region[committed] == tilde).any()  # its own argmax, not the answer's
    earlier = block_of[None, :] < current[:, None]
    assert earlier.any() and torch.equal(region[earlier], answer_region([e.answer for e in batch], 128)[earlier])
    first = scored_state(decoder_taus=(0.9,), first_forward_share=1.0) == tok.MASK_ID
    first_block = first.int().argmax(-1) // 32
    assert torch.equal(first, block_of[None, :] >= first_block[:, None])
    own = scored_state(decoder_taus=(0.9,), own_earlier_share=1.0)
    own_block = (own == tok.MASK_ID).int().argmax(-1) // 32
    assert (own_block > 0).any() and not (own[block_of[None, :] < own_block[:, None]] == tilde).any()


def test_label_smoothing_raises_a_sure_prediction_s_loss_and_leaves_a_uniform_one_s():
    sure = dllm_loss(_Fixed(), BATCH, 0, torch.Generator().manual_seed(0), 1.0)
    smoothed = dllm_loss(_Fixed(), BATCH, 0, torch.Generator().manual_seed(0), 1.0, label_smoothing=0.1)
    assert smoothed.item() > sure.item() + 0.5  # 10 % of the target spread over tokens at logit -10

    class Uniform(_Fixed):
        def forward(self, input_ids, attention_mask, position_ids):
            return type("Out", (), {"logits": torch.zeros((*input_ids.shape, len(tok.vocab())))})()

    plain = dllm_loss(Uniform(), BATCH, 0, torch.Generator().manual_seed(0), 1.0)
    uniform = dllm_loss(Uniform(), BATCH, 0, torch.Generator().manual_seed(0), 1.0, label_smoothing=0.1)
    assert torch.allclose(plain, uniform)


@pytest.mark.parametrize("options, message", [
    ({"decoder_share": 0.5, "decoder_fill": "threshold", "decoder_taus": (0.9, 1.0)},
     r"decoder_taus \[0.9, 1.0\] are thresholds: each must be in \(0, 1\)"),
    ({"decoder_share": 0.5, "own_earlier_share": 0.5},
     "own_earlier_share 0.5 decodes .* needs decoder_fill 'threshold', got 'answer'"),
    ({"first_forward_share": 0.2}, "first_forward_share 0.2 is a share of the decoder rows: it needs a decoder_share"),
    ({"decoder_share": 0.5, "first_forward_share": 1.5}, r"first_forward_share 1.5 .* must be in \[0, 1\]"),
    ({"label_smoothing": 1.0}, r"label_smoothing 1.0 must be in \[0, 1\)"),
])
def test_bad_parallel_options_are_refused_before_training(options, message, tmp_path):
    from dloom_training.run import train_one

    with pytest.raises(ValueError, match=message):
        train_one("long-dllm", None, 1, 0, tmp_path, 4, masks="block", **options)
    assert not (tmp_path / "long-dllm").exists()


@pytest.mark.parametrize("argv, message", [
    (["--model", "long-dllm", "--decoder-tau", "0.9,1.2"], r"thresholds must be in \(0, 1\), got \[1.2\]"),
    (["--model", "long-dllm", "--decoder-tau", "0.9,x"], "expected thresholds like 0.9,0.95"),
    (["--model", "long-dllm", "--label-smoothing", "-0.1"], r"--label-smoothing must be in \[0, 1\), got -0.1"),
    (["--model", "long-dllm", "--own-earlier-share", "2"], r"--own-earlier-share must be in \[0, 1\], got 2.0"),
    (["--model", "long-ar", "--first-forward-share", "0.3"], "--first-forward-share is a dLLM's training option"),
])
def test_bad_parallel_options_are_named_on_the_command_line(argv, message, capsys):
    from dloom_training.train import main

    with pytest.raises(SystemExit):
        main([*argv, "--steps", "1"])
    assert re.search(message, capsys.readouterr().err)


def test_a_new_dllm_starts_from_a_shifted_dllm_checkpoint(tmp_path):
    """``--init-from`` a trained dLLM (long-dllm-par from long-dllm): its weights and shift as they are."""
    from dloom_training.checkpoints import save_model
    from dloom_training.models import dllm_from_ar

    torch.manual_seed(0)
    source = build_model("toy-dllm")
    source.config.dloom["shift"] = True
    save_model(source, tmp_path / "dllm")
    started = dllm_from_ar(tmp_path / "dllm", "toy-dllm")
    assert started.config.dloom == source.config.dloom and started.config.is_causal is False
    assert all(torch.equal(v, source.state_dict()[k].half().float()) for k, v in started.state_dict().items())
