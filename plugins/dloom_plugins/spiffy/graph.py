"""Calibrated draft graphs: the file format, its checks, and the tensors a decoder fills.

A node is a *formula*: a set of ``(i, j)`` pairs, "the masked position of confidence rank
``i`` takes its token of probability rank ``j``", ranked under the distribution known when
the drafts are built (:mod:`dloom_plugins.spiffy.frame`). Node ``0`` is the root (no pair);
a node's parents are the nodes one kernel step before it on some calibration path, so a node
reached by different orders of commits has several parents.

File format (JSON, ``"format": "dloom-draft-graph"``, ``"version": 1``)::

    {"format": "dloom-draft-graph", "version": 1,
     "model": "toy-dllm", "tokenizer_sha256": "…",
     "base": {"strategy": "quota", "params": {}, "steps_per_block": 8},
     "block_length": 8, "temperature": 0.0, "remasking": "low_confidence",
     "budget": 8, "score": "own",
     "calibration": {"prompts": 70, "paths": 1234, …},
     "nodes": [{"id": 1, "pairs": [[0, 0]], "parents": [0], "frequency": 812,
                "score": 812.0}, …]}

Node ids are ``1 .. budget``, every parent id is smaller than its child's (parents come
first), and every node is reachable from the root.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dloom.sdk import ConfigurationError

FORMAT = "dloom-draft-graph"
VERSION = 1
BUILTIN_DIR = Path(__file__).parent / "graphs"
MAX_NODES = 256
"""The most drafts a graph file may hold: a verification forward evaluates up to ``D*``
of them per row, and building the tensors of thousands costs gigabytes and minutes."""


KIND_NAMES = {int: "an integer", float: "a number", str: "a string", dict: "an object"}


def expect(bad: Any, what: str, value: Any, kind: type, low: float | None = None,
           high: float | None = None) -> Any:
    """``value`` if it is a ``kind`` (``float`` also takes an int; a bool is neither)
    within ``[low, high]``, else ``bad(message)`` raised."""
    kinds: tuple[Any, ...] = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) or not isinstance(value, kinds) or (
        kind is float and not math.isfinite(value)
    ):
        raise bad(f"{what} is {value!r}; expected {KIND_NAMES.get(kind, kind.__name__)}")
    if (low is not None and value < low) or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"{low} .. {high}"
        raise bad(f"{what} is {value!r}; allowed: {allowed}")
    return value


@dataclass(frozen=True)
class GraphNode:
    """One draft formula.

    :ivar pairs: sorted ``(position rank, vocabulary rank)`` pairs, relative to the root.
    :ivar parents: ids of the nodes one step before it (``0`` = the root).
    :ivar frequency: calibration paths through this node.
    :ivar score: the selection score it was kept with.
    """

    pairs: tuple[tuple[int, int], ...]
    parents: tuple[int, ...]
    frequency: int = 0
    score: float = 0.0


@dataclass(frozen=True)
class GraphTemplate:
    """A graph's formulas as tensors, ready to fill (shapes: ``N`` drafts, ``P`` pairs).

    :ivar position_rank: ``(N, P)`` long, ``-1`` past a node's pairs.
    :ivar token_rank: ``(N, P)`` long, ``-1`` past a node's pairs.
    :ivar parents: ``(N + 1, N + 1)`` bool, node 0 the root.
    :ivar depth: ``(N + 1,)`` long on the host, the fewest steps from the root.
    :ivar token_ranks: how many vocabulary ranks the formulas use (``max j + 1``).
    """

    position_rank: torch.Tensor
    token_rank: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    token_ranks: int


@dataclass(frozen=True)
class CalibratedGraph:
    """A draft graph calibrated for one model, tokenizer, base commit rule and block length.

    :ivar model: the model's name (a zoo name, or the checkpoint directory's name).
    :ivar tokenizer_sha256: :attr:`dloom.ModelAdapter.tokenizer_sha256` (``None``: none).
    :ivar base: ``{"strategy", "params", "steps_per_block"}`` of the reference commit rule.
    :ivar block_length: / :ivar temperature: / :ivar remasking: the calibration run's.
    :ivar nodes: the drafts, ids ``1 .. len(nodes)`` in order.
    :ivar calibration: how it was made (prompts, paths, tasks, seed, seconds).
    """

    model: str
    tokenizer_sha256: str | None
    base: Mapping[str, Any]
    block_length: int
    temperature: float
    remasking: str
    nodes: tuple[GraphNode, ...]
    calibration: Mapping[str, Any] = field(default_factory=dict)
    score: str = "own"

    @property
    def budget(self) -> int:
        """``D``, the number of drafts."""
        return len(self.nodes)

    # --- file format -------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "tokenizer_sha256": self.tokenizer_sha256,
            "base": dict(self.base),
            "block_length": self.block_length,
            "temperature": self.temperature,
            "remasking": self.remasking,
            "budget": self.budget,
            "score": self.score,
            "calibration": dict(self.calibration),
            "nodes": [
                {
                    "id": index,
                    "pairs": [list(pair) for pair in node.pairs],
                    "parents": list(node.parents),
                    "frequency": node.frequency,
                    "score": node.score,
                }
                for index, node in enumerate(self.nodes, start=1)
            ],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: Any, source: str = "draft graph") -> CalibratedGraph:
        """Parse and check a graph file's content.

        :raises ConfigurationError: naming the file and what is wrong with it.
        """

        def bad(message: str) -> ConfigurationError:
            return ConfigurationError(f"malformed draft graph {source}: {message}")

        if not isinstance(data, dict):
            raise bad(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise bad(f"'format' is {data.get('format')!r}; expected {FORMAT!r}")
        if data.get("version") != VERSION:
            raise bad(f"'version' is {data.get('version')!r}; this dloom reads version {VERSION}")
        required = ("model", "base", "block_length", "temperature", "remasking", "nodes")
        missing = [key for key in required if key not in data]
        if missing:
            raise bad(f"missing {', '.join(repr(k) for k in missing)}")
        expect(bad, "'model'", data["model"], str)
        if data.get("tokenizer_sha256") is not None:
            expect(bad, "'tokenizer_sha256'", data["tokenizer_sha256"], str)
        base = data["base"]
        if not isinstance(base, dict) or not {"strategy", "params", "steps_per_block"} <= set(base):
            raise bad("'base' needs 'strategy', 'params' and 'steps_per_block'")
        expect(bad, "'base.strategy'", base["strategy"], str)
        expect(bad, "'base.params'", base["params"], dict)
        steps_per_block = expect(bad, "'base.steps_per_block'", base["steps_per_block"], int, low=1)
        block_length = expect(bad, "'block_length'", data["block_length"], int, low=1)
        temperature = expect(bad, "'temperature'", data["temperature"], float, low=0)
        expect(bad, "'remasking'", data["remasking"], str)
        expect(bad, "'score'", data.get("score", "own"), str)
        if not isinstance(data.get("calibration", {}), dict):
            raise bad(f"'calibration' is {data['calibration']!r}; expected an object")
        if not isinstance(data["nodes"], list) or not data["nodes"]:
            raise bad("'nodes' must be a non-empty list")
        if len(data["nodes"]) > MAX_NODES:
            raise bad(
                f"{len(data['nodes'])} nodes; allowed: at most {MAX_NODES} (each node is a draft "
                "row every verification forward may evaluate; keep D small, e.g. --budget 10)"
            )
        nodes: list[GraphNode] = []
        for index, raw in enumerate(data["nodes"], start=1):
            if not isinstance(raw, dict) or not {"id", "pairs", "parents"} <= set(raw):
                raise bad(f"node {index} needs 'id', 'pairs' ([[i, j], ...]) and 'parents'")
            node_id = expect(bad, f"node {index} 'id'", raw["id"], int)
            if node_id != index:
                raise bad(f"node ids must run 1, 2, ...; node {index} has id {node_id!r}")
            raw_pairs = raw["pairs"]
            if not isinstance(raw_pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in raw_pairs):
                raise bad(f"node {index} needs 'id', 'pairs' ([[i, j], ...]) and 'parents'; 'pairs' is {raw_pairs!r}")
            pairs = tuple(sorted(
                (expect(bad, f"node {index} position rank", i, int, low=0),
                 expect(bad, f"node {index} vocabulary rank", j, int, low=0))
                for i, j in raw_pairs
            ))
            if not isinstance(raw["parents"], list):
                raise bad(f"node {index} 'parents' is {raw['parents']!r}; expected a list of node ids")
            parents = tuple(expect(bad, f"node {index} parent", p, int, low=0) for p in raw["parents"])
            if not pairs:
                raise bad(f"node {index} needs at least one pair of non-negative ranks")
            if len({i for i, _ in pairs}) != len(pairs):
                raise bad(f"node {index} fills one position rank twice: {list(pairs)}")
            if any(i >= block_length for i, _ in pairs):
                raise bad(f"node {index} has a position rank >= block_length {block_length}")
            if not parents or any(p >= index for p in parents):
                raise bad(f"node {index} has parents {list(parents)}; each must be an earlier node id or 0")
            for p in parents:
                parent_pairs = set(nodes[p - 1].pairs) if p else set()
                if not parent_pairs < set(pairs):
                    raise bad(f"node {index}'s pairs do not strictly contain those of its parent {p}")
            frequency = expect(bad, f"node {index} 'frequency'", raw.get("frequency", 0), int, low=0)
            score = expect(bad, f"node {index} 'score'", raw.get("score", 0.0), float)
            nodes.append(GraphNode(pairs, parents, frequency, score))
        if data.get("budget", len(nodes)) != len(nodes):
            raise bad(f"'budget' is {data.get('budget')!r} but the file has {len(nodes)} nodes")
        return cls(
            model=data["model"],
            tokenizer_sha256=data.get("tokenizer_sha256"),
            base={"strategy": base["strategy"], "params": dict(base["params"]),
                  "steps_per_block": steps_per_block},
            block_length=block_length,
            temperature=float(temperature),
            remasking=data["remasking"],
            nodes=tuple(nodes),
            calibration=dict(data.get("calibration", {})),
            score=data.get("score", "own"),
        )

    @classmethod
    def load(cls, path: str | Path) -> CalibratedGraph:
        """Read a graph file.

        :raises ConfigurationError: for a missing, unreadable or malformed file.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigurationError(f"draft graph file {str(path)!r} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConfigurationError(f"malformed draft graph {str(path)!r}: {error}") from None
        return cls.from_json(data, repr(str(path)))

    # --- compatibility -----------------------------------------------------------------

    def check_vocabulary(self, vocab_size: int | None, source: str) -> None:
        """Refuse vocabulary ranks beyond the model's vocabulary (``None``: unknown).

        :raises ConfigurationError: naming the node, its rank and the vocabulary size.
        """
        if vocab_size is None:
            return
        for index, node in enumerate(self.nodes, start=1):
            for _, j in node.pairs:
                if j >= vocab_size:
                    raise ConfigurationError(
                        f"draft graph {source}: node {index} uses vocabulary rank {j}; the model "
                        f"has {vocab_size} tokens (allowed ranks 0 .. {vocab_size - 1})"
                    )

    def mismatches(self, config: Mapping[str, Any]) -> list[str]:
        """What differs between this graph and a decoder's settings (empty: compatible).

        :param config: :attr:`dloom.DiffusionDecoder.setup`.
        """
        wanted_base = {
            "strategy": config["commit_rule"],
            "params": dict(config["commit_params"]),
            "steps_per_block": config["steps_per_block"],
        }
        found = []
        if Path(self.model).name != Path(str(config["model"])).name:
            found.append(f"model {self.model!r} (decoder: {config['model']!r})")
        if self.tokenizer_sha256 != config.get("tokenizer_sha256"):
            found.append(
                f"tokenizer sha256 {self.tokenizer_sha256!r} (decoder: {config.get('tokenizer_sha256')!r})"
            )
        if self.block_length != config["block_length"]:
            found.append(f"block_length {self.block_length} (decoder: {config['block_length']})")
        if dict(self.base) != wanted_base:
            found.append(f"base rule {dict(self.base)} (decoder: {wanted_base})")
        return found

    def template(self, device: torch.device | str = "cpu") -> GraphTemplate:
        """The formulas as tensors on ``device`` (depth stays on the host)."""
        count = len(self.nodes)
        width = max(len(node.pairs) for node in self.nodes)
        position_rank = torch.full((count, width), -1, dtype=torch.long)
        token_rank = torch.full((count, width), -1, dtype=torch.long)
        parents = torch.zeros(count + 1, count + 1, dtype=torch.bool)
        depth = torch.zeros(count + 1, dtype=torch.long)
        for index, node in enumerate(self.nodes, start=1):
            for column, (i, j) in enumerate(node.pairs):
                position_rank[index - 1, column] = i
                token_rank[index - 1, column] = j
            parents[index, list(node.parents)] = True
            depth[index] = 1 + min(int(depth[p]) for p in node.parents)
        return GraphTemplate(
            position_rank.to(device), token_rank.to(device), parents.to(device), depth,
            int(token_rank.max()) + 1,
        )


def calibrate_command(config: Mapping[str, Any]) -> str:
    """The ``dloom calibrate`` command that makes a graph for the decoder whose
    :attr:`~dloom.DiffusionDecoder.setup` is ``config``, or, for a model built in memory
    (not a zoo name or directory), what to do instead."""
    from dloom.sdk.zoo import MODEL_NAMES

    model = str(config["model"])
    options = [f"--strategy {config['commit_rule']}"]
    options += [f"--param {name}={value}" for name, value in dict(config["commit_params"]).items()]
    gen_length, steps = config.get("gen_length"), config.get("steps")
    if gen_length is not None:
        options.append(f"--gen-length {gen_length}")
    options.append(f"--block-length {config['block_length']}")
    if steps is not None and steps != gen_length:
        options.append(f"--steps {steps}")
    command = f"dloom calibrate {{model}} {' '.join(options)} -o graph.json"
    if model in MODEL_NAMES or Path(model).is_dir():
        return f"Calibrate one with `{command.format(model='--model ' + shlex.quote(model))}`"
    return (
        f"Model {model!r} is built in memory, so it cannot be calibrated by name; save it "
        f"(save_pretrained) and run `{command.format(model='--model DIR')}`"
    )


def builtin_graphs() -> list[Path]:
    """The graph files shipped with dloom."""
    return sorted(BUILTIN_DIR.glob("*.json"))


def find_builtin(config: Mapping[str, Any]) -> CalibratedGraph | None:
    """The shipped graph calibrated for the decoder's model, tokenizer, base and block
    length, or ``None`` when none fits."""
    for path in builtin_graphs():
        graph = CalibratedGraph.load(path)
        if not graph.mismatches(config):
            return graph
    return None


DEFAULT_CHAIN = 6
"""Depth of the uncalibrated default graph's main chain."""


def default_graph(config: Mapping[str, Any]) -> CalibratedGraph:
    """An uncalibrated graph for any decoder: the chain "the next most confident position
    takes its most likely token" (``{(0,0)}``, ``{(0,0),(1,0)}``, ...) up to
    :data:`DEFAULT_CHAIN` steps, and the first step's likeliest alternatives (second token,
    second position). What a one-token-per-step base most often does; calibrated graphs do
    better, and any graph is lossless."""
    width = config["block_length"]
    chain = [tuple((i, 0) for i in range(depth)) for depth in range(1, min(DEFAULT_CHAIN, width) + 1)]
    edges = {pairs: [chain[index - 1] if index else ()] for index, pairs in enumerate(chain)}
    edges[((0, 1),)] = [()]
    if width > 2:
        edges[((1, 0),)] = [()]
        edges[((0, 0), (2, 0))] = [chain[0]]
    ordered = sorted(edges, key=len)  # parents (fewer pairs) before children
    ids = {(): 0, **{pairs: index for index, pairs in enumerate(ordered, start=1)}}
    nodes = [GraphNode(pairs, tuple(ids[p] for p in edges[pairs])) for pairs in ordered]
    return CalibratedGraph(
        model=str(config["model"]),
        tokenizer_sha256=config.get("tokenizer_sha256"),
        base={"strategy": config["commit_rule"], "params": dict(config["commit_params"]),
              "steps_per_block": config["steps_per_block"]},
        block_length=width,
        temperature=float(config["temperature"]),
        remasking=str(config["remasking"]),
        nodes=tuple(nodes),
        calibration={"uncalibrated": True},
    )
