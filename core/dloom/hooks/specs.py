"""The hooks of dloom: what a strategy plugin may implement.

A decoder owns one :class:`pluggy.PluginManager` holding exactly the plugins of its strategy
(plus cross-cutting wrappers such as timing and tracing). Every decoding hook is
*single-answer* (``firstresult``): the first non-``None`` result wins and ``None`` only ever
means "not me". Two plugins answering the same decoding hook in one decoder is a
composition error, raised when the decoder is built.

The core calls these hooks only through the typed functions in :mod:`dloom.hooks.calls`.

Shapes used below: ``B`` rows in the batch, ``K`` positions in the active block (or draft
span), ``V`` vocabulary size, ``N`` drafts of a draft graph (plus the root, node 0), ``R`` rows
of a verification layout, ``S`` its width.

Besides the five decoding hooks (:data:`DECODING_HOOKS`), ``dloom_register_strategies``
registers strategies, ``dloom_register_families`` model families, ``dloom_register_commands``
adds commands to the ``dloom`` command line, ``dloom_register_cache_policies`` adds KV cache
policies and ``dloom_configure`` lets the plugins of a decoder check its settings once.

Every list of hook names the core uses is derived here, from the specifications themselves:
:data:`HOOKS` (all of them), :data:`DECODING_HOOKS` (the single-answer ones, which the
decoders call) and :data:`SPECULATION_HOOKS` (the decoding hooks a speculator implements).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

from dloom.errors import ConfigurationError

if TYPE_CHECKING:
    import torch
    import typer

    from dloom.model.cache_policy import CachePolicy
    from dloom.model.families import FamilyRegistration
    from dloom.types import (
        BlockSchedule,
        ChainLayout,
        ChainState,
        ChainVerdict,
        DecodeState,
        DraftChains,
        DraftGraph,
        StrategyRegistration,
        Verdict,
        VerificationLayout,
    )

PROJECT_NAME = "dloom"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

COMMIT_SIGNALS = ("confidence", "margin", "entropy", "probabilities", "token_probability")
"""What a commit rule may read of the block's distribution, ``softmax(logits)`` with the
mask token left out (float64; ``signals`` of :func:`dloom_select_commit`):

* ``confidence``: ``(B, K)``, the candidate token's probability;
* ``margin``: ``(B, K)``, the top-1 minus the top-2 probability;
* ``entropy``: ``(B, K)``, the entropy in nats (``>= 0``; lower is surer);
* ``probabilities``: ``(B, K, V)``, the whole distribution;
* ``token_probability``: ``(B, K)``, the probability of each position's current token
  (0 at a masked position): how much the model still believes a filled token, what a
  rule that remasks suspicious tokens reads (:attr:`dloom.types.Edits.remask`).
"""
SIGNALS_ATTRIBUTE = "dloom_signals"


def reads_signals(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the signals (:data:`COMMIT_SIGNALS`) a ``dloom_select_commit``
    implementation reads from its ``signals`` argument; the kernel computes those, and only
    those, at every step::

        @dloom.hookimpl
        @dloom.reads_signals("entropy")
        def dloom_select_commit(self, selectable, signals): ...

    :raises ConfigurationError: for a name not in :data:`COMMIT_SIGNALS`, or none.
    """
    unknown = [name for name in names if name not in COMMIT_SIGNALS]
    if unknown or not names:
        what = f"unknown signal {unknown[0]!r}" if unknown else "no signal named"
        raise ConfigurationError(
            f"reads_signals({', '.join(map(repr, names))}): {what}; allowed: {', '.join(COMMIT_SIGNALS)}"
        )

    def mark(function: Callable[..., Any]) -> Callable[..., Any]:
        setattr(function, SIGNALS_ATTRIBUTE, tuple(dict.fromkeys(names)))
        return function

    return mark


