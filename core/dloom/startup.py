"""Ctrl-C while the ``dloom`` command starts: one line and status 130, not a traceback.

Importing torch and transformers takes a second or more; a Ctrl-C then would print a
traceback from deep inside an import. When this process is the ``dloom`` command
(``sys.argv[0]`` is a file named ``dloom``), importing :mod:`dloom` first installs
:func:`exit_while_starting` as the SIGINT handler: one line on stderr, exit status 130,
nothing done. :func:`hand_interrupts_to_commands` gives Ctrl-C back to Python
(``KeyboardInterrupt``) once the command line runs, and the commands keep what they
finished. A library user's ``import dloom`` is left alone. Only the standard library is
imported here, so that the handler is in place before anything heavy loads.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, NoReturn

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""
STARTING_MESSAGE = "interrupted: dloom was starting (importing, loading plugins); nothing was done\n"


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
