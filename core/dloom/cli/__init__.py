"""The ``dloom`` command line, on top of the library, the server and Ray.

* :mod:`dloom.cli.commands`: the Typer application :data:`app` and its commands (the
  ``dloom`` console script is ``dloom.cli:app``).
* :mod:`dloom.cli.plugins`: the command group that adds the plugins' commands and strategy
  options.
* :mod:`dloom.cli.exits`: how a command ends on Ctrl-C or on results it cannot write.
* :mod:`dloom.cli.profile`: ``dloom profile``, a model's forward cost curve.
"""

from dloom.cli.commands import app
from dloom.cli.profile import profile

app.command()(profile)

__all__ = ["app"]
