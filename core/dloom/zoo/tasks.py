"""The toy task suite: deterministic generators and strict exact-match checkers.

Every example is character-level text: a prompt of at most ``MAX_PROMPT_CHARS`` (28)
characters and an answer of ``MIN_ANSWER_CHARS``..``MAX_ANSWER_CHARS`` (8..31) characters,
so that the answer plus at least one ``<eos>`` fits in the decoder's ``GEN_LENGTH`` (32)
positions.

Families (``FAMILIES`` keys are API):

========  ===========================  ==================================
family    prompt                       answer
========  ===========================  ==================================
add       ``add 347 58``               ``347+58=405``
sort      ``sort 9302718``             ``0123789`` (8..12 symbols)
reverse   ``rev q7kd2mza``             ``azm2dk7q``
copy      ``copy ab cd efg``           ``ab cd efg``
lookup    ``k3 b7 x1 d9 m4 ?xbd``      ``x1,b7,d9``
code      ``def sq(x): square``        ``return x*x``
story     ``story tom big cat``        ``tom fed the big cat today.``
========  ===========================  ==================================

``add`` adds a 2–3 digit number (10..299) to a 2 digit number; the answer restates the operands, so
it mixes trivially copyable positions with carry positions.  ``story`` is the one family
with genuine randomness: the verb and the optional closing word are sampled, and the
checker accepts every continuation the grammar allows that uses the prompt's name,
adjective and animal (``STORY_RE``).  All other checkers compare with the unique answer.

Train / held-out separation: a prompt is *held out* iff
``blake2b(family + "\\0" + prompt) % 10 == 0`` (``is_held_out``).  ``train_stream`` skips
held-out prompts and ``held_out`` keeps only them, so the two splits never share a prompt,
whatever the seeds.  Both are deterministic functions of their seed; their ``suite``
argument selects another suite's families (:data:`dloom.zoo.long_tasks.FAMILIES`) under the
same split.

Dev split: ``dev`` draws held-out prompts for choosing settings (a strategy's operating
point) from its own stream and never yields one of ``held_out(EVALUATED)``, the prompts an
evaluation of up to :data:`EVALUATED` examples scores; settings chosen on it are scored on
those without having seen them.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "ALPHABET",
    "FAMILIES",
    "GEN_LENGTH",
    "MAX_ANSWER_CHARS",
    "MAX_PROMPT_CHARS",
    "MIN_ANSWER_CHARS",
    "STORY_RE",
    "Example",
    "EVALUATED",
    "TaskFamily",
    "dev",
    "held_out",
    "is_held_out",
    "lookup_curriculum",
    "train_stream",
]

GEN_LENGTH = 32
"""Answer-region length the decoder generates: answer, then ``<eos>`` padding."""
MAX_PROMPT_CHARS = 28
MIN_ANSWER_CHARS = 8
MAX_ANSWER_CHARS = GEN_LENGTH - 1

ALPHABET = string.ascii_lowercase + string.digits + " +-*/%=<>(),.:;?!_"
"""Every character a task string may contain (the tokenizer's non-special vocabulary)."""

_LETTERS = string.ascii_lowercase
_DIGITS = string.digits


@dataclass(frozen=True)
class Example:
    """One task instance: ``answer`` is a (for ``story``: one) correct answer to ``prompt``."""

    family: str
    prompt: str
    answer: str


@dataclass(frozen=True)
class TaskFamily:
    """A named task: ``generate(rng)`` draws an example, ``check(prompt, answer)`` grades one.

    ``generate`` draws from the whole prompt space (train and held-out alike); use
    ``train_stream`` / ``held_out`` for the splits.  ``answers(prompt)`` lists every right
    answer of a family whose right answers are few and all drawn, equally likely, by its
    generator (``None`` for the others).
    """

    name: str
    _generate: Callable[[random.Random], tuple[str, str]]
    _check: Callable[[str, str], bool]
    _answers: Callable[[str], list[str]] | None = None

    def generate(self, rng: random.Random) -> Example:
        prompt, answer = self._generate(rng)
        return Example(self.name, prompt, answer)

    def answers(self, prompt: str) -> list[str] | None:
        """Every right answer of ``prompt``, or ``None`` if the family does not list them."""
        return None if self._answers is None else self._answers(prompt)

    def check(self, prompt: str, answer: str) -> bool:
        try:
            return bool(self._check(prompt, answer))
        except (ValueError, IndexError, KeyError):
            return False


def _strip_command(prompt: str, command: str) -> str:
    """The prompt's argument after ``command``; raises ``ValueError`` on another command."""
    if not prompt.startswith(command):
        raise ValueError(f"not a {command.strip()!r} prompt: {prompt!r}")
    return prompt[len(command) :]


# ----------------------------------------------------------------------------- add
def _gen_add(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(10, 299)
    b = rng.randint(10, 99)
    return f"add {a} {b}", f"{a}+{b}={a + b}"


def _check_add(prompt: str, answer: str) -> bool:
    a, b = _strip_command(prompt, "add ").split(" ")
    return answer == f"{a}+{b}={int(a) + int(b)}"


# ----------------------------------------------------------------------------- sort
def _gen_sort(rng: random.Random) -> tuple[str, str]:
    pool = _DIGITS if rng.random() < 0.5 else _LETTERS[:12]
    items = "".join(rng.choice(pool) for _ in range(rng.randint(8, 12)))
    return f"sort {items}", "".join(sorted(items))


def _check_sort(prompt: str, answer: str) -> bool:
    items = _strip_command(prompt, "sort ")
    return bool(items) and answer == "".join(sorted(items))


# -------------------------------------------------------------------------- reverse
def _gen_reverse(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice(_LETTERS + _DIGITS) for _ in range(rng.randint(8, 14)))
    return f"rev {s}", s[::-1]


def _check_reverse(prompt: str, answer: str) -> bool:
    s = _strip_command(prompt, "rev ")
    return bool(s) and answer == s[::-1]


# ----------------------------------------------------------------------------- copy
def _gen_copy(rng: random.Random) -> tuple[str, str]:
    words: list[str] = []
    while True:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 5)))
        if len(" ".join([*words, word])) > 20:
            break
        words.append(word)
        if len(" ".join(words)) >= 8 and rng.random() < 0.35:
            break
    s = " ".join(words)
    if len(s) < 8:  # pad a too-short draw with one more word
        s = f"{s} {''.join(rng.choice(_LETTERS) for _ in range(8 - len(s)))}".strip()
    return f"copy {s}", s


