"""How the ``dloom`` command ends when it cannot go on: Ctrl-C, and results it cannot write.

* **Ctrl-C while starting** is :mod:`dloom.startup`'s (importing :mod:`dloom` installs its
  handler before the heavy imports).
* **Ctrl-C later.** A ``KeyboardInterrupt`` that no command turned into its own report
  (while plugins load, or in the imports a command does first) ends with one line and
  status 130 (:func:`end_quietly`).
* **Results that cannot be written.** A full disk (``ENOSPC``), a file over its size limit
  (``EFBIG``), a closed pipe: :func:`write_results` raises :class:`OutputError` naming the
  stream (and the file behind it), and the command exits with :data:`EXIT_OUTPUT_ERROR`
  after keeping what was written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TextIO, TypeVar

from dloom.errors import OutputError
from dloom.startup import EXIT_INTERRUPTED

EXIT_OUTPUT_ERROR = 74
"""Exit status when the results cannot be written (``EX_IOERR`` of ``sysexits.h``); 2 stays
the status of a refused input, 1 of a refuted claim (``dloom check``)."""

T = TypeVar("T")


def stream_name(stream: TextIO) -> str:
    """``"stdout"``, with the file behind it where the system says (``"stdout
    (/tmp/out.jsonl)"``)."""
    name = {1: "stdout", 2: "stderr"}
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return "stdout"
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return name.get(fd, f"file descriptor {fd}")
    return f"{name.get(fd, f'file descriptor {fd}')} ({target})"


def _discard_rest(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at the null device, so that the interpreter's last
    flush of the lines that could not be written succeeds instead of failing again."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def _write_through(stream: TextIO, text: str) -> None:
    """Write ``text`` to ``stream``'s descriptor until every byte is taken (what the stream
    buffered goes first). A buffered stream reports a short write (a file reaching its size
    limit takes part of the text) as success and loses the rest at exit; writing the
    descriptor directly makes the write after it raise ``EFBIG``. A stream without a
    descriptor (a test's capture) is written and flushed as it is."""
    stream.flush()
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        stream.write(text)
        stream.flush()
        return
    data = memoryview(text.encode(getattr(stream, "encoding", None) or "utf-8"))
    while data:
        data = data[os.write(fd, data):]


def write_results(stream: TextIO, text: str) -> None:
    """Write ``text`` to ``stream`` and flush it.

    :raises OutputError: naming the stream (and its file) and the system's reason, for any
        ``OSError`` (what was written before stays written).
    """
    try:
        _write_through(stream, text)
    except OSError as error:
        where = stream_name(stream)
        _discard_rest(stream)
        raise OutputError(
            f"cannot write the results to {where}: {error.strerror or error}; what was "
            "written before is kept"
        ) from None


def end_quietly(run: Callable[[], T]) -> T:
    """``run()``, ending a ``KeyboardInterrupt`` with one line and status 130 and an
    :class:`OutputError` (or another ``OSError``) with one line and
    :data:`EXIT_OUTPUT_ERROR`, never a traceback."""
    import typer
    from rich.console import Console
    from rich.markup import escape

    errors = Console(stderr=True)
    try:
        return run()
    except KeyboardInterrupt:
        errors.print("[yellow]interrupted:[/] stopped by Ctrl-C before the command finished", highlight=False)
        raise typer.Exit(code=EXIT_INTERRUPTED) from None
    except (OutputError, OSError) as error:
        errors.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
        raise typer.Exit(code=EXIT_OUTPUT_ERROR) from None
