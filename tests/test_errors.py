"""Every configuration, model and contract error names the bad value and what is allowed."""

from __future__ import annotations

import ast
import builtins
import warnings
from pathlib import Path

import pytest
import torch

from conftest import EOS_ID, MASK_ID, PAD_ID, tiny_model
from dloom import DiffusionDecoder, ModelAdapter, errors, hookimpl, load_model
from dloom.errors import (
    ConfigurationError,
    HookContractError,
    ModelError,
    NonFiniteLogitsError,
)


def test_gen_length_not_multiple_of_block(tiny_adapter):
    with pytest.raises(ConfigurationError, match="gen_length 10 is not a multiple of block_length 4"):
        DiffusionDecoder(tiny_adapter, gen_length=10, block_length=4)


def test_steps_do_not_divide_over_blocks(tiny_adapter):
    with pytest.raises(ConfigurationError, match="steps 5 do not divide over 2 blocks.*multiple of 2"):
        DiffusionDecoder(tiny_adapter, gen_length=8, block_length=4, steps=5)


def test_negative_temperature(tiny_adapter):
    with pytest.raises(ConfigurationError, match=r"temperature is -1.0; allowed: >= 0"):
        DiffusionDecoder(tiny_adapter, temperature=-1.0, gen_length=8)


def test_unknown_remasking(tiny_adapter):
    with pytest.raises(ConfigurationError, match="remasking is 'lowest'; allowed: low_confidence, random, margin, entropy"):
        DiffusionDecoder(tiny_adapter, remasking="lowest", gen_length=8)


def test_prompt_beyond_context(tiny_adapter):
    decoder = DiffusionDecoder(tiny_adapter, gen_length=16, block_length=8)
    with pytest.raises(ModelError, match="prompt of 90 tokens \\+ gen_length 16 = 106 exceeds the model's context of 96"):
        decoder.generate([[5] * 90])


def test_empty_prompt(tiny_adapter):
    decoder = DiffusionDecoder(tiny_adapter, gen_length=8)
    with pytest.raises(ModelError, match="prompt 1 is empty"):
        decoder.generate([[5], []])


def test_nan_logits(tiny_adapter):
    with torch.no_grad():
        tiny_adapter.model.lm_head.weight[3, 0] = float("nan")
    decoder = DiffusionDecoder(tiny_adapter, gen_length=8)
    with pytest.raises(NonFiniteLogitsError, match="NaN or inf logits at block 0, forward 0"):
        decoder.generate([[5, 6]])


def test_causal_model_refused():
    adapter = ModelAdapter(tiny_model(), mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID, attention="causal", name="ar")
    with pytest.raises(ModelError, match="'ar' has causal attention"):
        DiffusionDecoder(adapter, gen_length=8)


def test_unknown_attention_kind():
    with pytest.raises(ModelError, match="attention kind 'sideways' is not supported; allowed: bidirectional, block-causal, causal"):
        ModelAdapter(tiny_model(), mask_token_id=MASK_ID, eos_token_ids=(), pad_token_id=0, attention="sideways")


def test_no_mask_token(tmp_path):
    path = tmp_path / "nomask"
    tiny_model(mask_token_id=None).save_pretrained(path)
    with pytest.raises(ModelError, match="declares no mask token: pass --mask-token-id"):
        load_model(path)
    assert load_model(path, mask_token_id=MASK_ID).mask_token_id == MASK_ID


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelError, match="no model directory at .*toy-zoo name"):
        load_model(tmp_path / "absent")


def test_unknown_dtype(tiny_model_dir):
    with pytest.raises(ModelError, match="dtype 'float8' is not supported; allowed: float32, float64"):
        load_model(tiny_model_dir, dtype="float8")


def test_text_prompt_without_tokenizer(tiny_model_dir):
    decoder = DiffusionDecoder(load_model(tiny_model_dir), gen_length=8)
    with pytest.raises(ModelError, match="has no tokenizer; pass token ids"):
        decoder.generate(["hello"])