def _check_copy(prompt: str, answer: str) -> bool:
    s = _strip_command(prompt, "copy ")
    return bool(s) and answer == s


# --------------------------------------------------------------------------- lookup
LOOKUP_PAIRS = 5
"""Key-value pairs in a ``lookup`` prompt's context."""
LOOKUP_QUERIES = 3
"""Keys a ``lookup`` prompt asks for, in the order the answer must give them."""


def _lookup_generator(pairs: int) -> Callable[[random.Random], tuple[str, str]]:
    """Context of ``pairs`` letter keys each followed by a one-digit value, then a query.

    Each value sits right after its key, in the context and in the answer, so a model finds
    it by matching the key's content (an induction-head step); where the key sits in the
    context is random, so retrieving by position scores about ``(1/pairs) ** 3``.  (An
    earlier ``k=31`` form, two-digit values behind ``=``, needs a second matching step; the
    zoo's models did not learn it in 2,000 lookup-only steps, see ``dloom_training.train``.)
    """

    def generate(rng: random.Random) -> tuple[str, str]:
        keys = rng.sample(_LETTERS, pairs)
        table = {key: rng.choice(_DIGITS) for key in keys}
        query = rng.sample(keys, LOOKUP_QUERIES)
        context = " ".join(f"{k}{v}" for k, v in table.items())
        return f"{context} ?{''.join(query)}", ",".join(f"{k}{table[k]}" for k in query)

    return generate


_LOOKUP_PROMPT = re.compile(r"^(?:[a-z][0-9] )+\?[a-z]+$")


def _check_lookup(prompt: str, answer: str) -> bool:
    if _LOOKUP_PROMPT.match(prompt) is None:
        return False
    *pairs, query = prompt.split(" ")
    table = {pair[0]: pair[1] for pair in pairs}
    return answer == ",".join(f"{k}{table[k]}" for k in query.removeprefix("?"))


