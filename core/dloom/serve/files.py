"""Server files a request may name: a client never names a path on the server.

A strategy parameter declared with ``path=True`` (:class:`~dloom.types.Parameter`) reads a
file. In a request its value must be ``""`` (the strategy's own default) or the *name* of a
file in one of the directories the operator allowed (``dloom serve --graph-dir DIR``) or of
the parameter's own ``path_files`` (the plugin's built-in files); the server replaces the
name with the file's path. Anything else is refused with the same
message whatever it names, so a refusal tells nothing about the server's file system: the
requested value is compared with the allowed directories' listings, never looked up.

No answer names a path on the server either: :class:`PathHider` shortens every server path
it knows (the offered directories, the plugins' own file directories, the served
checkpoints) in an error message to the name a client knows it by (a graph's file name, a
checkpoint's directory name).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dloom.errors import ConfigurationError
from dloom.hooks.composition import compose
from dloom.hooks.registry import get_registry

SHOWN = 20
"""Offered names a refusal lists, at most."""


class ServerFiles:
    """The files requests may name, by name, from the operator's directories.

    :param directories: the allowed directories (their files, not their subdirectories);
        a name found in several is taken from the first.
    :raises ConfigurationError: when a directory does not exist.
    """

    def __init__(self, directories: Sequence[str | Path] = ()) -> None:
        self.directories = [Path(d) for d in directories]
        for directory in self.directories:
            if not directory.is_dir():
                raise ConfigurationError(f"--graph-dir {str(directory)!r} is not a directory")

    def listing(self, own: Sequence[str] = ()) -> dict[str, Path]:
        """The files requests may name now, name -> path: the operator's directories' files,
        then those matching a parameter's ``own`` glob patterns (read at each call: files
        the operator adds are offered at once)."""
        found: dict[str, Path] = {}
        paths = [path for directory in self.directories for path in sorted(directory.iterdir())]
        paths += [Path(path) for pattern in own for path in sorted(glob.glob(pattern))]
        for path in paths:
            if path.is_file():
                found.setdefault(path.name, path)
        return found

    def resolve(self, strategy: str, params: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """``params`` of a request for ``strategy``, with each path parameter's file name
        replaced by its path on the server.

        :raises ConfigurationError: for a path parameter that is not ``""`` or an allowed
            file's name (an unknown strategy or parameter raises the decoder's own error).
        """
        if not params:
            return None if params is None else dict(params)
        components = [c for c in compose(strategy).components if c.strategy is not None]
        resolved = dict(params)
        for key, value in params.items():
            target, _, name = key.rpartition(".")
            declared = [
                p for c in components if not target or c.name == target
                for p in c.strategy.parameters if p.name == name  # type: ignore[union-attr]
            ]
            paths = [p for p in declared if p.path]
            if not paths or value == "":
                continue
            offered = self.listing([pattern for p in paths for pattern in p.path_files])
            if not isinstance(value, str) or value not in offered:
                shown = [repr(n) for n in list(offered)[:SHOWN]]
                names = ", ".join(shown + ([f"and {len(offered) - SHOWN} more"] if len(offered) > SHOWN else [])) or (
                    "none (the operator offers files with dloom serve --graph-dir DIR)"
                )
                given = repr(value)
                raise ConfigurationError(
                    f"parameter {key!r} is {given if len(given) <= 80 else given[:77] + '...'}; a request may not "
                    f"name a path on the server, only one of the files this server offers: {names}; or '' for "
                    "the strategy's default"
                )
            resolved[key] = str(offered[value])
        return resolved


def offered_directories(files: ServerFiles) -> list[Path]:
    """The directories whose files requests may name: the operator's, and those of every
    registered strategy's path parameter's own ``path_files`` patterns."""
    patterns = [
        pattern for strategy in get_registry().strategies.values() for parameter in strategy.parameters
        if parameter.path for pattern in parameter.path_files
    ]
    return [*files.directories, *(Path(os.path.dirname(pattern)) for pattern in patterns)]


class PathHider:
    """Shortens the server paths it is given, in a message meant for a client.

    A file under one of ``directories`` is shortened to its path below it (``broken.json``);
    a path in ``named`` (a checkpoint directory), or a directory itself, to its last
    component. Each path is matched as given and resolved (a relative ``--graph-dir``, a
    symlinked directory), longest first.

    :param directories: directories whose files clients name by file name.
    :param named: paths clients know by their last component (``/models/x`` is ``x``).
    """

    def __init__(self, directories: Iterable[str | Path] = (), named: Iterable[str | Path] = ()) -> None:
        spellings: dict[str, str] = {}
        for path in [*directories, *named]:
            for spelling in {str(path), str(Path(path).resolve())}:
                if len(Path(spelling).parts) > 1:  # never "/", "" or "."
                    spellings[spelling] = Path(spelling).name
        self.spellings = sorted(spellings.items(), key=lambda item: len(item[0]), reverse=True)

    def hide(self, message: str) -> str:
        """``message`` with each known server path shortened (see the class docstring)."""
        for spelling, name in self.spellings:
            if spelling in message:
                message = message.replace(spelling + os.sep, "").replace(spelling, name)
        return message
