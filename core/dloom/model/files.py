"""Checks on a checkpoint directory and a device, before ``transformers`` reads anything.

:func:`check_model_files` turns what would be a ``JSONDecodeError``, a ``SafetensorError``,
an ``OSError``, a pickle refusal, an ``AssertionError`` ("Torch not compiled with CUDA") or a
``RuntimeError`` ("Expected one of cpu, cuda, ... device type") deep inside the loaders into
a :class:`~dloom.errors.ModelError` naming the file or the device and what is allowed.

Weights are read only from safetensors files (one ``*.safetensors`` or shards listed by a
``*.safetensors.index.json``): a pickle checkpoint (``*.bin``, ``*.pt``, ``*.pth``) can run
code when loaded, and dloom never loads one. Each safetensors file is checked without
reading its tensors: the 8-byte header length, the JSON header (through the bounded reader
of :mod:`dloom.model.json_files`, as ``config.json`` is), and that every tensor has a known
dtype and a shape whose byte size is its byte range, inside the file, and that the ranges
follow one another from the start of the data to its end without overlap or gap, as the
safetensors reader demands (a truncated download, a header that lies about a size, or two
tensors sharing bytes, fails here). :func:`tensor_headers` gives
those entries to :func:`dloom.model.tensor_check.check_tensors`.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dloom.errors import ModelError
from dloom.model.config_limits import check_config
from dloom.model.json_files import parse_json, read_json_object

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DEVICE_TYPES = ("cpu", "cuda", "mps")
MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
"""The safetensors dtypes dloom reads, with their sizes in bytes."""
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


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


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's entry in a safetensors header: ``dtype`` (safetensors' name, ``"BF16"``),
    ``shape`` and its size in bytes."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def floating(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def _header_entry(path: Path, name: str, entry: Any, data_bytes: int) -> TensorHeader:
    """The checked header entry of tensor ``name``: a known dtype, a shape of
    non-negative integers, and a byte range inside the data whose length is the shape's."""
    where = f"weights file {str(path)!r}"
    if not isinstance(entry, dict):
        raise ModelError(f"{where} has a corrupt entry for tensor {name!r}")
    offsets, dtype, shape = entry.get("data_offsets"), entry.get("dtype"), entry.get("shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise ModelError(f"{where} has a corrupt entry for tensor {name!r}")
    if dtype not in DTYPE_BYTES:
        raise ModelError(
            f"{where} gives tensor {name!r} dtype {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}"
        )
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ModelError(f"{where} gives tensor {name!r} shape {shape!r}; allowed: a list of sizes >= 0")
    begin, end = offsets
    if offsets[1] > data_bytes:
        raise ModelError(
            f"weights file {str(path)!r} is truncated: tensor {name!r} ends at byte "
            f"{offsets[1]} of the data, which holds {data_bytes}"
        )
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if not 0 <= begin <= end or end - begin != nbytes:
        raise ModelError(
            f"{where} lies about tensor {name!r}: its header gives bytes {begin} .. {end}, but "
            f"shape {shape} of {dtype} takes {nbytes} bytes"
        )
    return TensorHeader(dtype, tuple(shape), nbytes)


def check_safetensors(path: Path) -> dict[str, TensorHeader]:
    """Check one safetensors file's header and that its tensors lie inside the file.

    :return: each tensor's header entry, by name, in header order.
    :raises ModelError: naming the file and what is wrong with it.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            header_bytes = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if size < 8:
                raise ModelError(f"weights file {str(path)!r} is {size} bytes: empty or truncated")
            if header_bytes > min(size - 8, MAX_HEADER_BYTES):
                raise ModelError(
                    f"weights file {str(path)!r} is truncated or not safetensors: its header "
                    f"claims {header_bytes} bytes, the file has {size}"
                )
            raw_header = handle.read(header_bytes)
    except OSError as error:
        raise ModelError(f"cannot read weights file {str(path)!r}: {error.strerror or error}") from None
    try:
        header = parse_json(raw_header, f"the safetensors header of {str(path)!r}")
    except ModelError:
        raise ModelError(f"weights file {str(path)!r} has a corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise ModelError(f"weights file {str(path)!r} has a corrupt safetensors header")
    data_bytes = size - 8 - header_bytes
    entries = {
        name: _header_entry(path, name, entry, data_bytes)
        for name, entry in header.items() if name != "__metadata__"
    }
    _check_ranges(path, {name: header[name]["data_offsets"] for name in entries}, data_bytes)
    return entries


def _check_ranges(path: Path, offsets: dict[str, list[int]], data_bytes: int) -> None:
    """Refuse byte ranges that overlap, leave a gap, or end before the data does (the
    safetensors reader refuses each, with a ``SafetensorError``).

    :param offsets: each tensor's ``[begin, end)`` in the data, already checked to lie in it.
    """
    where = f"weights file {str(path)!r}"
    allowed = "allowed: byte ranges that follow one another without overlap or gap"
    previous, reached = None, 0
    for name, (begin, end) in sorted(offsets.items(), key=lambda item: tuple(item[1])):
        if begin < reached:
            raise ModelError(
                f"{where} gives tensor {name!r} bytes {begin} .. {end}, which overlap tensor "
                f"{previous!r}'s (up to byte {reached}); {allowed}"
            )
        if begin > reached:
            raise ModelError(f"{where} leaves bytes {reached} .. {begin} before tensor {name!r} unused; {allowed}")
        previous, reached = name, end
    if reached != data_bytes:
        raise ModelError(
            f"{where} holds {data_bytes - reached} bytes after its last tensor; {allowed}, to the "
            "end of the file"
        )


def _indexed_shards(index: Path) -> list[Path]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelError(f"shard index {str(index)!r} is corrupt: expected a JSON 'weight_map'")
    shards = sorted(set(weight_map.values()))
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


def tensor_headers(directory: Path) -> dict[str, TensorHeader]:
    """Every tensor in ``directory``'s safetensors files (headers only), by name.

    :raises ModelError: as :func:`check_weights`.
    """
    return {name: entry for path in check_weights(directory) for name, entry in check_safetensors(path).items()}


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
    from dloom.hooks.registry import get_registry
    from dloom.model.families import needs_remote_code

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
    family = get_registry().families.detect(config)
    if family.profile.unsupported or (needs_remote_code(config, family) and not trust_remote_code):
        return
    check_weights(directory)
