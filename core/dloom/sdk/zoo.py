"""The SDK's view of the toy zoo: the model names it resolves and the prompts of its task
suite (for a plugin that calibrates or evaluates on them, as Spiffy's ``dloom calibrate``).

``MODEL_NAMES``: the zoo's model names (``toy-dllm``, ``toy-ar``, ...), which ``--model``
and :func:`dloom.load_model` resolve.

Importing this module imports the task suite; :mod:`dloom.sdk` does not. The version policy
is :mod:`dloom.sdk`'s.
"""

from __future__ import annotations

from dloom.evaluation import SPLITS, select_examples
from dloom.zoo import MODEL_NAMES

__all__ = ["MODEL_NAMES", "SPLITS", "select_examples"]
