"""The module paths of dloom 0.1's flat layout, found for one more release.

dloom's modules moved into subpackages by role (:mod:`dloom.hooks`, :mod:`dloom.model`,
:mod:`dloom.decode`, :mod:`dloom.ar`, :mod:`dloom.cli`). Importing an old path, say
``dloom.engine``, still works: :class:`OldPathFinder` (installed by ``import dloom``) warns
with a ``DeprecationWarning`` naming the old and the new path, and the old name becomes
the new module itself, the same object, so that private names resolve and
``mock.patch("dloom.engine.x")`` patches what the code uses. Three old modules became
package names (``dloom.hooks``, ``dloom.ar``, ``dloom.cli``); their names are found by
each package's own module ``__getattr__``. The trainer left the installed package for
``training/dloom_training/`` of a source checkout; ``python -m dloom.zoo.train`` still runs it
there (:class:`_Trainer`).

The next release deletes this module and the line of ``dloom/__init__.py`` installing it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import CodeType, ModuleType

MOVED = {
    "dloom.hookspecs": "dloom.hooks.specs",
    "dloom.registry": "dloom.hooks.registry",
    "dloom.composition": "dloom.hooks.composition",
    "dloom.adapter": "dloom.model.adapter",
    "dloom.cache": "dloom.model.runner",
    "dloom.profiles": "dloom.model.profiles",
    "dloom.checkpoints": "dloom.model.checkpoints",
    "dloom.model_files": "dloom.model.files",
    "dloom.attention": "dloom.model.attention",
    "dloom.tensor_check": "dloom.model.tensor_check",
    "dloom.config_limits": "dloom.model.config_limits",
    "dloom.json_files": "dloom.model.json_files",
    "dloom.engine": "dloom.decode.decoder",
    "dloom.decoding": "dloom.decode.decoders",
    "dloom.running_batch": "dloom.decode.session",
    "dloom.kernel": "dloom.decode.kernel",
    "dloom.speculation": "dloom.decode.speculation",
    "dloom.generation": "dloom.decode.generation",
    "dloom.prompt_validation": "dloom.decode.prompts",
    "dloom.commit": "dloom.decode.commit",
    "dloom.commit_logprobs": "dloom.decode.logprobs",
    "dloom.batching": "dloom.decode.batching",
    "dloom.oracle": "dloom.decode.oracle",
    "dloom.ar_decoder": "dloom.ar.decoder",
    "dloom.ar_result": "dloom.ar.result",
    "dloom.chains": "dloom.ar.chains",
    "dloom.cli_exits": "dloom.cli.exits",
    "dloom.cli_plugins": "dloom.cli.plugins",
    "dloom.zoo.train": "dloom_training.train",
}
"""Each old module path and the module now at its place."""
RENAMED_PACKAGES = {
    "dloom.hooks": "dloom.hooks.calls",
    "dloom.ar": "dloom.ar.target",
    "dloom.cli": "dloom.cli.commands",
}
"""Old modules whose names are now packages: ``dloom.hooks.select_commit`` is found in
``dloom.hooks.calls`` (by the package's ``__getattr__``)."""
TRAINER = "dloom.zoo.train"
"""The trainer's old path; its new module lives outside the package, in ``training/``."""
TRAINING_DIR = Path(__file__).resolve().parents[2] / "training"
"""``training/`` of the source checkout this package is in (a wheel has none)."""


def warn_moved(old: str, new: str, stacklevel: int) -> None:
    """The ``DeprecationWarning`` for an old path; ``stacklevel`` counts from the caller
    (importlib's own frames are skipped), so that the warning names the line using it."""
    warnings.warn(
        f"{old} moved to {new}; the old path goes in the next dloom release",
        DeprecationWarning, stacklevel=stacklevel + 1,
    )


class _SameModule(importlib.abc.Loader):
    """Loads an old path as the module now at its place (the very object)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        warn_moved(self.old, self.new, stacklevel=2)


class _Trainer(_SameModule):
    """The old trainer path: imported, it is ``dloom_training.train``; run as
    ``python -m dloom.zoo.train``, its code warns (from ``__main__``, so the warning shows)
    and calls the new ``main``."""

    def get_code(self, fullname: str) -> CodeType:
        message = (f"python -m {self.old} moved to `PYTHONPATH=training python -m {self.new}`; "
                   "the old command goes in the next dloom release")
        source = f"import warnings\nwarnings.warn({message!r}, DeprecationWarning)\nfrom {self.new} import main\nmain()\n"
        return compile(source, f"<{self.old}, forwarding to {self.new}>", "exec")


class OldPathFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED` and nothing else."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        if fullname != TRAINER:
            return importlib.machinery.ModuleSpec(fullname, _SameModule(fullname, new))
        if not (TRAINING_DIR / "dloom_training" / "train.py").is_file():  # an installed wheel
            raise ModuleNotFoundError(
                f"{TRAINER} moved out of the installed package to training/dloom_training/train.py "
                f"of a dloom source checkout; run it there with `PYTHONPATH=training python -m {new}`",
                name=fullname,
            )
        if str(TRAINING_DIR) not in sys.path:
            sys.path.append(str(TRAINING_DIR))
        trainer = TRAINING_DIR / "dloom_training" / "train.py"
        return importlib.machinery.ModuleSpec(fullname, _Trainer(fullname, new), origin=str(trainer))


def install() -> None:
    """Put :class:`OldPathFinder` first on ``sys.meta_path``, once: it answers only the old
    paths, before an editable install's finder could find a stale file of the old layout."""
    if not any(isinstance(finder, OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())


def old_attribute(package: str, name: str) -> object:
    """``package.name`` for a name of the old module ``package`` (:data:`RENAMED_PACKAGES`),
    with a ``DeprecationWarning``; an ``AttributeError`` for a submodule not yet imported, a
    dunder or a name the old module did not have.

    Called by the packages' module ``__getattr__``."""
    import pkgutil

    new = RENAMED_PACKAGES[package]
    missing = AttributeError(f"module {package!r} has no attribute {name!r}")
    submodules = {info.name for info in pkgutil.iter_modules(sys.modules[package].__path__)}
    if name.startswith("__") or name in submodules:
        raise missing
    module = importlib.import_module(new)
    if not hasattr(module, name):
        raise missing
    warn_moved(f"{package}.{name}", f"{new}.{name}", stacklevel=3)
    return getattr(module, name)