@hookspec
def dloom_register_strategies(register: Callable[[StrategyRegistration], None]) -> None:
    """Register the strategies this plugin provides.

    Called once per process on the global registry, for every plugin loaded from the
    ``dloom`` entry-point group (built-ins included).

    :param register: call it once per strategy with a
        :class:`~dloom.types.StrategyRegistration`. The core stamps each strategy with the
        name of the plugin that registered it and rejects a name that is already taken.
    """


@hookspec
def dloom_register_families(register: Callable[[FamilyRegistration], None]) -> None:
    """Register the model families this plugin provides.

    Called once per process on the global registry, for every loaded plugin (the core's
    families first, :mod:`dloom.model.builtin_families`), like
    :func:`dloom_register_strategies`.

    :param register: call it once per family with a
        :class:`~dloom.model.families.FamilyRegistration` (a profile and its native layout).
        The core stamps each family with the plugin's name and refuses a name or a
        ``model_type``, architecture or code module that another family already claims
        (the plugin is then reported and skipped); :mod:`dloom.model.families` gives the
        precedence by which a config's family is recognised.
    """


@hookspec
def dloom_register_commands(cli: typer.Typer) -> None:
    """Add this plugin's commands to the ``dloom`` command line.

    Called once per ``dloom`` invocation, for every loaded plugin module that implements
    it (in the style of ``llm``'s ``register_commands``). Declare commands on ``cli`` as on
    any :class:`typer.Typer`; they are listed by ``dloom --help`` with the core's. A
    command named like a core command or another plugin's is reported and skipped.

    :param cli: a :class:`typer.Typer` of this plugin's own: ``@cli.command()`` adds one.
    """


@hookspec
def dloom_register_cache_policies(register: Callable[[CachePolicy], None]) -> None:
    """Register the KV cache policies this plugin provides (values of a decoder's ``cache``).

    Called once per process (per loaded registry), for the core's built-in policies first
    (:mod:`dloom.model.cache_policy`, registered by :mod:`dloom.hooks.cache_policies`), then for every plugin loaded from the ``dloom``
    entry-point group that implements it (:mod:`dloom.hooks.cache_policies`).

    :param register: call it once per policy with an object of the
        :class:`~dloom.model.cache_policy.CachePolicy` protocol; its ``name`` becomes a value
        of ``cache``. A name that is already taken, or an object that is no policy, is
        reported and skipped.
    """


@hookspec(firstresult=True)
def dloom_select_commit(
    confidence: torch.Tensor,
    selectable: torch.Tensor,
    schedule: BlockSchedule,
    signals: Mapping[str, torch.Tensor],
) -> torch.Tensor | None:
    """Choose which masked positions of the active block to unmask this step.

    Stops at the first non-``None`` result.

    :param confidence: ``(B, K)`` float64, the confidence of each position's candidate
        token (its probability, or Dream's margin / negative entropy, or a uniform draw under
        ``random`` remasking). Values at non-selectable positions are meaningless.
    :param selectable: ``(B, K)`` bool, masked positions of the active block in rows that are
        still decoding. Rows with no selectable position must commit nothing. On the
        revisable kernel, an editing rule (``StrategyRegistration(edits=True)``) is also
        offered the filled generated positions whose candidate differs from their token:
        committing one rewrites it (``schedule.masked`` tells them apart).
    :param schedule: where this step lies in the block's step budget (used by quota rules).
    :param signals: what the rule declared with :func:`reads_signals` of the block's
        distribution, by name (:data:`COMMIT_SIGNALS`), whatever the decoder's remasking;
        empty for a rule that declared none.
    :return: ``(B, K)`` bool, the positions to commit: a subset of ``selectable`` holding at
        least one position in every row that has a selectable one; ``None`` if this plugin
        is not a commit rule. An editing rule on the revisable kernel may instead return a
        :class:`~dloom.types.Edits` (those positions, and positions to delete and to split
        in a post step: LLaDA2.2's Levenshtein edits; or filled positions to remask in a
        step that still fills: WINO's narrow-out).
    """


