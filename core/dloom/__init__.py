"""dloom: faster decoding for diffusion language models, without changing what they say.

The public API: load a model, build a decoder from a strategy, generate::

    import dloom
    model = dloom.load_model("toy-dllm")
    decoder = dloom.DiffusionDecoder(model, "threshold", tau=0.9)
    result = decoder.generate(["copy abc"])
"""

from dloom.hookspecs import hookimpl
from dloom.types import (
    BlockSchedule,
    Claim,
    DecodeState,
    DraftGraph,
    Parameter,
    StrategyRegistration,
    Verdict,
    VerificationLayout,
)
from dloom.adapter import ModelAdapter, load_model
from dloom.engine import DiffusionDecoder
from dloom.metrics import GenerationResult
from dloom.registry import get_registry

__all__ = [
    "BlockSchedule",
    "Claim",
    "DecodeState",
    "DiffusionDecoder",
    "DraftGraph",
    "GenerationResult",
    "ModelAdapter",
    "Parameter",
    "StrategyRegistration",
    "Verdict",
    "VerificationLayout",
    "get_registry",
    "hookimpl",
    "load_model",
]
__version__ = "0.1.0"