def test_load_model_reads_conventions(tiny_model_dir):
    adapter = load_model(tiny_model_dir, dtype="float64")
    assert adapter.mask_token_id == MASK_ID
    assert adapter.eos_token_ids == (EOS_ID,)
    assert adapter.pad_token_id == PAD_ID
    assert adapter.attention == "bidirectional"
    assert adapter.shift_logits is False
    assert adapter.max_context == 96
    assert adapter.dtype == torch.float64


class CommitsNothing:
    @hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        return torch.zeros_like(selectable)


class WrongShape:
    @hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        return torch.zeros(1, dtype=torch.bool)


def test_commit_rule_that_commits_nothing(tiny_adapter):
    decoder = DiffusionDecoder(tiny_adapter, CommitsNothing(), gen_length=8)
    with pytest.raises(HookContractError, match="'CommitsNothing' committed no position"):
        decoder.generate([[5, 6]])


def test_commit_rule_with_wrong_shape(tiny_adapter):
    decoder = DiffusionDecoder(tiny_adapter, WrongShape(), gen_length=8)
    with pytest.raises(HookContractError, match="must return a bool tensor of shape \\(1, 8\\)"):
        decoder.generate([[5, 6]])



ROOT = Path(__file__).resolve().parents[1]
ERRORS_FILE = ROOT / "core" / "dloom" / "errors.py"
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
DLOOM_EXCEPTIONS = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)}
KEEPS_ITS_BASE = {
    errors.ConfigurationError: ValueError, errors.UnknownStrategyError: KeyError, errors.ModelError: ValueError,
    errors.NonFiniteLogitsError: FloatingPointError,
}
"""The errors that ``except`` also catches by a built-in base, kept beside :class:`DloomError`."""


def exception_classes(path: Path, exception_names: set[str]) -> list[str]:
    """``line name`` of each class in ``path`` with a base among ``exception_names`` (named
    alone or as ``module.Name``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))}
            if bases & exception_names:
                found.append(f"{node.lineno} {node.name}")
    return found


def test_every_error_class_lives_in_errors_py():
    sources = [p for folder in ("core", "plugins") for p in sorted((ROOT / folder).rglob("*.py")) if p != ERRORS_FILE]
    assert len(sources) > 80
    outside = {str(p.relative_to(ROOT)): exception_classes(p, BUILTIN_EXCEPTIONS | DLOOM_EXCEPTIONS) for p in sources}
    assert {path: found for path, found in outside.items() if found} == {}


def test_the_scan_finds_an_error_class_planted_outside(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import dloom.errors\nclass A(ValueError): ...\nclass B(dloom.errors.DloomError): ...\n"
        "class C(B): ...\nclass D: ...\n"
    )
    assert exception_classes(planted, BUILTIN_EXCEPTIONS | DLOOM_EXCEPTIONS | {"B"}) == ["2 A", "3 B", "4 C"]


def test_every_error_is_a_dloom_error_and_keeps_its_builtin_base():
    classes = {getattr(errors, n) for n in DLOOM_EXCEPTIONS}
    assert {c.__name__ for c in classes if not issubclass(c, errors.DloomError)} == {"EvaluationInterrupted"}
    assert issubclass(errors.EvaluationInterrupted, KeyboardInterrupt)
    assert not issubclass(errors.EvaluationInterrupted, Exception)  # Ctrl-C passes every `except Exception`
    assert {c.__name__ for c in classes} >= {
        "OracleMismatchError", "EvaluationFailed", "OutputError", "HTTPError", "QueueFullError", "WorkerDeadError",
        "ServerFault",
    }
    for error, base in KEEPS_ITS_BASE.items():
        assert issubclass(error, errors.DloomError) and issubclass(error, base), error


def test_within_each_warning_once_a_line_warns_once():
    def warns_here(message):
        errors.warn(message)  # one line of code, whatever the message

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with errors.each_warning_once():
            warns_here("model a")
            warns_here("model b")
            errors.warn("another line")
        warns_here("model c")  # outside the block: every call warns
        warns_here("model c")
    assert [str(w.message) for w in caught] == ["model a", "another line", "model c", "model c"]
    assert {w.filename for w in caught} == {__file__}  # attributed to the caller outside dloom
