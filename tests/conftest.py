"""Fixtures: tiny randomly initialised bidirectional models (float64) and their adapters."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dloom import BlockSchedule, ModelAdapter
from dloom.hooks.registry import reset_registry

# Tiny forwards run fastest on one thread, and do not stall when the machine is busy.
torch.set_num_threads(1)

VOCAB = 40
MASK_ID = 39
EOS_ID = 2
PAD_ID = 0


def tiny_config(**overrides) -> LlamaConfig:
    """A two-layer bidirectional Llama with a 40-token vocabulary."""
    values = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=96,
        initializer_range=0.2, is_causal=False, mask_token_id=MASK_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides)).eval().to(torch.float64)


def sharpen(model: LlamaForCausalLM, factor: float = 2.0) -> LlamaForCausalLM:
    """Scale the output head so that confidences spread over (0, 1) like a trained model's."""
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


@pytest.fixture
def tiny_adapter() -> ModelAdapter:
    """A float64 adapter over a tiny random bidirectional model (mask 39, EOS 2, pad 0)."""
    return ModelAdapter(
        tiny_model(), mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        max_context=96, name="tiny",
    )


@pytest.fixture
def sharp_adapter() -> ModelAdapter:
    """Like ``tiny_adapter`` but with peaked, heterogeneous confidences."""
    return ModelAdapter(
        sharpen(tiny_model(seed=1, initializer_range=0.5)), mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,),
        pad_token_id=PAD_ID, max_context=96, name="sharp",
    )


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    """A tiny bidirectional model saved with ``save_pretrained`` (no tokenizer)."""
    path = tmp_path / "tiny-dllm"
    tiny_model().to(torch.float32).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Every test starts from a freshly loaded registry and no plugin env vars."""
    for name in ("DLOOM_PLUGINS", "DLOOM_STRICT_PLUGINS", "DLOOM_TRACE"):
        monkeypatch.delenv(name, raising=False)
    reset_registry()
    yield
    reset_registry()


@pytest.fixture(scope="session")
def report_module():
    """The report's command module, ``benchmarks.report``."""
    return importlib.import_module("benchmarks.report")


class FakeSite:
    """A directory on ``sys.path`` holding fake distributions with ``dloom`` entry points."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def install(self, dist: str, source: str, *, version: str = "0.1", ep_name: str | None = None) -> str:
        """Install distribution ``dist`` whose entry point ``ep_name`` (default ``dist``) names
        a fresh module holding ``source``; return that module's name."""
        module = f"{dist}_mod_{uuid.uuid4().hex[:10]}"
        info = self.root / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        )
        (info / "entry_points.txt").write_text(f"[dloom]\n{ep_name or dist} = {module}\n")
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        self.modules.append(module)
        importlib.invalidate_caches()
        reset_registry()
        return module


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh :class:`FakeSite` on ``sys.path``, no plugin selection in the environment, a
    registry reloaded before and after; its modules are forgotten afterwards."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("DLOOM_PLUGINS", raising=False)
    monkeypatch.delenv("DLOOM_STRICT_PLUGINS", raising=False)
    importlib.invalidate_caches()
    reset_registry()
    fake = FakeSite(root)
    yield fake
    for module in fake.modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()
    reset_registry()


def revisable(adapter: ModelAdapter) -> ModelAdapter:
    """``adapter`` decoding with the revisable kernel (fills and token edits)."""
    return dataclasses.replace(adapter, kernel="revisable")


def edit_schedule(masked: list[list[bool]], post_steps: list[int]) -> BlockSchedule:
    """A revisable kernel's schedule for a hand-written step: ``masked`` ``(B, K)`` and each
    row's post steps so far."""
    mask = torch.tensor(masked, dtype=torch.bool)
    return BlockSchedule(
        torch.zeros(mask.shape[0], dtype=torch.long), 1, mask.sum(-1), masked=mask,
        post_steps=torch.tensor(post_steps, dtype=torch.long),
    )


def staggered(decoder, prompts, schedule, streams=None):
    """Decode ``prompts`` in one :class:`~dloom.decode.session.DecodeSession`, each joining
    before the step ``schedule`` (``{step: [prompt index, ...]}``) names, with random stream
    ``streams[index]`` (``None``: 0).

    :return: ``{prompt index: (tokens, nfe)}``, the rows of every observed step (prompt
        indices) and the session.
    """
    from dloom.decode.session import DecodeSession

    steps: list[set[int]] = []
    by_id: dict[int, int] = {}
    session = DecodeSession(decoder, observer=lambda record: steps.append({by_id[r] for r in record.rows.tolist()}))
    out: dict[int, tuple[list[int], int]] = {}
    step = 0
    while session.size or step <= max(schedule):
        for prompt in schedule.get(step, []):
            offset = [streams[prompt]] if streams else 0
            (row,) = session.admit([prompts[prompt]], row_offset=offset)
            by_id[row] = prompt
        done = session.step()
        step += 1
        if done is not None:
            for row, tokens, nfe in zip(done.rows.tolist(), done.token_lists(), done.nfe.tolist()):
                out[by_id[row]] = (tokens, nfe)
    return out, steps, session
