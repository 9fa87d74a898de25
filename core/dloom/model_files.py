"""Checks on a checkpoint directory and a device, before ``transformers`` reads anything.

:func:`check_model_files` turns what would be a ``JSONDecodeError``, a ``SafetensorError``,
an ``OSError``, a pickle refusal, an ``AssertionError`` ("Torch not compiled with CUDA") or a
``RuntimeError`` ("Expected one of cpu, cuda, ... device type") deep inside the loaders into
a :class:`~dloom.errors.ModelError` naming the file or the device and what is allowed.

Weights are read only from safetensors files (one ``*.safetensors`` or shards listed by a
``*.safetensors.index.json``): a pickle checkpoint (``*.bin``, ``*.pt``, ``*.pth``) can run
code when loaded, and dloom never loads one. Each safetensors file is checked without
reading its tensors: the 8-byte header length, the JSON header, and that every tensor's
byte range lies inside the file (a truncated download fails here).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from dloom.errors import ModelError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DEVICE_TYPES = ("cpu", "cuda", "mps")
MAX_HEADER_BYTES = 100 * 1024 * 1024


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, refusing one this machine does not have.

    :raises ModelError: for an unknown device string, CUDA without a CUDA build or GPU, a
        CUDA index beyond the visible GPUs, or MPS where it is unavailable.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ModelError(
            f"device {str(device)!r} is not a torch device ({error}); allowed: cpu, cuda, "
            "cuda:N, mps"
        ) from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelError(
                f"device {str(device)!r} asked for, but this torch has no CUDA GPU "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                "use --device cpu"
            )
        if parsed.index is not None and parsed.index >= count:
            raise ModelError(
                f"device {str(device)!r} does not exist: {count} CUDA GPU(s) visible; allowed: "
                + ", ".join(f"cuda:{i}" for i in range(count))
            )
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ModelError(f"device {str(device)!r} asked for, but MPS is not available; use --device cpu")
    elif parsed.type != "cpu":
        raise ModelError(
            f"device {str(device)!r} is not supported by dloom; allowed: {', '.join(DEVICE_TYPES)}"
        )
    return parsed


def check_config(directory: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``directory``.

    :raises ModelError: when it is missing, unreadable, not JSON or not a JSON object.
    """
    path = directory / "config.json"
    if not path.is_file():
        raise ModelError(f"no config.json in {str(directory)!r}; a checkpoint directory needs one")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ModelError(f"{str(path)!r} is not UTF-8 text: {error}") from None
    except json.JSONDecodeError as error:
        raise ModelError(
            f"{str(path)!r} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None
    except OSError as error:
        raise ModelError(f"cannot read {str(path)!r}: {error}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{str(path)!r} holds a JSON {type(data).__name__}; expected an object")
    return data


def check_safetensors(path: Path) -> list[str]:
    """Check one safetensors file's header and that its tensors lie inside the file.

    :return: the names of the tensors it holds, in header order.
    :raises ModelError: naming the file and what is wrong with it.
    """
    size = path.stat().st_size
    if size < 8:
        raise ModelError(f"weights file {str(path)!r} is {size} bytes: empty or truncated")
    with path.open("rb") as handle:
        (header_bytes,) = struct.unpack("<Q", handle.read(8))
        if header_bytes > min(size - 8, MAX_HEADER_BYTES):
            raise ModelError(
                f"weights file {str(path)!r} is truncated or not safetensors: its header "
                f"claims {header_bytes} bytes, the file has {size}"
            )
        try:
            header = json.loads(handle.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ModelError(f"weights file {str(path)!r} has a corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise ModelError(f"weights file {str(path)!r} has a corrupt safetensors header")
    data_bytes = size - 8 - header_bytes
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ModelError(f"weights file {str(path)!r} has a corrupt entry for tensor {name!r}")
        if offsets[1] > data_bytes:
            raise ModelError(
                f"weights file {str(path)!r} is truncated: tensor {name!r} ends at byte "
                f"{offsets[1]} of the data, which holds {data_bytes}"
            )
    return [name for name in header if name != "__metadata__"]


def _indexed_shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ModelError(f"shard index {str(index)!r} is corrupt: expected a JSON 'weight_map'") from None
    paths = [index.parent / shard for shard in shards]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelError(f"shard index {str(index)!r} lists missing files: {', '.join(missing)}")
    return paths


def check_weights(directory: Path) -> list[Path]:
    """The safetensors files of ``directory``, each checked.

    :raises ModelError: for no weights, pickle weights only, or a corrupt file.
    """
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    files = _indexed_shards(indexes[0]) if indexes else sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelError(
                f"{str(directory)!r} holds pickle weights only ({', '.join(pickles)}); dloom loads "
                "safetensors only, because a pickle can run code when loaded: convert them "
                "(model.save_pretrained(dir, safe_serialization=True)) after checking their source"
            )
        raise ModelError(
            f"no weights in {str(directory)!r}: expected model.safetensors (or shards with a "
            "model.safetensors.index.json)"
        )
    for path in files:
        check_safetensors(path)
    return files


def tensor_names(directory: Path) -> set[str]:
    """The names of every tensor in ``directory``'s safetensors files (headers only).

    :raises ModelError: as :func:`check_weights`.
    """
    return {name for path in check_weights(directory) for name in check_safetensors(path)}


PLACEMENT_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The ``device_map`` strings that ask ``accelerate`` to place the model itself."""


def check_device_map(device_map: Any) -> None:
    """Refuse a ``device_map`` that ``from_pretrained`` would reject only after reading the
    config: a string must be a placement strategy (:data:`PLACEMENT_STRATEGIES`) or a device
    this machine has; a dict maps module names to devices (names, indices, ``"cpu"``,
    ``"disk"``).

    :raises ModelError: naming the bad value and what is allowed.
    """
    allowed = (
        f"allowed: {', '.join(PLACEMENT_STRATEGIES)}, a device (cpu, cuda:N), or a mapping from "
        "module names to devices"
    )
    if isinstance(device_map, str):
        if device_map not in PLACEMENT_STRATEGIES:
            try:
                check_device(device_map)
            except ModelError as error:
                raise ModelError(f"device_map {device_map!r} is no placement: {error}; {allowed}") from None
        return
    if not isinstance(device_map, dict) or not all(isinstance(k, str) for k in device_map):
        raise ModelError(f"device_map {device_map!r} is no placement; {allowed}")
    for device in device_map.values():
        if isinstance(device, int) and not isinstance(device, bool):
            check_device(f"cuda:{device}")
        elif device != "disk":
            check_device(device)


def check_model_files(
    name_or_path: str | os.PathLike, device: str | torch.device = "cpu", device_map: Any = None,
    trust_remote_code: bool = False,
) -> None:
    """Check the device (or the ``device_map`` that places the model) and, for a directory, its
    ``config.json`` and weights. A name that is not a directory is left to the loader (a
    zoo name, or its "no model directory" error), and so are the weights of a checkpoint
    the loader refuses from its config alone (an unsupported family, or its own modelling
    code without ``trust_remote_code``): that refusal says more.

    :raises ModelError: naming the file or device that cannot be used.
    """
    from dloom.profiles import detect_profile, needs_remote_code

    if device_map is None:
        check_device(device)
    else:
        check_device_map(device_map)
    directory = Path(name_or_path).expanduser()
    if not directory.is_dir():
        from dloom import zoo

        if str(name_or_path) not in zoo.MODEL_NAMES:
            return
        directory = zoo.locate(str(name_or_path))
    config = check_config(directory)
    profile = detect_profile(config)
    if profile.unsupported or (needs_remote_code(config, profile) and not trust_remote_code):
        return
    check_weights(directory)
