"""FailFast's four speculation hooks, for an autoregressive target.

* ``dloom_draft``: the dLLM drafter (:class:`~.drafter.DraftingRound`) takes one denoising
  step per call and returns the chains drafted so far; the decoder calls it again while a
  row is open.
* ``dloom_prune``: the length policy (:func:`~.policy.prune_chains`): fail fast, win big
  (or a fixed naive length) closes a row once its proposal length is decided.
* ``dloom_build_mask``: the core's chain layout (:func:`dloom.ar.chains.chain_layout`).
* ``dloom_verify``: sample-and-match (:func:`dloom.ar.chains.match_chains`, exact for any
  drafter), or ratio-based rejection sampling (:func:`~.verification.verify_ratio`, exact
  only for left-to-right drafts: refused otherwise when the decoder is built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from dloom import hookimpl
from dloom.sdk import (
    ChainLayout,
    ChainState,
    ChainVerdict,
    ConfigurationError,
    DraftChains,
    ModelError,
    TargetKernel,
    chain_layout,
    match_chains,
)

from .drafter import DraftingRound
from .drafter_decoder import drafter_decoder
from .payoff import DraftingLedger, measured_ledger, target_alone
from .policy import prune_chains
from .settings import FailFastSettings, check_shared_tokenizer
from .verification import verify_ratio


class FailFast:
    """FailFast (arXiv 2512.20573): a dLLM drafts dynamic-length chains for an AR target.

    :param params: the :class:`~.settings.FailFastSettings` fields.
    :ivar drafter_decoder: the drafter composition's :class:`dloom.DiffusionDecoder` on the
        drafter model, whose steps draft (set by ``dloom_configure``).
    :ivar unsafe_ratio_out_of_order: allow ``verification="ratio"`` with ``small_block > 1``.
        That combination is biased; it exists for negative controls (tests showing the bias
        is detected). Never set it otherwise.
    """

    def __init__(self, **params: Any) -> None:
        self.settings = FailFastSettings(**params)
        self.unsafe_ratio_out_of_order = False
        #: with ``drafting="auto"``: the drafted rounds' totals and the decision (:mod:`.payoff`)
        self.ledger: DraftingLedger | None = None

    # --- setup -------------------------------------------------------------------------

    @hookimpl
    def dloom_configure(self, config: Mapping[str, Any]) -> None:
        """Check the drafter model, its cache mode and the verification; build the drafter's
        diffusion decoder (:func:`~.drafter_decoder.drafter_decoder`)."""
        if config.get("decoder") != "ar-target":
            return
        settings, drafter = self.settings, config["drafter_model"]
        if drafter is None or drafter.mask_token_id is None or drafter.attention != "bidirectional":
            described = (
                "none" if drafter is None
                else f"{drafter.name!r}, which has {drafter.attention!r} attention and mask token {drafter.mask_token_id!r}"
            )
            raise ModelError(f"the FailFast drafter must be a bidirectional dLLM with a mask token; got {described}")
        check_shared_tokenizer(config["target_model"], drafter)
        if config["drafter_cache"] == "prefix" and drafter.cache_argument is None:
            raise ModelError(
                f"drafter_cache 'prefix' needs a drafter whose forward takes a transformers "
                f"cache; {drafter.name!r} takes none (use drafter_cache='none')"
            )
        if settings.verification == "ratio" and settings.small_block != 1 and not self.unsafe_ratio_out_of_order:
            raise ConfigurationError(
                f"verification 'ratio' needs drafts produced strictly left to right, but "
                f"small_block is {settings.small_block}: the drafter may commit a later "
                "position before an earlier one, so q(x_i) is not the drafter's probability of "
                "x_i given x_<i and min(1, p/q) rejection sampling is biased; use "
                "verification='match' (exact for any drafter) or small_block=1"
            )
        self.drafter_decoder = drafter_decoder(drafter, settings, config)
        self._config = config
        if settings.drafting == "auto":
            self.ledger = measured_ledger(config, settings)

    # --- the four speculation hooks ----------------------------------------------------

    @hookimpl
    def dloom_draft(self, state) -> DraftChains | None:
        if not isinstance(state, ChainState):
            return None
        if state.draft is not None:
            session, drafting = state.draft.carry, state.draft.open
        elif self.ledger is not None and not self.ledger.decide():
            return target_alone(state.tokens, self.ledger.report)  # drafting does not pay here
        else:
            if state.previous is None:
                session = DraftingRound(
                    self.drafter_decoder, state, self._config["drafter_cache"],
                    self.settings.verification == "ratio" and state.temperature > 0,
                )
            else:
                session = state.previous.carry
            session.start(state)
            drafting = state.active
            if self.ledger is not None and self.ledger.report is not None:  # decided: drafting pays
                return dataclasses.replace(session.step(state, drafting), decision=self.ledger.report)
        return session.step(state, drafting)

    @hookimpl
    def dloom_prune(self, graph, budget: int | None) -> DraftChains | None:
        if not isinstance(graph, DraftChains):
            return None
        return prune_chains(graph, self.settings, budget)

    @hookimpl
    def dloom_build_mask(self, state, graph) -> ChainLayout | None:
        if not isinstance(state, ChainState):
            return None
        return chain_layout(state, graph)

    @hookimpl
    def dloom_verify(self, state, graph, logits: torch.Tensor, kernel) -> ChainVerdict | None:
        if not isinstance(state, ChainState):
            return None
        if self.settings.verification == "ratio" and kernel.temperature > 0:
            verdict = self._verify_ratio(graph, logits, kernel)
        else:
            verdict = match_chains(graph, logits, kernel)
        if self.ledger is not None and self.ledger.drafting:
            self.ledger.record(graph, verdict, state.active)
        return verdict

    def _verify_ratio(self, chains: DraftChains, logits: torch.Tensor, kernel: TargetKernel) -> ChainVerdict:
        if chains.probs is None:
            raise ConfigurationError("ratio verification needs the drafter's distributions (DraftChains.probs)")
        longest = logits.shape[1] - 1
        draft = chains.tokens[:, :longest]
        q = chains.probs[:, :longest]
        vocab = logits.shape[-1]  # the drafter's logits may be narrower or wider
        q = torch.nn.functional.pad(q[..., :vocab], (0, max(0, vocab - q.shape[-1])))
        accepted, token = verify_ratio(draft, chains.length, logits, q, kernel.temperature, kernel.streams)
        return ChainVerdict(accepted=accepted, token=token)
