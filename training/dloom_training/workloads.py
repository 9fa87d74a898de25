"""What each zoo model is trained and evaluated on (:class:`Workload`) and its architecture (:data:`SPECS`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from dloom.zoo import long_tasks
from dloom.zoo.corpus import TEXT
from dloom.zoo.tasks import (
    ALPHABET,
    FAMILIES,
    GEN_LENGTH,
    TaskFamily,
    lookup_curriculum,
)

from .codec import Codec

__all__ = ["ALL_MINUTES", "CHECKABLE", "LONG", "LONG_WORDS", "RECIPE", "SHORT", "SPECS", "ZOO", "ModelSpec", "Workload"]


# Training mix: addition and lookup are the slowest to learn, so they are drawn more often.

TRAIN_WEIGHTS = {"add": 2.5, "sort": 1.0, "reverse": 1.0, "copy": 0.8, "lookup": 1.5, "code": 1.0, "story": 0.8}
CURRICULUM = {"lookup3": lookup_curriculum(3), "lookup4": lookup_curriculum(4)}
"""Training-only families, drawn only when ``--weights`` gives them a weight: ``lookup``
with three or four key-value pairs instead of five (fewer distractors)."""
# The long-answer mix: the two arithmetic families most (every step of a chain must be
# right), the grammar-checked tale least, and continuing Shakespeare for natural text.
LONG_WEIGHTS = {"chain": 1.6, "word": 1.2, "tale": 0.5, "prog": 1.0, "text": 0.7}
BATCH = 64  # the notes' recipe used 128; halved for twice the updates on contended cores
LONG_BATCH = 32  # 4x the positions per example: 32 rows of ~184 positions, ~1.5 s a step


@dataclass(frozen=True)
class Workload:
    """What a model is trained and evaluated on: its task suite, vocabulary and answer region.

    ``suite`` holds the checkable families (evaluated; ``--weights`` may name them and the
    ``sources``); ``sources`` are training-only families, drawn when ``mix`` (or
    ``--weights``) gives them a weight; ``block_length`` is the dLLM's decoding block
    (semi-autoregressive: blocks left to right, one token per step inside a block);
    ``words``, the tokenizer's multi-character tokens (none: one token per character), so
    ``gen_length`` counts tokens, not characters.
    """

    name: str
    gen_length: int
    block_length: int
    alphabet: str
    suite: dict[str, TaskFamily]
    sources: dict[str, TaskFamily]
    mix: dict[str, float]
    batch: int
    max_positions: int
    monitor_per_family: int
    words: tuple[str, ...] = ()

    @cached_property
    def codec(self) -> Codec:
        """Text to ids and back with this workload's tokenizer."""
        return Codec.over(self.alphabet, self.words)


SHORT = Workload("short", GEN_LENGTH, GEN_LENGTH, ALPHABET, FAMILIES, CURRICULUM, TRAIN_WEIGHTS, BATCH, 128, 10)
"""The toy zoo's: answers of 8..31 characters in one block of 32, the 54-character alphabet."""
LONG = Workload("long", long_tasks.GEN_LENGTH, 32, long_tasks.ALPHABET, long_tasks.FAMILIES,
                {"text": TEXT, "sums": long_tasks.SUMS},
                LONG_WEIGHTS, LONG_BATCH, 256, 6)
"""The long-answer zoo's: 128 positions in four blocks of 32, printable ASCII and newline."""
LONG_WORDS = Workload("long-words", 64, 16, long_tasks.ALPHABET, long_tasks.FAMILIES, {"sums": long_tasks.SUMS},
                      {"chain": 2.5, "word": 2.0, "tale": 1.2, "prog": 0.8, "sums": 1.5}, 64, 128, 6,
                      words=long_tasks.WORD_TOKENS)
