"""The report's measurements, kept as each one finishes, so that a stopped run resumes.

A full report on the long-answer workload decodes the same prompts with some fifty
configurations and calibrates four draft graphs: hours on a CPU. :class:`MeasurementStore`
appends every finished measurement (a configuration's row, a calibration's graphs, the
oracle, FailFast's comparison) to a JSON-lines file next to the report's JSON, flushed and
synced at once. ``report.py --resume`` reads that file and reuses each measurement whose key is
equal, so an interrupt, a crash or the end of a session loses at most the measurement in
progress.

A key holds everything a measurement depends on except the code: the run's identity
(:func:`run_identity`: the model's weights, the prompts, the batch size, threads, device and
torch version) and the measurement's own settings, with the contents of every file a setting
names (a draft graph) digested, so a recalibrated graph is never mistaken for the old one.
Each entry also records the commit it was measured at; a resumed run says when that differs
from the current one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of ``module``'s parameters and buffers (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_identity(model, examples: Sequence[Any], batch_size: int) -> dict[str, Any]:
    """What every measurement of one report depends on besides its own settings."""
    prompts = hashlib.sha256("\n".join(f"{e.family}\t{e.prompt}" for e in examples).encode()).hexdigest()
    return {
        "weights": weights_digest(model.model), "prompts": prompts, "n": len(examples), "batch_size": batch_size,
        "threads": torch.get_num_threads(), "device": str(model.device), "torch": torch.__version__,
    }


def with_file_digests(settings: Any) -> Any:
    """``settings`` with every string naming an existing file replaced by
    ``{"file": name, "sha256": ...}`` (recursively through dicts and lists)."""
    if isinstance(settings, dict):
        return {key: with_file_digests(value) for key, value in settings.items()}
    if isinstance(settings, (list, tuple)):
        return [with_file_digests(value) for value in settings]
    if isinstance(settings, str) and len(settings) < 4096 and os.path.isfile(settings):
        return {"file": settings, "sha256": file_digest(settings)}
    return settings


RECORD_FILES = frozenset({"eval.json", "progress.json"})
"""Files of a zoo-style checkpoint that record how it was made, not what it computes."""


def model_digest(name_or_path: str) -> str:
    """SHA-256 over the files of a model directory, or of the zoo model ``name_or_path``: the
    ones it loads from (weights, configs, tokenizer), not its training records
    (:data:`RECORD_FILES`), so a checkpoint copied into the zoo keeps its digest."""
    from dloom.zoo import MODEL_NAMES, model_path

    directory = model_path(name_or_path) if name_or_path in MODEL_NAMES else Path(name_or_path)
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name not in RECORD_FILES):
        digest.update(f"{path.name};".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def current_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


class MeasurementStore:
    """Finished measurements of a report, one JSON line each, reused on ``resume``.

    :param path: the JSON-lines file; ``None`` keeps nothing (every measurement runs).
    :param identity: :func:`run_identity` of this run, part of every key.
    :param resume: reuse the file's measurements; ``False`` starts the file afresh.
    :ivar reused: keys' names that came from the file in this run, in order.
    """

    def __init__(self, path: Path | None, identity: dict[str, Any], resume: bool = False) -> None:
        self.path, self.identity = path, identity
        self.commit = current_commit()
        self.reused: list[str] = []
        self._entries: dict[str, dict[str, Any]] = {}
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume and path.exists():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the interrupt
                    continue
                self._entries[entry["key"]] = entry
        # rewritten whole: without a line cut short, which the next entry would otherwise extend
        path.write_text("".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in self._entries.values()))

    def key(self, kind: str, settings: dict[str, Any]) -> str:
        return json.dumps({"kind": kind, "run": self.identity, "settings": with_file_digests(settings)},
                          sort_keys=True, ensure_ascii=False)

    def lookup(self, key: str, name: str, valid: Callable[[Any], bool] | None = None) -> tuple[bool, Any]:
        """``(True, value)`` when a resumed run stored ``key`` (and ``valid(value)``), else
        ``(False, None)``."""
        entry = self._entries.get(key)
        if entry is None or (valid is not None and not valid(entry["value"])):
            return False, None
        self.reused.append(name)
        note = "" if entry.get("commit") == self.commit else f", measured at commit {entry.get('commit')}"
        print(f"{name:26s} reused from {self.path}{note}", file=sys.stderr, flush=True)
        return True, entry["value"]

    def put(self, key: str, name: str, value: Any) -> Any:
        """Keep ``value`` under ``key`` (appended to the file, flushed and synced); return it."""
        entry = {"key": key, "name": name, "commit": self.commit, "value": value}
        self._entries[key] = entry
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        return value
