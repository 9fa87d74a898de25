"""The dloom plugin SDK: the one import path for plugins.

A strategy plugin, built-in or third party, imports what it needs from here (and the
top-level API of :mod:`dloom`), never from the modules that implement it::

    from dloom.sdk import StrategyRegistration, Parameter, commit_top, hookimpl, sorted_profile

The names in ``__all__`` below are the SDK, with two namespaces imported on demand:
:mod:`dloom.sdk.cli` (for plugins that add commands) and :mod:`dloom.sdk.zoo` (the toy
zoo's model names and task prompts). Every other module of the package (``dloom.decode``,
``dloom.model``, ``dloom.hooks``, ``dloom.ar``, ...) is internal: it may move or change in
any release, and only the SDK's modules map its names to where they live now.

Names the reference below lists without an entry of their own:

* ``hookimpl``: the marker of a hook implementation, ``@hookimpl def dloom_select_commit(...)``
  (a function or a method; the hooks are in the hook reference);
* ``DIFFUSION`` (``"diffusion"``) and ``AR_TARGET`` (``"ar-target"``): the decoders a
  registration's ``decoder`` names;
* ``StrategySpec``: what names a strategy, a string (``"spiffy+quota"``), a plugin object or
  a list of those;
* ``ACCEPT_TAG`` and ``RESAMPLE_TAG``: the tags of the arrays a chain verifier draws from a
  row's :class:`RowStreams` besides the target kernel's own sample (the ratio test's accept
  and resample draws; a drafter's kernel steps use the tags 0 and 1).

**Version policy.** dloom is 0.x. In 0.x:

* a patch release (``0.x.y`` to ``0.x.y+1``) changes no name, signature or field of the SDK;
* a minor release (``0.x`` to ``0.x+1``) may rename or remove an SDK name, a hook argument
  or a field of a hook type only after announcing it: the old spelling keeps working for at
  least one minor release, warns with a ``DeprecationWarning`` naming its replacement, and
  the change is listed in the changelog under "Deprecated", then under "Removed";
* adding a name, an optional argument with a default, or a field with a default is not a
  change to announce;
* the hook specifications (the ``dloom_*`` hooks: their names, arguments, and what they
  ask and guarantee) are part of the SDK, as are the errors below and what each means.

1.0 will freeze the SDK under semantic versioning.
"""

from __future__ import annotations

from dloom.ar.chains import (
    ACCEPT_TAG,
    RESAMPLE_TAG,
    TargetKernel,
    chain_layout,
    match_chains,
)
from dloom.ar.decoder import ARTargetDecoder, load_ar_target_decoder
from dloom.decode.commit import (
    commit_top,
    offered_fills,
    sorted_profile,
    threshold_edits,
)
from dloom.decode.decoder import DiffusionDecoder
from dloom.decode.decoders import Decoder, decoder_kind
from dloom.decode.kernel import (
    KernelStep,
    RowStreams,
    gumbel_argmax,
    propose,
    uniform_noise,
    without_mask,
)
from dloom.decode.session import StepRecord
from dloom.decode.speculation import follow_graph, layout_drafts
from dloom.decode.step import (
    BlockForwards,
    ForwardPlan,
    PlainStepper,
    SpeculativeStepper,
    StepInput,
    StepOutcome,
    Stepper,
)
from dloom.decode.transition import KERNELS, Settlement, TransitionKernel
from dloom.errors import (
    CompositionError,
    ConfigurationError,
    DloomError,
    HookContractError,
    ModelError,
    NonFiniteLogitsError,
    PluginLoadError,
    UnknownStrategyError,
    warn,
)
from dloom.hooks.composition import Composition, StrategySpec, compose, replace
from dloom.hooks.registry import Registry, get_registry
from dloom.hooks.specs import COMMIT_SIGNALS, hookimpl, reads_signals
from dloom.metrics import GenerationResult
from dloom.model.adapter import (
    ModelAdapter,
    load_model,
    padding_or_none,
    position_ids_from_mask,
)
from dloom.model.cache_policy import CachePolicy, DualCache, NoCache, PrefixCache
from dloom.model.cost import CostCurve, measure_cost_curve
from dloom.model.families import FamilyRegistration
from dloom.model.profiles import ModelProfile
from dloom.model.runner import BlockForward, record_view
from dloom.types import (
    AR_TARGET,
    DIFFUSION,
    BlockSchedule,
    ChainLayout,
    ChainState,
    ChainVerdict,
    Claim,
    DecodeState,
    DraftChains,
    DraftGraph,
    Edits,
    NodeLogits,
    Parameter,
    StrategyRegistration,
    Verdict,
    VerificationLayout,
)

__all__ = [
    # registering a strategy (the `dloom` entry point's module answers dloom_register_strategies)
    "hookimpl",
    "StrategyRegistration",
    "Parameter",
    "Claim",
    "DIFFUSION",
    "AR_TARGET",
    # what the decoding hooks receive and return
    "BlockSchedule",
    "Edits",
    "DecodeState",
    "DraftGraph",
    "VerificationLayout",
    "NodeLogits",
    "Verdict",
    "ChainState",
    "DraftChains",
    "ChainLayout",
    "ChainVerdict",
    # errors a plugin raises, and warnings attributed to the plugin's caller
    "DloomError",
    "ConfigurationError",
    "ModelError",
    "HookContractError",
    "NonFiniteLogitsError",
    "CompositionError",
    "UnknownStrategyError",
    "PluginLoadError",
    "warn",
    # commit rules (dloom_select_commit), and the signals of the distribution they may read
    "reads_signals",
    "COMMIT_SIGNALS",
    "commit_top",
    "sorted_profile",
    "offered_fills",
    "threshold_edits",
    # the transition kernel: the seam, its implementations, one step's per-row random
    # streams and samplers
    "TransitionKernel",
    "Settlement",
    "KERNELS",
    "KernelStep",
    "RowStreams",
    "propose",
    "without_mask",
    "gumbel_argmax",
    "uniform_noise",
    # speculating on a dLLM (dloom_draft, dloom_build_mask, dloom_verify)
    "layout_drafts",
    "follow_graph",
    "Stepper",
    "StepInput",
    "StepOutcome",
    "PlainStepper",
    "SpeculativeStepper",
    "ForwardPlan",
    "BlockForwards",
    "StepRecord",
    # speculating for an autoregressive target
    "chain_layout",
    "match_chains",
    "TargetKernel",
    "ACCEPT_TAG",
    "RESAMPLE_TAG",
    # models and their forward; a model family (dloom_register_families); a KV cache policy
    # (dloom_register_cache_policies)
    "FamilyRegistration",
    "CachePolicy",
    "NoCache",
    "PrefixCache",
    "DualCache",
    "ModelProfile",
    "ModelAdapter",
    "load_model",
    "BlockForward",
    "record_view",
    "padding_or_none",
    "position_ids_from_mask",
    # what a forward costs on this machine (a strategy sizing its drafts)
    "CostCurve",
    "measure_cost_curve",
    # decoders and compositions (a plugin that runs a decoder of its own, as FailFast's drafter)
    "Decoder",
    "DiffusionDecoder",
    "ARTargetDecoder",
    "load_ar_target_decoder",
    "GenerationResult",
    "decoder_kind",
    "StrategySpec",
    "Composition",
    "compose",
    "replace",
    "Registry",
    "get_registry",
]