"""The long-answer suite in word tokens (``long_tasks.WORD_TOKENS``; issue 42): 64 positions
in four blocks of 16 (the longest answer, a ten-step ``chain``, is 59 tokens), batches of 64
(rows of at most 96 positions instead of 184), ``long-dllm``'s last mix without the
Shakespeare ``text``, whose words are not in the vocabulary."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture, workload and share of the ``all`` time budget of one zoo model."""

    kind: str  # "dllm" or "ar"
    hidden: int
    layers: int
    heads: int
    ffn: int
    share: float  # fraction of the --minutes budget when training "all" (toy zoo only)
    lr: float = 2e-3
    workload: Workload = SHORT
    kernel: str = "absorbing"  # the transition kernel it decodes with: "revisable" for a model trained to edit


ALL_MINUTES = 300.0
"""The default wall-time budget of ``--model all``; a single model's default is its share."""
# Shares follow the wall time that made the shipped zoo (62, 76, 158 and 14 minutes).
SPECS: dict[str, ModelSpec] = {
    # toy-dllm's architecture trained as a causal LM: not shipped, the initialisation
    # ``toy-dllm`` starts from (``--init-from``).
    "toy-dllm-ar": ModelSpec("ar", hidden=192, layers=4, heads=6, ffn=512, share=0.20),
    "toy-dllm": ModelSpec("dllm", hidden=192, layers=4, heads=6, ffn=512, share=0.25),
    "toy-ar": ModelSpec("ar", hidden=256, layers=5, heads=8, ffn=640, share=0.50, lr=1.5e-3),
    "toy-ar-small": ModelSpec("ar", hidden=128, layers=3, heads=4, ffn=256, share=0.05),
    # The long-answer zoo (``LONG``): long-dllm-ar is long-dllm's shape trained causally,
    # the stage long-dllm starts from; long-ar is the AR target (2.3x), long-ar-small the
    # drafter (0.29x).  Shares are for a single model's default budget (of ALL_MINUTES).
    "long-dllm-ar": ModelSpec("ar", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG),
    "long-dllm": ModelSpec("dllm", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG),
    # long-dllm trained on for parallel (threshold) decoding, from long-dllm's weights (issue 42).
    "long-dllm-par": ModelSpec("dllm", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG),
    "long-ar": ModelSpec("ar", hidden=256, layers=6, heads=8, ffn=768, share=0.8, lr=1.5e-3, workload=LONG),
    "long-ar-small": ModelSpec("ar", hidden=128, layers=3, heads=4, ffn=384, share=0.2, workload=LONG),
    # The long suite in word tokens (``LONG_WORDS``, issue 42): long-dllm's shape, its causal
    # stage first (as long-dllm-ar for long-dllm), then the dLLM from it.
    "long-dllm-words-ar": ModelSpec("ar", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG_WORDS),
    "long-dllm-words": ModelSpec("dllm", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG_WORDS),
    # long-dllm-words trained on to edit its drafts (issue 53): LLaDA2.1's token-to-token rows
    # beside the mask-to-token ones, from long-dllm-words' weights (``--init-from``).
    "long-dllm-words-edit": ModelSpec("dllm", hidden=192, layers=5, heads=6, ffn=512, share=0.4,
                                      workload=LONG_WORDS, kernel="revisable"),
    # long-ar-small's shape in word tokens: the small AR assistant of assisted generation
    # next to FailFast on long-dllm-words-ar (0.35x long-dllm-words with the larger embedding).
    "long-dllm-words-ar-small": ModelSpec("ar", hidden=128, layers=3, heads=4, ffn=384, share=0.2,
                                          workload=LONG_WORDS),
}
ZOO = ("toy-dllm", "toy-ar", "toy-ar-small")
"""The models the package ships (``--model all --eval-only`` re-evaluates them)."""
RECIPE = ("toy-dllm-ar", "toy-dllm", "toy-ar", "toy-ar-small")
"""What ``--model all`` trains, in this order: ``toy-dllm`` starts from the ``toy-dllm-ar``
trained just before it (``--init-out``)."""
CHECKABLE = {**FAMILIES, **long_tasks.FAMILIES}
"""Every checkable family by name (the two suites' names are disjoint)."""
