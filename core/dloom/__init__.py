# ruff: noqa: E402 - the startup Ctrl-C handler is installed before the heavy imports
"""dloom: faster decoding for diffusion language models, without changing what they say.

The public API: load a model, build a decoder from a strategy, generate::

    import dloom
    model = dloom.load_model("toy-dllm")
    decoder = dloom.DiffusionDecoder(model, "threshold", tau=0.9)
    result = decoder.generate(["copy abc"])

An autoregressive target decodes with a strategy that drafts token chains for it
(``dloom.ARTargetDecoder(target, "failfast", drafter=dllm)``).
"""

from dloom import startup

startup.install_startup_handler()  # the `dloom` command only: Ctrl-C while importing exits 130

from dloom.ar.decoder import ARTargetDecoder
from dloom.decode.decoder import DiffusionDecoder
from dloom.hooks.composition import replace
from dloom.hooks.registry import get_registry
from dloom.hooks.specs import hookimpl, reads_signals
from dloom.metrics import GenerationResult
from dloom.model.adapter import ModelAdapter, load_model
from dloom.model.families import FamilyRegistration
from dloom.types import (
    BlockSchedule,
    ChainLayout,
    ChainState,
    ChainVerdict,
    Claim,
    DecodeState,
    DraftChains,
    DraftGraph,
    Edits,
    Parameter,
    StrategyRegistration,
    Verdict,
    VerificationLayout,
)

__all__ = [
    "ARTargetDecoder",
    "BlockSchedule",
    "ChainLayout",
    "ChainState",
    "ChainVerdict",
    "Claim",
    "DecodeState",
    "DiffusionDecoder",
    "DraftChains",
    "DraftGraph",
    "Edits",
    "FamilyRegistration",
    "GenerationResult",
    "ModelAdapter",
    "Parameter",
    "StrategyRegistration",
    "Verdict",
    "VerificationLayout",
    "get_registry",
    "hookimpl",
    "load_model",
    "reads_signals",
    "replace",
]
__version__ = "0.1.0"