@hookspec
def dloom_configure(config: Mapping[str, Any]) -> None:
    """Check the decoder this plugin was composed into, once, when the decoder is built.

    Every implementation is called (not single-answer). Raise
    :class:`~dloom.errors.ConfigurationError` for a setting the plugin cannot work with, so
    that the error comes before any decoding: a draft graph calibrated for another model,
    for example.

    :param config: the decoder's settings: ``model``, ``tokenizer_sha256`` (``None`` without
        a tokenizer), ``strategy``, ``params`` (by component), ``commit_rule`` (the component
        answering :func:`dloom_select_commit`) and ``commit_params``, ``gen_length``,
        ``block_length``, ``steps_per_block``, ``temperature``, ``remasking``, ``cache``,
        ``attention``, ``shift_logits``, ``takes_attention_mask`` (``False`` for a forward
        that ignores attention masks, like LLaDA's released one), and ``forward_cost``, which
        times the model's forwards when called (:func:`dloom.model.cost.measure_cost_curve`
        without its first argument: a :class:`~dloom.model.cost.CostCurve`, measured once per
        process for a shape), and ``decline_drafting(plugin)``, which the plugin answering
        :func:`dloom_draft` calls with itself when it will not draft under these settings
        (Spiffy at ``budget="auto"`` choosing no drafts): the decoder then takes plain steps
        of its commit rule only and never calls the draft, prune, build-mask or verify hook (its
        results report a speculation of no verifications; another plugin's call changes
        nothing). In
        the ``"ar-target"``
        decoder (:class:`dloom.ARTargetDecoder`; ``config["decoder"] == "ar-target"``):
        ``model``/``target``, ``drafter`` (names), ``strategy``, ``params``, ``gen_length``,
        ``temperature``, ``remasking``, ``seed``, ``drafter_cache``, ``draft_budget``,
        ``tokenizer_sha256``, and the objects ``target_model`` and ``drafter_model`` (the
        adapters; ``drafter_model`` is ``None`` without a drafter model) and ``registry``.
    """


@hookspec(firstresult=True)
def dloom_draft(state: DecodeState | ChainState) -> DraftGraph | DraftChains | None:
    """Speculate: future states of a dLLM's active block, or token chains for an AR target.

    Stops at the first non-``None`` result. One hook serves two kinds of target:

    * a :class:`~dloom.types.DecodeState` (:class:`dloom.DiffusionDecoder`): return a
      :class:`~dloom.types.DraftGraph` whose node 0 is the current block and whose drafts
      are guessed future blocks, or ``None`` to decline this step (the decoder then runs a
      plain step). With no implementation the decoder does not speculate. Called only once
      a distribution of the block is known (never on a block's first step);
    * a :class:`~dloom.types.ChainState` (:class:`dloom.ARTargetDecoder`): return
      :class:`~dloom.types.DraftChains` continuing each row's accepted tokens. A drafter may
      draft over several calls: while a row is ``open`` after :func:`dloom_prune`, the
      decoder calls this hook again with ``state.draft`` holding the chains so far.

    A plugin for one kind returns ``None`` for the other.

    :param state: the current state; for a ``DecodeState``, ``state.logits`` ``(B, K, V)`` is
        the most recent known distribution, that of the current state's predecessor.
    :return: the drafts, or ``None`` (see above).
    """


@hookspec(firstresult=True)
def dloom_prune(graph: DraftGraph | DraftChains, budget: int | None) -> DraftGraph | DraftChains | None:
    """Shrink the drafts to at most ``budget`` per row.

    Stops at the first non-``None`` result; the core's default keeps the drafts as they are.
    Whoever prunes, more than ``budget`` drafts per row afterwards is a
    :class:`~dloom.errors.HookContractError` (a drafter without a pruner must respect it).

    :param graph: the drafts from :func:`dloom_draft`: a :class:`~dloom.types.DraftGraph`
        (every kept draft must stay reachable from the root through kept drafts), or
        :class:`~dloom.types.DraftChains` (a length policy: set ``length``, and clear
        ``open`` on rows whose proposal is decided, as FailFast's fail-fast / win-big rule does).
    :param budget: the most drafts per row one verification forward may evaluate (the
        decoder's ``draft_budget``; chain tokens for chains), or ``None`` when the decoder
        sets no limit and the strategy's own budget applies.
    :return: the pruned drafts (a graph with ``valid`` cleared on dropped drafts), or
        ``None`` to leave the choice to the next implementation.
    """


