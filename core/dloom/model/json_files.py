"""One bounded JSON reader for every file of a checkpoint (``config.json``,
``generation_config.json``, the shard index, the tokenizer's files, safetensors headers).

A checkpoint directory is input from anywhere, so its JSON is read with limits: at most
:data:`MAX_JSON_BYTES` bytes (:data:`MAX_TOKENIZER_BYTES` for ``tokenizer.json``, whose
vocabulary and merges are large) and at most :data:`MAX_JSON_DEPTH` levels of nesting
(a ``[[[[...]]]]`` bomb would otherwise end in ``RecursionError``, or slow every later
walk over the value). Whatever is wrong (unreadable, not UTF-8, not JSON, too large, too
deep, an integer of more than :data:`MAX_INT_DIGITS` digits, not an object where one is
needed) becomes a :class:`~dloom.errors.ModelError` that names the file (and the field of a
too long integer). A file is refused by its size before any of it is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dloom.errors import ModelError

MAX_JSON_BYTES = 16 * 1024 * 1024
"""The largest configuration file read (a real ``config.json`` is a few kilobytes)."""
MAX_TOKENIZER_BYTES = 512 * 1024 * 1024
"""The largest ``tokenizer.json`` read (a 256k-token vocabulary with merges is ~30 MB)."""
MAX_JSON_DEPTH = 32
"""The deepest nesting accepted (real configs and tokenizers nest fewer than 10 levels)."""
MAX_INT_DIGITS = 64
"""The longest integer accepted, in digits (every size, id and offset fits in 20)."""


class _LongInteger:
    """What a JSON integer of more than :data:`MAX_INT_DIGITS` digits parses to, so that the
    field holding it can be named (Python refuses to convert one of 4,300 digits at all)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _bounded_int(text: str) -> int | _LongInteger:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_INT_DIGITS else _LongInteger(digits)


def _long_integer_field(value: Any) -> tuple[str, _LongInteger] | None:
    """The path (``"dloom.block_length"``, ``"ids[3]"``) and marker of the first too long
    integer in a parsed value, walked without recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, _LongInteger):
            return path or "the value", item
        if isinstance(item, dict):
            stack.extend((f"{path}.{key}" if path else str(key), child) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((f"{path}[{index}]", child) for index, child in enumerate(item))
    return None


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0, ``[]`` is 1), walked without
    recursion and stopping once it exceeds ``limit`` (then ``limit + 1`` is returned)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children if isinstance(child, (dict, list)))
    return deepest


def parse_json(data: bytes, where: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``data`` parsed as JSON.

    :param where: what the data is, for the message (``"'ckpt/config.json'"``).
    :raises ModelError: naming ``where``: not UTF-8, not JSON (with line and column),
        nested deeper than ``max_depth``, or an integer longer than :data:`MAX_INT_DIGITS`
        digits (naming its field).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ModelError(f"{where} is not UTF-8 text: {error}") from None
    long_integers: list[int] = []

    def parse_int(digits: str) -> int | _LongInteger:
        parsed = _bounded_int(digits)
        if isinstance(parsed, _LongInteger):
            long_integers.append(parsed.digits)
        return parsed

    try:
        value = json.loads(text, parse_int=parse_int)
    except json.JSONDecodeError as error:
        raise ModelError(
            f"{where} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None
    except RecursionError:
        raise ModelError(f"{where} nests JSON deeper than {max_depth} levels; allowed: {max_depth}") from None
    if json_depth(value, max_depth) > max_depth:
        raise ModelError(f"{where} nests JSON deeper than {max_depth} levels; allowed: {max_depth}")
    found = _long_integer_field(value) if long_integers else None
    if found is not None:
        field, integer = found
        raise ModelError(
            f"{where} {field} is an integer of {integer.digits} digits; allowed: at most "
            f"{MAX_INT_DIGITS} digits"
        )
    return value


def read_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in file ``path``, read with the limits above.

    :raises ModelError: naming the file: unreadable (missing, a directory, a symlink loop,
        no permission), larger than ``max_bytes`` (by its size, before reading it), or as
        :func:`parse_json`.
    """
    where = repr(str(path))
    too_large = f"{where} is larger than {max_bytes} bytes; allowed: up to {max_bytes}"
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > max_bytes:
                raise ModelError(too_large)
            # a read of n bytes allocates n at once: read the size the file has, then what a
            # growing file (or a /proc file, of size 0) has beyond it, up to the limit
            data = handle.read(size + 1)
            if len(data) > size:
                data += handle.read(max_bytes + 1 - len(data))
    except OSError as error:
        raise ModelError(f"cannot read {where}: {error.strerror or error}") from None
    if len(data) > max_bytes:
        raise ModelError(too_large)
    return parse_json(data, where)


def read_json_object(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object.

    :raises ModelError: as :func:`read_json`, or naming the JSON type found instead.
    """
    value = read_json(path, max_bytes=max_bytes)
    if not isinstance(value, dict):
        raise ModelError(f"{str(path)!r} holds a JSON {type(value).__name__}; expected an object")
    return value
