"""Spiffy's four speculation hooks: draft, prune, build_mask and verify.

* ``dloom_draft`` fills the calibrated graph's formulas from the most recent known
  distribution (the current state's predecessor's): every draft is the current block with
  its pairs' positions set to their ranked tokens (:mod:`dloom_plugins.spiffy.frame`). A
  draft is valid in a row when that row has enough masked positions for its pairs.
* ``dloom_prune`` keeps the ``budget`` best drafts of each row while every kept draft stays
  reachable from the root through kept drafts. ``prune="rule"`` (the default) ranks a draft
  by the probability that the commit rule takes the path to it: its calibrated reach
  (:func:`rule_prior`, how often the rule reached it from a root) times the row's
  probabilities of the tokens it sets. ``prune="confidence"`` ranks it by the geometric
  mean of those probabilities combined with its children's (a draft that leads to likely
  drafts is worth more), which ignores the rule: pruning a large graph that way accepts
  fewer drafts than a small calibrated graph (``docs/strategies/spiffy.md``, "Pruning").
* ``dloom_build_mask`` lays the root and the kept drafts out as batch rows (``"rows"``:
  exact for every model and cache mode; the decoder evaluates them in model calls of the
  batch's row count, or of ``call_tokens`` query tokens if more) or packed into one sequence per row behind a block
  attention mask (``"packed"``: exact with the dual cache or a block-causal model,
  near-lossless elsewhere; the decoder reports which in ``result.speculation``). With the
  decoder's ``static_shapes`` every layout states the most rows it may hold per batch row
  (``budget + 1`` nodes, or one packed row of ``budget + 1`` spans), so that every
  verification model call of a batch has one shape.
* ``dloom_verify`` follows the graph with the decoder's kernel
  (:func:`dloom.decode.speculation.follow_graph`): lossless whenever the layout is exact.

A block's first forward (``first_forward``, on by default). The distribution of a block's
first forward is a forward on the canvas with the previous block complete. The forward that
commits the previous block's last tokens runs on the state *before* them, so its next-block
logits are not that distribution; but a draft that completes the block is that canvas, and
in a rows layout without a cache every draft row is a forward over the whole sequence. So
the layout asks for the next block's logits too (``next_block``), and when a kernel step
completes the block in a state equal to a draft, the verdict hands that draft's next-block
logits on and the decoder takes the next block's first step from them, without a forward
(lossless: it is the reference's distribution, sampled by the reference's kernel). With a
prefix or dual cache it is off: the reference's first forward of a block is a full forward
that records the keys and values its later steps read (and on a bidirectional model the
earlier blocks' keys change with the completed block), which no verification forward of
the previous block computes; a packed layout computes the block's columns only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from dloom import hookimpl
from dloom.sdk import (
    ConfigurationError,
    CostCurve,
    DecodeState,
    DraftGraph,
    NodeLogits,
    Verdict,
    VerificationLayout,
    follow_graph,
    layout_drafts,
    warn,
)

from .budget import (
    CACHED_MIN_GAIN,
    MIN_GAIN,
    choose_budget,
    expected_accepted,
    speedups,
    steps_per_block,
)
from .frame import rank_frame
from .graph import (
    CalibratedGraph,
    GraphTemplate,
    calibrate_command,
    default_graph,
    find_builtin,
)
from .overhead import verification_overhead

LAYOUTS = ("rows", "packed")
AUTO = "auto"
PROMPT_TOKENS = 64
"""The prompt length ``budget="auto"`` measures forwards at (the decoder has no prompt yet)."""
COST_REPEATS = 5
"""Rounds of timed forwards ``budget="auto"`` measures the cost curve with (the median kept)."""
PRUNE_SCORES = ("rule", "confidence")
CALL_TOKENS = 2048
"""The default ``call_tokens``: a verification's model call holds ``B`` rows or this many
query tokens, whichever is more."""


class Spiffy:
    """Auto-speculative decoding of a dLLM with a calibrated draft graph.

    :param graph: a graph file from ``dloom calibrate``; ``""`` picks the built-in graph for
        the decoder's model, base rule and block length, or, with a warning, the
        uncalibrated default graph (:func:`~dloom_plugins.spiffy.graph.default_graph`).
    :param budget: ``D*``, the most drafts per row one verification forward evaluates, or
        ``"auto"`` (the default): the ``D`` of the most expected tokens per second under the
        forward's cost curve (:mod:`dloom_plugins.spiffy.budget`), ``0`` drafting nothing
        (plain steps of the base rule). The chosen ``D`` depends on measured timings; pass
        an explicit ``budget`` where exact forward counts matter.
    :param cost: with ``budget="auto"``, a cost curve file (``dloom profile -o``); ``""``
        measures the decoder's model (:func:`dloom.model.cost.measure_cost_curve`, once per
        process for a model, device, dtype and shape).
    :param layout: one of :data:`LAYOUTS`.
    :param first_forward: draft a block's first forward (module docstring); in effect with
        ``layout="rows"`` and no cache, inert elsewhere.
    :param prune: how dynamic pruning ranks drafts, one of :data:`PRUNE_SCORES`.
    :param call_tokens: how many query tokens one model call of a verification may hold
        beyond the batch's ``B`` rows (the layout's
        :attr:`~dloom.types.VerificationLayout.call_tokens`: rows of ``Q`` query tokens are
        evaluated ``max(B, call_tokens // Q)`` at a time). The rows layout has up to
        ``budget + 1`` rows per batch row; evaluating them ``B`` at a time (``0``) keeps a
        verification's peak memory that of a plain step, but a call of a few hundred tokens
        costs an accelerator about one read of the weights whatever its rows, so splitting
        a small verification multiplies its time. The default, 2048 tokens, splits only
        verifications that are large anyway. The outputs are the same either way.
    """

    def __init__(
        self, graph: str = "", budget: int | str = AUTO, layout: str = "rows", call_tokens: int = CALL_TOKENS,
        first_forward: bool = True, prune: str = "rule", cost: str = "",
    ) -> None:
        if budget != AUTO and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ConfigurationError(f"budget is {budget!r}; allowed: an int >= 0 or {AUTO!r}")
        if prune not in PRUNE_SCORES:
            raise ConfigurationError(f"prune is {prune!r}; allowed: {', '.join(PRUNE_SCORES)}")
        if not isinstance(first_forward, bool):
            raise ConfigurationError(f"first_forward is {first_forward!r}; allowed: True or False")
        if layout not in LAYOUTS:
            raise ConfigurationError(f"layout is {layout!r}; allowed: {', '.join(LAYOUTS)}")
        if isinstance(call_tokens, bool) or not isinstance(call_tokens, int) or call_tokens < 0:
            raise ConfigurationError(f"call_tokens is {call_tokens!r}; allowed: an int >= 0 (0: the batch's rows)")
        self.graph_path = graph
        self.budget = budget
        self.cost_path = cost
        #: the drafts per row in effect (``budget``, or the one ``"auto"`` chose), set by
        #: ``dloom_configure``
        self.chosen_budget: int | None = None
        #: with ``budget="auto"``: the curve, ``A(D)`` and the expected speed-ups it chose from
        self.choice: dict[str, Any] | None = None
        self.layout = layout
        self.call_tokens = call_tokens
        self.first_forward = first_forward
        self.prune = prune
        self._log_prior: dict[torch.device, torch.Tensor] = {}  # (N,) per device, "rule" scores
        self._next_block = False  # verifications carry next-block logits (set by dloom_configure)
        self.graph: CalibratedGraph | None = None
        self._templates: dict[torch.device, GraphTemplate] = {}
        self._longest = 0  # the most steps of any path from the root (not the depth: a node
        # with several parents may be reached by a longer path than its fewest steps)
        self._order: list[int] = []  # nodes deepest first (children before parents)
        self._static_nodes: int | None = None  # with static shapes, the root and the kept drafts

    # --- setup -------------------------------------------------------------------------

    @hookimpl
    def dloom_configure(self, config: Mapping[str, Any]) -> None:
        """Load the graph and refuse one calibrated for another model, tokenizer, block
        length or base rule, and the packed layout on a model that takes no attention mask."""
        if self.layout == "packed" and not config["takes_attention_mask"]:
            raise ConfigurationError(
                f"layout 'packed' needs a model whose forward takes a 4-D attention mask; "
                f"model {config['model']!r} ignores attention masks: use layout 'rows'"
            )
        if self.graph_path:
            graph = CalibratedGraph.load(self.graph_path)
            found = graph.mismatches(config)
            if found:
                raise ConfigurationError(
                    f"draft graph {self.graph_path!r} does not fit this decoder: it was "
                    f"calibrated for {'; '.join(found)}"
                )
        else:
            builtin = find_builtin(config)
            if builtin is not None:
                graph = builtin
            else:
                warn(
                    f"no built-in draft graph fits model {config['model']!r} with base rule "
                    f"{config['commit_rule']!r} {dict(config['commit_params'])} and block_length "
                    f"{config['block_length']}: using the uncalibrated default graph (still "
                    f"lossless, fewer drafts accepted). {calibrate_command(config)} and pass "
                    "--param graph=graph.json",
                )
                graph = default_graph(config)
        graph.check_vocabulary(config.get("vocab_size"), repr(self.graph_path or "(built-in)"))
        if graph.temperature != config["temperature"] or graph.remasking != config["remasking"]:
            warn(
                f"draft graph calibrated at temperature {graph.temperature} with "
                f"{graph.remasking!r} remasking, decoding at {config['temperature']} with "
                f"{config['remasking']!r}: still lossless, but fewer drafts may be accepted",
            )
        self.graph = graph
        self._templates.clear()
        self._log_prior.clear()
        budget = config.get("draft_budget")
        most = len(graph.nodes) if budget is None else min(len(graph.nodes), budget)
        # a block's first forward is drafted where the verification sees the next block
        self._next_block = self.first_forward and self.layout == "rows" and config.get("cache", "none") == "none"
        self._static_nodes = None
        if self.budget == AUTO:
            self.chosen_budget = self._choose(graph, config, most)
        else:
            self.chosen_budget = min(int(self.budget), most)
        if self.chosen_budget == 0 and "decline_drafting" in config:
            config["decline_drafting"](self)  # the base rule's plain steps, without a draft call per step
        # static shapes: every verification is laid out for the most nodes a row may evaluate
        self._static_nodes = self.chosen_budget + 1 if config.get("static_shapes") else None

    def _choose(self, graph: CalibratedGraph, config: Mapping[str, Any], most: int) -> int:
        """``budget="auto"``: the ``D <= most`` of the most expected tokens per second; ``0``
        without measuring where the graph expects no accepted draft (an uncalibrated one)."""
        accepted = expected_accepted(graph)[: most + 1]
        steps = steps_per_block(graph)
        if not any(accepted):
            self.choice = {"curve": None, "accepted": accepted, "steps_per_block": steps,
                           "overhead": None, "speedups": None, "budget": 0}
            return 0
        if self.cost_path:
            curve = CostCurve.load(self.cost_path)
        elif "forward_cost" in config:
            curve = config["forward_cost"](
                seq_len=cost_seq_len(config), nodes=cost_nodes(most + 1), layout=self.layout,
                span=config["block_length"], repeats=COST_REPEATS,
            )
        else:
            raise ConfigurationError(
                "budget 'auto' needs a forward cost curve: build Spiffy through a DiffusionDecoder "
                "(it measures the model), or pass cost=FILE from `dloom profile -o FILE`"
            )
        overhead = [0.0]
        if config.get("vocab_size"):  # the verification's work besides its forward, timed
            overhead += verification_overhead(self, config, range(1, len(accepted)))
        else:
            overhead *= len(accepted)
        cached = config.get("cache", "none") != "none"
        chosen = choose_budget(accepted, curve, steps, overhead, CACHED_MIN_GAIN if cached else MIN_GAIN)
        self.choice = {"curve": curve.to_json(), "accepted": accepted, "steps_per_block": steps,
                       "overhead": overhead, "speedups": speedups(accepted, curve, steps, overhead),
                       "budget": chosen}
        return chosen

    def _template(self, device: torch.device) -> GraphTemplate:
        if self.graph is None:
            raise ConfigurationError(
                "Spiffy has no draft graph: build it through a DiffusionDecoder, which "
                "configures its plugins"
            )
        if device not in self._templates:
            template = self.graph.template(device)  # depth on the host: read once here
            self._templates[device] = template
            self._log_prior[device] = rule_prior(self.graph, device)
            self._longest = longest_path(template.parents.cpu())
            self._order = torch.argsort(template.depth, descending=True, stable=True).tolist()
        return self._templates[device]

    # --- the four speculation hooks ----------------------------------------------------

    @hookimpl
    def dloom_draft(self, state: DecodeState) -> DraftGraph | None:
        if state.logits is None or (self.budget == AUTO and self.chosen_budget == 0):
            return None  # "auto" chose the base rule alone: plain steps
        block = state.block
        template = self._template(block.device)
        frame = rank_frame(state.logits, block, state.mask_token_id, template.token_ranks)
        real = template.position_rank >= 0  # (N, P)
        ranks = template.position_rank.clamp(min=0)
        rows = torch.arange(block.shape[0], device=block.device)[:, None, None]
        positions = frame.position_by_rank[:, ranks]  # (B, N, P)
        token_rank = template.token_rank.clamp(min=0).expand_as(positions)
        tokens = frame.tokens[rows, positions, token_rank]
        log_probs = torch.log(frame.probs[rows, positions, token_rank].clamp_min(1e-300))
        # Padding pairs repeat the node's first pair, so scattering them changes nothing.
        positions = torch.where(real, positions, positions[..., :1])
        tokens = torch.where(real, tokens, tokens[..., :1])
        drafts = block.unsqueeze(1).expand(-1, real.shape[0], -1).clone()
        drafts.scatter_(2, positions, tokens)
        fillable = ((template.position_rank < frame.masked[:, None, None]) | ~real).all(-1)
        if self.prune == "rule":  # the path's probability: the rule's, then this row's tokens'
            score = torch.exp(self._log_prior[block.device] + (log_probs * real).sum(-1))
        else:  # the geometric mean of the tokens' probabilities
            score = torch.exp((log_probs * real).sum(-1) / real.sum(-1))
        one = torch.ones_like(score[:, :1])
        # Rows at the start of their block have no predecessor distribution: no drafts.
        drafting = state.active if state.known is None else state.active & state.known
        return DraftGraph(
            tokens=torch.cat([block.unsqueeze(1), drafts], dim=1),
            parents=template.parents,
            depth=template.depth,
            score=torch.cat([one, score], dim=1),
            valid=torch.cat([state.active.unsqueeze(1), fillable & drafting.unsqueeze(1)], dim=1),
            longest_path=self._longest,
        )

    @hookimpl
    def dloom_prune(self, graph: DraftGraph, budget: int | None) -> DraftGraph:
        own = int(self.budget) if self.budget != AUTO else self.chosen_budget or 0
        keep = own if budget is None else min(own, budget)
        nodes = graph.num_nodes + 1
        valid = graph.valid
        log_own = torch.log(graph.score.clamp_min(1e-300))
        combined = log_own.clone()
        if self.prune == "confidence":
            # Children before parents: deepest first (a child is always deeper than its parent).
            own = any(graph.depth is t.depth for t in self._templates.values())
            order = self._order if own else torch.argsort(graph.depth, descending=True, stable=True).tolist()
            for node in order[:-1]:
                children = graph.parents[:, node].to(log_own.dtype) * valid  # (B, N + 1)
                total = log_own[:, node] + (children * combined).sum(-1)
                combined[:, node] = total / (1 + children.sum(-1))
        kept = torch.zeros_like(valid)
        kept[:, 0] = valid[:, 0]
        parents = graph.parents.unsqueeze(0)
        for _ in range(min(keep, nodes - 1)):
            frontier = valid & ~kept & (parents & kept.unsqueeze(1)).any(-1)
            best = torch.where(frontier, combined, torch.full_like(combined, -torch.inf)).argmax(-1)
            pick = torch.zeros_like(kept).scatter_(1, best.unsqueeze(1), frontier.any(-1, keepdim=True))
            kept |= pick
        # a path from the root through kept drafts visits each at most once (parents come
        # before children): at most ``keep`` steps, so the verifier walks no further
        longest = None if graph.longest_path is None else min(graph.longest_path, keep)
        return DraftGraph(graph.tokens, graph.parents, graph.depth, graph.score, kept, longest)

    @hookimpl
    def dloom_build_mask(self, state: DecodeState, graph: DraftGraph) -> VerificationLayout:
        layout = layout_drafts(state, graph, packed=self.layout == "packed", nodes=self._static_nodes)
        return dataclasses.replace(layout, call_tokens=self.call_tokens, next_block=self._next_block)

    @hookimpl
    def dloom_verify(self, state: DecodeState, graph: DraftGraph, logits: NodeLogits, kernel) -> Verdict:
        return follow_graph(graph, logits, kernel)


def cost_seq_len(config: Mapping[str, Any]) -> int:
    """Tokens of one verification row's forward: the block's window with the dual cache,
    the generation with the prefix cache (its mean is half of it, plus the block), and
    :data:`PROMPT_TOKENS` plus the generation without a cache."""
    cache = config.get("cache", "none")
    if cache == "dual":
        return int(config["block_length"])
    if cache == "prefix":
        return int(config["gen_length"]) // 2 + int(config["block_length"])
    return PROMPT_TOKENS + int(config["gen_length"])


def cost_nodes(most: int) -> tuple[int, ...]:
    """The node counts a cost curve up to ``most`` nodes is measured at: powers of two and
    ``most``."""
    return tuple(sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n < most} | {most}))


def longest_path(parents: torch.Tensor) -> int:
    """The most kernel steps of any path from the root through ``parents`` (``(N + 1, N + 1)``
    bool on the host, parents before children): what the verifier must walk so that no row
    is still on the graph when it stops (a node's depth counts its fewest steps)."""
    steps = [0] * parents.shape[0]
    for child, row in enumerate(parents.tolist()):
        steps[child] = max((steps[p] + 1 for p, edge in enumerate(row) if edge), default=0)
    return max(steps)


def rule_prior(graph: CalibratedGraph, device: torch.device) -> torch.Tensor:
    """``(N,)`` float64 on ``device``: each draft's log-probability that the commit rule
    reaches it from a root, as calibration counted it (``log frequency / paths``; a graph
    without counts, the uncalibrated default, gets ``0`` for every node: the row's token
    probabilities alone then rank them)."""
    counts = torch.tensor([node.frequency for node in graph.nodes], dtype=torch.float64)
    if not bool((counts > 0).all()):
        return torch.zeros_like(counts).to(device)
    paths = max(float(graph.calibration.get("paths", 0) or 0), float(counts.max()))
    return torch.log(counts / paths).to(device)