@hookspec(firstresult=True)
def dloom_build_mask(
    state: DecodeState | ChainState, graph: DraftGraph | DraftChains
) -> VerificationLayout | ChainLayout | None:
    """Lay out one forward pass of the target that evaluates the drafts.

    Stops at the first non-``None`` result.

    :param state: the current state (the root of the graph, or the accepted tokens).
    :param graph: the (pruned) drafts.
    :return: for a graph, a :class:`~dloom.types.VerificationLayout`: the spans of ``R``
        layout rows, the batch row each row takes its context from, and where each
        ``(row, node)`` span sits (:func:`dloom.decode.speculation.layout_drafts`); for chains, a
        :class:`~dloom.types.ChainLayout`: each row's uncached accepted tokens, then its
        chain (:func:`dloom.ar.chains.chain_layout`).
    """


@hookspec(firstresult=True)
def dloom_verify(
    state: DecodeState | ChainState,
    graph: DraftGraph | DraftChains,
    logits: torch.Tensor,
    kernel: Callable[..., torch.Tensor],
) -> Verdict | ChainVerdict | None:
    """Decide which drafts the verification forward accepts.

    Stops at the first non-``None`` result. A lossless implementation samples the target
    with ``kernel`` and keeps drafts only while the sample equals them: it follows a graph
    (:func:`dloom.decode.speculation.follow_graph`) or matches a chain
    (:func:`dloom.ar.chains.match_chains`).

    :param state: the state the forward started from.
    :param graph: the drafts that were evaluated.
    :param logits: for a graph, the distribution of every node's block as the forward
        computed it (node 0: the root), a :class:`~dloom.types.NodeLogits` of shape
        ``(B, N + 1, K, V)`` read lazily: ``logits.of(node)`` gives ``(B, K, V)``, row ``b``'s
        node ``node[b]``; meaningless where ``graph.valid`` is ``False``. For chains, a
        ``(B, T' + 1, V)`` tensor, entry ``i`` the target's distribution of each row's
        ``i``-th chain token (``T'`` the longest chain).
    :param kernel: for a graph, one step of the transition kernel:
        ``kernel(block, logits, advance)`` maps ``(B, K)`` blocks and their ``(B, K, V)``
        logits to the next blocks; rows where the ``(B,)`` bool ``advance`` is ``False``
        are returned unchanged and take no step (the decoder counts the steps it takes). For
        chains, the target's decoding step :class:`dloom.ar.chains.TargetKernel`:
        ``kernel(logits)`` gives ``(B, T' + 1)`` target tokens (argmax, or samples from each
        row's stream), with its ``temperature`` and ``streams``.
    :return: a :class:`~dloom.types.Verdict` (the new block, the distribution it was
        sampled from, how many drafts each row accepted), or a
        :class:`~dloom.types.ChainVerdict` (chain tokens accepted, the target's next token).
    """


HOOKS: tuple[str, ...] = tuple(
    name for name, spec in vars(sys.modules[__name__]).items()
    if name.startswith(f"{PROJECT_NAME}_") and hasattr(spec, f"{PROJECT_NAME}_spec")
)
"""Every hook name, in the order specified above."""

DECODING_HOOKS: tuple[str, ...] = tuple(
    name for name in HOOKS if getattr(globals()[name], f"{PROJECT_NAME}_spec")["firstresult"]
)
"""The decoding hooks: the single-answer (``firstresult``) ones, which the decoders call."""

SPECULATION_HOOKS: tuple[str, ...] = tuple(name for name in DECODING_HOOKS if name != "dloom_select_commit")
"""The decoding hooks of a speculator: every decoding hook but the commit rule's."""
