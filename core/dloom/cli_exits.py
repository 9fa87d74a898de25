"""How the ``dloom`` command ends when it cannot go on: Ctrl-C, and results it cannot write.

* **Ctrl-C while starting.** Importing torch and transformers takes a second or more; a
  Ctrl-C then would print a traceback from deep inside an import. When this process is the
  ``dloom`` command (``sys.argv[0]`` is a file named ``dloom``), importing :mod:`dloom` first
  installs :func:`exit_while_starting` as the SIGINT handler: one line on stderr, exit
  status 130, nothing done. :func:`hand_interrupts_to_commands` gives Ctrl-C back to Python
  (``KeyboardInterrupt``) once the command line runs, and the commands keep what they
  finished. A library user's ``import dloom`` is left alone.
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
import signal
import sys
import threading
from typing import Any, Callable, NoReturn, TextIO, TypeVar

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""
EXIT_OUTPUT_ERROR = 74
"""Exit status when the results cannot be written (``EX_IOERR`` of ``sysexits.h``); 2 stays
the status of a refused input, 1 of a refuted claim (``dloom check``)."""
STARTING_MESSAGE = "interrupted: dloom was starting (importing, loading plugins); nothing was done\n"

T = TypeVar("T")


class OutputError(Exception):
    """The results could not be written; the message names the stream or file."""


def exit_while_starting(number: int, frame: Any) -> NoReturn:
    """SIGINT handler while ``dloom`` starts: one line, status 130, no traceback."""
    os.write(2, STARTING_MESSAGE.encode())
    os._exit(EXIT_INTERRUPTED)


def is_the_command() -> bool:
    """Whether this process is the ``dloom`` console script."""
    return bool(sys.argv) and os.path.basename(sys.argv[0]).removesuffix(".exe") == "dloom"


def install_startup_handler() -> None:
    """Install :func:`exit_while_starting` when this process is the ``dloom`` command and
    Ctrl-C still has Python's default handler (a background job that ignores it keeps
    ignoring it)."""
    if (
        is_the_command()
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, exit_while_starting)


def hand_interrupts_to_commands() -> None:
    """Make Ctrl-C raise ``KeyboardInterrupt`` again (the commands report what they kept)."""
    if signal.getsignal(signal.SIGINT) is exit_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
