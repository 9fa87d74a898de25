"""Spiffy: lossless speculative decoding of a dLLM with calibrated draft graphs of its own
future states (Agrawal et al., 2025; the draft graphs, pruning and verification are described in
``docs/strategies/spiffy.md``).

``dloom calibrate`` (:mod:`dloom_plugins.spiffy.cli`, running
:mod:`dloom_plugins.spiffy.calibrate`) records the reference process
and keeps the most frequent transitions as a draft graph (:mod:`dloom_plugins.spiffy.graph`);
at run time the plugin (:mod:`dloom_plugins.spiffy.plugin`) fills that graph from the latest
distribution, prunes it, lays it out for one forward and verifies it with the kernel.
"""

from __future__ import annotations

from dloom import Claim, Parameter, StrategyRegistration, hookimpl

from .graph import BUILTIN_DIR, CalibratedGraph
from .plugin import AUTO, CALL_TOKENS, LAYOUTS, PRUNE_SCORES, Spiffy

__all__ = ["CalibratedGraph", "Spiffy", "dloom_register_commands", "dloom_register_strategies"]

GUARANTEE = (
    "lossless against its commit rule run one forward per step (same tokens under T = 0, "
    "same distribution under sampling) with layout=rows, for every model and cache mode, and "
    "with layout=packed under the dual cache or on block-causal models; layout=packed on a "
    "bidirectional model without the dual cache is near-lossless (reported as such)"
)


@hookimpl
def dloom_register_strategies(register) -> None:
    register(
        StrategyRegistration(
            name="spiffy",
            plugin_class=Spiffy,
            parameters=(
                Parameter("graph", "", str, "draft-graph file from `dloom calibrate` ('' = built-in)", path=True,
                          path_files=(str(BUILTIN_DIR / "*.json"),)),
                Parameter("budget", AUTO, int, "D*: drafts per row in one verification forward; 'auto' "
                          "(the default): the D of the most expected tokens per second under the measured "
                          "forward cost (0: the base rule alone)", low=0, words=(AUTO,)),
                Parameter("cost", "", str, "with budget=auto: a cost curve file from `dloom profile -o` "
                          "('' = measure the model)", path=True),
                Parameter("layout", "rows", str, "drafts as batch rows or packed in one sequence",
                          choices=LAYOUTS),
                Parameter("call_tokens", CALL_TOKENS, int, "query tokens one verification model call may hold "
                          "beyond the batch's rows (0 = the batch's rows: a plain step's peak memory)", low=0),
                Parameter("prune", "rule", str, "how dynamic pruning ranks drafts: 'rule' (the probability "
                          "that the commit rule takes the path: calibrated reach times the row's token "
                          "probabilities) or 'confidence' (tokens' geometric mean)", choices=PRUNE_SCORES),
                Parameter("first_forward", True, bool, "draft a block's first forward: a verification that "
                          "completes a block in a drafted state hands on that state's next-block logits "
                          "(layout=rows without a cache; elsewhere off)"),
            ),
            guarantee=GUARANTEE,
            summary="speculates the dLLM's own future states from a calibrated draft graph",
            claim=Claim(
                "lossless", against="kernel",
                conditions="layout=rows any model and cache; layout=packed with cache=dual or "
                "block-causal models",
                # budget=auto drafts nothing on a CPU (and with an uncalibrated graph): check at 10
                exercised_at={"budget": 10},
            ),
            default_commit_rule="quota",
            options=("graph", "budget", "layout"),
        )
    )


@hookimpl
def dloom_register_commands(cli) -> None:
    """``dloom calibrate`` (imported only when the command line is built)."""
    from .cli import register_commands

    register_commands(cli)