# ----------------------------------------------------------------------------- code
_CODE_UNARY = {  # description -> body template over the argument {x}
    "square": "{x}*{x}",
    "double": "{x}+{x}",
    "triple": "3*{x}",
    "inc": "{x}+1",
    "dec": "{x}-1",
    "half": "{x}//2",
    "neg": "-{x}",
    "abs": "abs({x})",
    "even": "{x}%2==0",
    "odd": "{x}%2==1",
    "sign": "{x}>0",
    "str": "str({x})",
}
_CODE_BINARY = {  # description -> body template over the arguments {x}, {y}
    "add": "{x}+{y}",
    "sub": "{x}-{y}",
    "mul": "{x}*{y}",
    "div": "{x}//{y}",
    "mod": "{x}%{y}",
    "max": "max({x},{y})",
    "min": "min({x},{y})",
    "less": "{x}<{y}",
    "same": "{x}=={y}",
    "pow": "{x}**{y}",
}
_CODE_NAMES = ("f", "g", "h", "fn", "op", "calc", "run", "sq", "go")
_CODE_PROMPT = re.compile(r"^def ([a-z]+)\(([a-z])(?:,([a-z]))?\): ([a-z]+)$")


def _code_body(desc: str, x: str, y: str | None) -> str:
    template = _CODE_UNARY[desc] if y is None else _CODE_BINARY[desc]
    return "return " + template.format(x=x, y=y)


def _gen_code(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(_CODE_NAMES)
    if rng.random() < 0.5:
        x, y = rng.choice(_LETTERS), None
        desc = rng.choice(sorted(_CODE_UNARY))
        prompt = f"def {name}({x}): {desc}"
    else:
        x, y = rng.sample(_LETTERS, 2)
        desc = rng.choice(sorted(_CODE_BINARY))
        prompt = f"def {name}({x},{y}): {desc}"
    return prompt, _code_body(desc, x, y)


def _check_code(prompt: str, answer: str) -> bool:
    match = _CODE_PROMPT.match(prompt)
    if match is None:
        return False
    _, x, y, desc = match.groups()
    if desc not in (_CODE_UNARY if y is None else _CODE_BINARY):
        return False
    return answer == _code_body(desc, x, y)


# ---------------------------------------------------------------------------- story
_STORY_NAMES = ("tom", "ann", "bob", "sue", "max", "eva", "leo", "mia", "sam", "zoe", "anna", "ben")
_STORY_ADJS = ("big", "old", "red", "shy", "wet", "odd")
_STORY_ANIMALS = ("cat", "dog", "fox", "owl", "hen", "cow", "bird", "frog")
_STORY_VERBS = ("saw", "fed", "met", "hugged", "chased")
_STORY_ENDINGS = ("", " again", " today")
STORY_RE = re.compile(
    r"^(?P<name>[a-z]+) (?:" + "|".join(_STORY_VERBS) + r") the (?P<adj>[a-z]+) "
    r"(?P<animal>[a-z]+)(?:" + "|".join(e for e in _STORY_ENDINGS if e) + r")?\.$"
)
"""The story grammar: ``NAME VERB the ADJ ANIMAL [again|today].``"""


def _gen_story(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(_STORY_NAMES)
    adj = rng.choice(_STORY_ADJS)
    animal = rng.choice(_STORY_ANIMALS)
    verb = rng.choice(_STORY_VERBS)
    ending = rng.choice(_STORY_ENDINGS)
    return f"story {name} {adj} {animal}", f"{name} {verb} the {adj} {animal}{ending}."


def _check_story(prompt: str, answer: str) -> bool:
    name, adj, animal = _strip_command(prompt, "story ").split(" ")
    match = STORY_RE.match(answer)
    return match is not None and match.group("name", "adj", "animal") == (name, adj, animal)


FAMILIES: dict[str, TaskFamily] = {
    family.name: family
    for family in (
        TaskFamily("add", _gen_add, _check_add),
        TaskFamily("sort", _gen_sort, _check_sort),
        TaskFamily("reverse", _gen_reverse, _check_reverse),
        TaskFamily("copy", _gen_copy, _check_copy),
        TaskFamily("lookup", _lookup_generator(LOOKUP_PAIRS), _check_lookup),
        TaskFamily("code", _gen_code, _check_code),
        TaskFamily("story", _gen_story, _check_story),
    )
}




def lookup_curriculum(pairs: int) -> TaskFamily:
    """``lookup`` over ``pairs`` (3 or 4) key-value pairs: fewer distractors than the suite's
    :data:`LOOKUP_PAIRS`, for a training curriculum.  Its examples are graded by the same
    checker and named ``lookup``, so the held-out split still excludes their prompts."""
    if not LOOKUP_QUERIES <= pairs < LOOKUP_PAIRS:
        raise ValueError(f"pairs must be in [{LOOKUP_QUERIES}, {LOOKUP_PAIRS}), got {pairs}")
    return TaskFamily("lookup", _lookup_generator(pairs), _check_lookup)


# --------------------------------------------------------------------------- splits
def is_held_out(family: str, prompt: str) -> bool:
    """Whether ``prompt`` belongs to the held-out split (about one prompt in ten)."""
    digest = hashlib.blake2b(f"{family}\0{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 10 == 0


def _families(families: Sequence[str] | None, suite: Mapping[str, TaskFamily]) -> list[str]:
    names = list(suite) if families is None else list(families)
    unknown = [name for name in names if name not in suite]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {sorted(suite)}")
    return names


def train_stream(
    seed: int,
    families: Sequence[str | TaskFamily] | None = None,
    weights: Sequence[float] | None = None,
    suite: Mapping[str, TaskFamily] = FAMILIES,
) -> Iterator[Example]:
    """Yield training examples forever: never a held-out prompt, deterministic in ``seed``.

    :param seed: seeds the stream's private ``random.Random``.
    :param families: families to draw from, by name or as :class:`TaskFamily` objects such
        as :func:`lookup_curriculum` (default: all of ``suite``, in its order).
    :param weights: relative sampling weight per family (default: uniform).
    :param suite: the families names are looked up in: this suite's ``FAMILIES`` (default)
        or another one, such as :data:`dloom.zoo.long_tasks.FAMILIES`.
    """
    chosen = list(suite) if families is None else list(families)
    _families([family for family in chosen if not isinstance(family, TaskFamily)], suite)  # unknown names
    population = [family if isinstance(family, TaskFamily) else suite[family] for family in chosen]
    rng = random.Random(f"train:{seed}")
    while True:
        family = rng.choices(population, weights=weights)[0]
        example = family.generate(rng)
        if not is_held_out(example.family, example.prompt):
            yield example


def held_out(
    n: int,
    seed: int = 0,
    families: Sequence[str] | None = None,
    suite: Mapping[str, TaskFamily] = FAMILIES,
) -> list[Example]:
    """``n`` held-out examples, balanced over ``families`` of ``suite`` (round-robin, default:
    all of them), deterministic; ``held_out(n)`` is a prefix of ``held_out(m)`` for ``n < m``.

    Prompts are distinct within the list as long as the family's held-out space allows.
    """
    names = _families(families, suite)
    return _draw(n, names, suite, {name: random.Random(f"held-out:{seed}:{name}") for name in names}, set())


EVALUATED = 500
"""The dev split avoids ``held_out(EVALUATED)`` of the same families: the first 500
held-out examples, the most any evaluation of the zoo scores (issue 42's bar)."""


def dev(
    n: int,
    seed: int = 0,
    families: Sequence[str] | None = None,
    suite: Mapping[str, TaskFamily] = FAMILIES,
    evaluated: int = EVALUATED,
) -> list[Example]:
    """``n`` held-out examples for choosing settings, balanced like :func:`held_out` and
    deterministic, none of them one of ``held_out(evaluated, families=families, suite=suite)``
    (a run that scores ``held_out(m)`` with ``m <= evaluated`` never scores a dev prompt).

    :raises ValueError: when a family has no held-out prompt outside the evaluated ones.
    """
    names = _families(families, suite)
    refused = {(e.family, e.prompt) for e in held_out(evaluated, 0, names, suite)}
    return _draw(n, names, suite, {name: random.Random(f"dev:{seed}:{name}") for name in names}, refused)


def _draw(
    n: int, names: list[str], suite: Mapping[str, TaskFamily], rngs: Mapping[str, random.Random],
    refused: set[tuple[str, str]],
) -> list[Example]:
    """``n`` held-out examples round-robin over ``names``, each from its family's ``rngs``
    stream, never one of ``refused`` (``(family, prompt)``); distinct while the family's
    held-out space allows (a repeat only after 5,000 draws found no new prompt)."""
    seen: set[tuple[str, str]] = set()
    examples: list[Example] = []
    for i in range(n):
        name = names[i % len(names)]
        for attempt in range(10_000):
            example = suite[name].generate(rngs[name])
            key = (name, example.prompt)
            if is_held_out(name, example.prompt) and key not in refused and (key not in seen or attempt > 5_000):
                seen.add(key)
                examples.append(example)
                break
        else:
            raise ValueError(f"family {name!r} has no held-out prompt left to draw (refused: {len(refused)})")
    return examples
