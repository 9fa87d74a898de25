"""The long-answer task suite: answers that fill most of a 128-position region.

The shipped suite (:mod:`dloom.zoo.tasks`) has answers of 8..31 characters in 32 positions;
most of its output is ``<eos>`` padding and most answers are committed in one forward.  These
families have the shape of real dLLM decoding: answers of 45..127 characters (76..104 on
average, by family; about 31 % padding over the suite) decoded in
``GEN_LENGTH`` = 128 positions (four blocks of 32), where later parts of an answer depend on
earlier ones and several slots inside an answer have more than one right filler.

==========  ==========================================  =======================================
family      prompt                                      answer (one of the right ones)
==========  ==========================================  =======================================
``chain``   ``chain 61-37+24-18+55-13+40``              ``61-37=24;24+24=48;...;39+40=79``
``word``    ``ann had 15 pears, got 12, ate 3. ...?``   ``ann had 15 pears. she got 12, so
                                                        15+12=27. ... now ann has 24 pears.``
``tale``    ``tale tom fox park``                       ``tom went to the park. there he saw a
                                                        red fox. ...``
``prog``    ``prog calc(a,b): add,square,dec``          ``def calc(a,b):\\n    t=a+b\\n ...``
==========  ==========================================  =======================================

* ``chain`` writes a running sum out step by step; every step's left operand is the previous
  step's result, so the answer's end depends on all of its beginning.  One right answer.
* ``word``: a worked solution of a two- or three-step word problem ending in the number asked
  for; each step's connective (``so``/``now``/``giving``) and the closing sentence's
  form are free, every arithmetic step and the final count are checked; a prompt is drawn
  only if its longest right solution fits the region, so every right solution does.
* ``tale``: four sentences from a grammar (``TALE_RE``) with several right fillers per slot
  (verb, adjective, what the animal did, the ending); the prompt fixes the name, animal and
  place, the name fixes the pronoun.
* ``prog``: a Python function of several statements, one per operation named in the prompt;
  the checker parses it (``def`` line, assignments, ``return``) and runs its arithmetic on
  test inputs against the reference, so every equivalent spelling (``t*t`` / ``t**2``,
  ``a+b`` / ``b+a``, any temporary name) is right.

Characters: prompts and answers use :data:`ALPHABET` (the shipped suite's characters plus
upper case, newline and the rest of printable ASCII, the vocabulary of the long-answer zoo
models, which the natural-text component :mod:`dloom.zoo.corpus` needs too).

:data:`SUMS` is a training-only source (``word``'s arithmetic as a drill), drawn when a
training mix gives it a weight and never evaluated.

Splits follow :mod:`dloom.zoo.tasks`: a prompt is held out iff
``blake2b(family + "\\0" + prompt) % 10 == 0``; ``tasks.train_stream(seed, suite=FAMILIES)``
never yields a held-out prompt and ``tasks.held_out(n, suite=FAMILIES)`` yields only them.
"""

from __future__ import annotations

import ast
import itertools
import random
import re
import string

from .tasks import ALPHABET as SHORT_ALPHABET
from .tasks import TaskFamily

__all__ = [
    "ALPHABET",
    "FAMILIES",
    "GEN_LENGTH",
    "MAX_ANSWER_CHARS",
    "MAX_PROMPT_CHARS",
    "MIN_ANSWER_CHARS",
    "SUMS",
    "SUMS_MAX_VALUE",
    "SUMS_STEPS",
    "TALE_RE",
    "WORDS",
    "WORD_TOKENS",
]

GEN_LENGTH = 128
"""Answer-region length of the long-answer models: the answer, then ``<eos>`` padding."""
MAX_PROMPT_CHARS = 56
MIN_ANSWER_CHARS = 45
"""A lower bound on every family's answers (the shortest ``chain``, seven steps, has 62)."""
MAX_ANSWER_CHARS = GEN_LENGTH - 1

ALPHABET = SHORT_ALPHABET + "".join(
    c for c in string.ascii_uppercase + string.punctuation + "\n" if c not in SHORT_ALPHABET
)
"""The long-answer zoo's characters: the shipped suite's ``ALPHABET`` first (same order, so
same ids), then upper case, the remaining ASCII punctuation and the newline."""


WORDS = (
    "a", "add", "addx", "amy", "and", "ann", "apples", "at", "ate", "away", "b", "bat", "beach",
    "bee", "ben", "big", "bob", "books", "bought", "c", "calc", "came", "cards", "cat", "chain",
    "closer", "coins", "cow", "d", "dan", "day", "dec", "def", "dog", "double", "down", "duck",
    "e", "eggs", "eva", "f", "farm", "field", "for", "found", "fox", "frog", "g", "garden",
    "giving", "go", "goat", "good", "goodbye", "got", "grass", "had", "half", "happy", "has", "he",
    "hen", "her", "hid", "hill", "him", "home", "how", "in", "inc", "it", "ivy", "jim", "kim",
    "lake", "leo", "looked", "lost", "many", "max", "mia", "min", "mix", "mul", "mulx", "neg",
    "now", "old", "owl", "park", "pears", "pig", "prog", "r", "ran", "red", "return", "river",
    "road", "run", "s", "said", "sam", "sat", "saw", "she", "shells", "shop", "shy", "small",
    "smiled", "so", "sold", "square", "step", "story", "sub", "suby", "sue", "sums", "t", "tale",
    "the", "there", "to", "told", "tom", "town", "triple", "v", "walked", "was", "waved", "went",
    "wood", "zoe",
)
"""Every word of the suite's prompts and answers (``chain``, ``word``, ``tale``, ``prog``
and ``sums``), sorted; ``tests/zoo`` checks that fresh examples use no other."""
WORD_TOKENS = (
    "\n    ",
    *(token for word in (*WORDS, *map(str, range(1000))) for token in (word, " " + word) if len(token) > 1),
)
"""The multi-character tokens of the word-level tokenizer (:func:`dloom.zoo.tokenizer.build`
with ``words=WORD_TOKENS``): a ``prog`` line's newline and indentation, then every word and
every number 0..999, each alone and after a space.  An answer is then 25 (``tale``) to 50
(``chain``) tokens instead of 76 to 100 characters, and phrasings of different lengths in
characters (``red``/``small``, ``4``/``12``) are one token each."""

_LETTERS = string.ascii_lowercase


# ---------------------------------------------------------------------------- chain
CHAIN_STEPS = (7, 10)
"""Inclusive range of the steps of a ``chain`` prompt."""
CHAIN_VALUES = (10, 99)
"""Inclusive range of every number of a ``chain``: start, operands and each running value.

Two digits, not three: ``long-dllm-ar`` (2.23 M parameters) learnt every other family but got
1 of 280 three-digit steps right after 4,483 steps (session 8), while ``word``'s two-digit
arithmetic rose from 1 to 10 of 40; seven to ten steps keep the answers 62..89 characters."""
_CHAIN_PROMPT = re.compile(r"^chain (\d+)((?:[+-]\d+)+)$")


def _gen_chain(rng: random.Random) -> tuple[str, str]:
    low, high = CHAIN_VALUES
    value = rng.randint(low, high)
    terms, steps = [str(value)], []
    for _ in range(rng.randint(*CHAIN_STEPS)):
        sign = rng.choice("+-")
        if sign == "+" and value > high - low:
            sign = "-"
        if sign == "-" and value < 2 * low:
            sign = "+"
        operand = rng.randint(low, high - value if sign == "+" else value - low)
        result = value + operand if sign == "+" else value - operand
        terms.append(f"{sign}{operand}")
        steps.append(f"{value}{sign}{operand}={result}")
        value = result
    return "chain " + "".join(terms), ";".join(steps)


def _check_chain(prompt: str, answer: str) -> bool:
    match = _CHAIN_PROMPT.match(prompt)
    if match is None:
        return False
    value = int(match.group(1))
    expected = []
    for sign, operand in re.findall(r"([+-])(\d+)", match.group(2)):
        result = value + int(operand) if sign == "+" else value - int(operand)
        expected.append(f"{value}{sign}{operand}={result}")
        value = result
    return answer == ";".join(expected)


# ----------------------------------------------------------------------------- word
_WORD_NAMES = {"ann": "she", "sue": "she", "mia": "she", "eva": "she", "zoe": "she",
               "tom": "he", "bob": "he", "max": "he", "leo": "he", "sam": "he"}
_TALE_NAMES = {**_WORD_NAMES, "ivy": "she", "amy": "she", "kim": "she", "ben": "he", "dan": "he", "jim": "he"}
_WORD_ITEMS = ("pears", "eggs", "coins", "books", "apples", "cards", "shells")
_WORD_GAINS = ("got", "found", "bought")
_WORD_LOSSES = ("ate", "lost", "sold")
_WORD_LINKS = ("so", "now", "giving")
_WORD_STEPS = (2, 3)
_WORD_PROMPT = re.compile(r"^([a-z]+) had (\d+) ([a-z]+), ((?:[a-z]+ \d+, )*[a-z]+ \d+)\. how many\?$")
_WORD_STEP = re.compile(r"^(she|he) ([a-z]+) (\d+), (?:" + "|".join(_WORD_LINKS) + r") (\d+)([+-])(\d+)=(\d+)$")


def _word_end(name: str, count: int, item: str, form: int) -> str:
    return (f"now {name} has {count} {item}", f"{name} has {count} {item} now",
            f"so {name} has {count} {item}")[form]


def _gen_word(rng: random.Random) -> tuple[str, str]:
    """A word problem and a worked solution, redrawn until the prompt fits and so does the
    *longest* solution the checker accepts for it (``giving`` for every step, the longest
    closing form): every right answer, whichever fillers a model picks, fits the region."""
    while True:
        prompt, answer, longest = _draw_word(rng)
        if len(prompt) <= MAX_PROMPT_CHARS and len(longest) <= MAX_ANSWER_CHARS:
            return prompt, answer


def _word_solution(opening: str, steps: list[tuple[str, str]], links: list[str], closing: str) -> str:
    """``<opening>. <head><link> <equation>. ... <closing>.``, a ``(head, equation)`` step each."""
    return ". ".join([opening, *(f"{head}{link} {eq}" for (head, eq), link in zip(steps, links)), closing]) + "."


def _draw_word(rng: random.Random) -> tuple[str, str, str]:
    """A word problem, a solution with random fillers, and its longest right solution."""
    name = rng.choice(sorted(_WORD_NAMES))
    pronoun, item = _WORD_NAMES[name], rng.choice(_WORD_ITEMS)
    count = rng.randint(10, 60)
    opening, events, steps, links = f"{name} had {count} {item}", [], [], []
    for _ in range(rng.randint(*_WORD_STEPS)):
        if count < 12 or rng.random() < 0.5:
            verb, amount = rng.choice(_WORD_GAINS), rng.randint(2, 40)
            result, sign = count + amount, "+"
        else:
            verb, amount = rng.choice(_WORD_LOSSES), rng.randint(2, count - 1)
            result, sign = count - amount, "-"
        events.append(f"{verb} {amount}")
        steps.append((f"{pronoun} {verb} {amount}, ", f"{count}{sign}{amount}={result}"))
        links.append(rng.choice(_WORD_LINKS))
        count = result
    answer = _word_solution(opening, steps, links, _word_end(name, count, item, rng.randrange(3)))
    longest = _word_solution(opening, steps, [max(_WORD_LINKS, key=len)] * len(steps),
                             max((_word_end(name, count, item, form) for form in range(3)), key=len))
    return f"{opening}, {', '.join(events)}. how many?", answer, longest


def _check_word(prompt: str, answer: str) -> bool:
    match = _WORD_PROMPT.match(prompt)
    if match is None or not answer.endswith("."):
        return False
    name, count, item = match.group(1), int(match.group(2)), match.group(3)
    events = [(verb, int(amount)) for verb, amount in (e.split(" ") for e in match.group(4).split(", "))]
    sentences = answer[:-1].split(". ")
    if name not in _WORD_NAMES or len(sentences) != len(events) + 2:
        return False
    if sentences[0] != f"{name} had {count} {item}":
        return False
    for (verb, amount), sentence in zip(events, sentences[1:-1]):
        step = _WORD_STEP.match(sentence)
        if step is None or step.group(1) != _WORD_NAMES[name] or step.group(2) != verb:
            return False
        sign = "+" if verb in _WORD_GAINS else "-" if verb in _WORD_LOSSES else None
        result = count + amount if sign == "+" else count - amount
        if step.group(3, 4, 5, 6, 7) != (str(amount), str(count), sign, str(amount), str(result)):
            return False
        count = result
    return sentences[-1] in {_word_end(name, count, item, form) for form in range(3)}


def _word_answers(prompt: str) -> list[str]:
    """Every right solution of a ``word`` prompt: each step's link and the closing form free
    (``3 ** steps * 3`` solutions, the ones :func:`_draw_word` draws, equally likely)."""
    match = _WORD_PROMPT.match(prompt)
    if match is None:
        raise ValueError(f"not a word prompt: {prompt!r}")
    name, count, item = match.group(1), int(match.group(2)), match.group(3)
    opening, steps = f"{name} had {count} {item}", []
    for verb, amount in (event.split(" ") for event in match.group(4).split(", ")):
        sign = "+" if verb in _WORD_GAINS else "-"
        result = count + int(amount) if sign == "+" else count - int(amount)
        steps.append((f"{_WORD_NAMES[name]} {verb} {amount}, ", f"{count}{sign}{amount}={result}"))
        count = result
    return [_word_solution(opening, steps, list(links), _word_end(name, count, item, form))
            for links in itertools.product(_WORD_LINKS, repeat=len(steps)) for form in range(3)]


# ----------------------------------------------------------------------------- sums
SUMS_STEPS = (5, 7)
"""Inclusive range of the steps of a ``sums`` drill."""
SUMS_MAX_VALUE = 180
"""The largest left operand of a ``sums`` step: a ``word`` count reaches at most 60 + 3 * 40."""
_SUMS_PROMPT = re.compile(r"^sums (\d+[+-]\d+(?:,\d+[+-]\d+)*)$")


def _gen_sums(rng: random.Random) -> tuple[str, str]:
    """Independent steps of ``word``'s arithmetic (a count gains 2..40 or loses 2..count-1).

    A training-only drill: ``chain`` keeps every value in two digits, so the one- and
    three-digit results of ``word`` (``13-8=5``, ``77+29=106``) are trained only by ``word``'s
    two or three steps per example; a drill has five to seven, left operands 2..180.
    """
    while True:
        steps = []
        for _ in range(rng.randint(*SUMS_STEPS)):
            count = rng.randint(2, SUMS_MAX_VALUE)
            if count < 12 or rng.random() < 0.5:
                steps.append((count, "+", rng.randint(2, 40)))
            else:
                steps.append((count, "-", rng.randint(2, count - 1)))
        prompt = "sums " + ",".join(f"{count}{sign}{amount}" for count, sign, amount in steps)
        if len(prompt) <= MAX_PROMPT_CHARS:
            return prompt, ";".join(_sums_step(*step) for step in steps)


def _sums_step(count: int, sign: str, amount: int) -> str:
    return f"{count}{sign}{amount}={count + amount if sign == '+' else count - amount}"


def _check_sums(prompt: str, answer: str) -> bool:
    match = _SUMS_PROMPT.match(prompt)
    if match is None:
        return False
    steps = re.findall(r"(\d+)([+-])(\d+)", match.group(1))
    return answer == ";".join(_sums_step(int(count), sign, int(amount)) for count, sign, amount in steps)


SUMS = TaskFamily("sums", _gen_sums, _check_sums)
"""A training-only source (not in :data:`FAMILIES`, never evaluated): ``word``'s arithmetic
as independent steps, ``sums 13-8,77+29`` -> ``13-8=5;77+29=106``."""


# ----------------------------------------------------------------------------- tale
_TALE_ANIMALS = ("cat", "dog", "fox", "owl", "hen", "cow", "frog", "duck", "goat", "pig", "bee", "bat")
_TALE_PLACES = ("park", "farm", "lake", "wood", "hill", "beach", "field", "garden", "river", "town", "shop", "road")
_TALE_GOES = ("went", "walked", "ran")
_TALE_ADJS = ("big", "small", "red", "shy", "old", "happy")
_TALE_ACTS = ("ran away", "hid in the grass", "looked at {obj}", "sat down", "came closer")
_TALE_ENDS = ("{pro} smiled and went home", "{pro} waved and said goodbye",
              "it was a good day for {obj}", "{pro} told the story at home")
_OBJECT = {"she": "her", "he": "him"}
_TALE_PROMPT = re.compile(r"^tale ([a-z]+) ([a-z]+) ([a-z]+)$")


def _tale_pattern(words: tuple[str, ...]) -> str:
    return "(?:" + "|".join(re.escape(w).replace(r"\{obj\}", "(?P<obj{}>her|him)")
                            .replace(r"\{pro\}", "(?P<pro{}>she|he)") for w in words) + ")"


def _numbered(pattern: str) -> str:
    """Give every ``{}`` group name of ``pattern`` a distinct number (regex group names are unique)."""
    counter = iter(range(1000))
    return re.sub(r"\{\}", lambda _: str(next(counter)), pattern)


TALE_RE = re.compile(_numbered(
    r"^(?P<name>[a-z]+) (?:" + "|".join(_TALE_GOES) + r") to the (?P<place>[a-z]+)\. "
    r"there (?P<pro>she|he) saw a (?:" + "|".join(_TALE_ADJS) + r") (?P<animal>[a-z]+)\. "
    r"the (?P<animal2>[a-z]+) " + _tale_pattern(_TALE_ACTS) + r"\. "
    + _tale_pattern(_TALE_ENDS) + r"\.$"
))
"""The tale grammar: ``NAME GO to the PLACE. there PRO saw a ADJ ANIMAL. the ANIMAL ACT.
END.`` with ``GO``, ``ADJ``, ``ACT`` and ``END`` free (pronouns must match the name)."""


def _gen_tale(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(sorted(_TALE_NAMES))
    animal, place = rng.choice(_TALE_ANIMALS), rng.choice(_TALE_PLACES)
    pro = _TALE_NAMES[name]
    act = rng.choice(_TALE_ACTS).format(obj=_OBJECT[pro])
    end = rng.choice(_TALE_ENDS).format(pro=pro, obj=_OBJECT[pro])
    answer = (f"{name} {rng.choice(_TALE_GOES)} to the {place}. there {pro} saw a "
              f"{rng.choice(_TALE_ADJS)} {animal}. the {animal} {act}. {end}.")
    return f"tale {name} {animal} {place}", answer


def _tale_answers(prompt: str) -> list[str]:
    """Every right tale of a ``tale`` prompt: ``GO``, ``ADJ``, ``ACT`` and ``END`` free (360 tales,
    the ones :func:`_gen_tale` draws, equally likely)."""
    match = _TALE_PROMPT.match(prompt)
    if match is None:
        raise ValueError(f"not a tale prompt: {prompt!r}")
    name, animal, place = match.groups()
    pro = _TALE_NAMES[name]
    obj = _OBJECT[pro]
    return [f"{name} {go} to the {place}. there {pro} saw a {adj} {animal}. the {animal} "
            f"{act.format(obj=obj)}. {end.format(pro=pro, obj=obj)}."
            for go, adj, act, end in itertools.product(_TALE_GOES, _TALE_ADJS, _TALE_ACTS, _TALE_ENDS)]


def _check_tale(prompt: str, answer: str) -> bool:
    prompt_match, match = _TALE_PROMPT.match(prompt), TALE_RE.match(answer)
    if prompt_match is None or match is None:
        return False
    name, animal, place = prompt_match.groups()
    pro = _TALE_NAMES.get(name)
    if pro is None or match.group("name", "animal", "animal2", "place", "pro") != (name, animal, animal, place, pro):
        return False
    found = match.groupdict()
    objects = {v for k, v in found.items() if k.startswith("obj") and v is not None}
    pronouns = {v for k, v in found.items() if k.startswith("pro") and k != "pro" and v is not None}
    return objects <= {_OBJECT[pro]} and pronouns <= {pro}


# ----------------------------------------------------------------------------- prog
_PROG_OPS = {  # operation -> the statement's expression over the running value {t}
    "square": "{t}*{t}",
    "double": "{t}+{t}",
    "triple": "3*{t}",
    "inc": "{t}+1",
    "dec": "{t}-1",
    "half": "{t}//2",
    "neg": "-{t}",
    "addx": "{t}+{x}",
    "suby": "{t}-{y}",
    "mulx": "{t}*{x}",
}
_PROG_FIRST = {"add": "{x}+{y}", "sub": "{x}-{y}", "mul": "{x}*{y}", "max": "max({x},{y})", "min": "min({x},{y})"}
_PROG_NAMES = ("f", "g", "calc", "run", "step", "mix", "go")
_PROG_TEMPS = ("t", "r", "s", "v")
_PROG_OPS_PER_PROMPT = (4, 6)
_PROG_PROMPT = re.compile(r"^prog ([a-z]+)\(([a-z]),([a-z])\): ([a-z]+(?:,[a-z]+)*)$")
_PROG_INPUTS = ((3, 5), (-2, 7), (10, 1), (0, -4), (6, 6), (-9, -3))


def _gen_prog(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(_PROG_NAMES)
    x, y = rng.sample(_LETTERS[:6], 2)
    temp = rng.choice([t for t in _PROG_TEMPS if t not in (x, y)])
    first = rng.choice(sorted(_PROG_FIRST))
    ops = [rng.choice(sorted(_PROG_OPS)) for _ in range(rng.randint(*_PROG_OPS_PER_PROMPT) - 1)]
    lines = [f"def {name}({x},{y}):", f"    {temp}=" + _PROG_FIRST[first].format(x=x, y=y)]
    lines += [f"    {temp}=" + _PROG_OPS[op].format(t=temp, x=x, y=y) for op in ops]
    lines.append(f"    return {temp}")
    return f"prog {name}({x},{y}): {','.join([first, *ops])}", "\n".join(lines)


def _reference(ops: list[str], x: int, y: int) -> int:
    env = {"x": x, "y": y}
    value = _eval(ast.parse(_PROG_FIRST[ops[0]].format(x="x", y="y"), mode="eval").body, env)
    for op in ops[1:]:
        value = _eval(ast.parse(_PROG_OPS[op].format(t="t", x="x", y="y"), mode="eval").body, {**env, "t": value})
    return value


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b, ast.Pow: lambda a, b: a**b}


def _eval(node: ast.AST, env: dict[str, int]) -> int:
    """Integer arithmetic of a whitelisted expression (names, small constants, + - * // **,
    unary minus, ``max``/``min`` of two); anything else raises ``ValueError``."""
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value < 100:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, env)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, env), _eval(node.right, env)
        if isinstance(node.op, ast.Pow) and not 0 <= right <= 4:
            raise ValueError("exponent out of range")
        return _BINARY[type(node.op)](left, right)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min")
            and len(node.args) == 2 and not node.keywords):
        return (max if node.func.id == "max" else min)(*(_eval(a, env) for a in node.args))
    raise ValueError(f"expression not allowed: {ast.dump(node)}")


_PROG_ASSIGN = re.compile(r"^    ([a-z])=(\S+)$")


def _check_prog(prompt: str, answer: str) -> bool:
    match = _PROG_PROMPT.match(prompt)
    if match is None:
        return False
    name, x, y, op_text = match.groups()
    ops = op_text.split(",")
    if x == y or ops[0] not in _PROG_FIRST or any(op not in _PROG_OPS for op in ops[1:]):
        return False
    lines = answer.split("\n")
    if len(lines) < 3 or lines[0] != f"def {name}({x},{y}):":
        return False
    returned = re.fullmatch(r"    return ([a-z])", lines[-1])
    matches = [_PROG_ASSIGN.match(line) for line in lines[1:-1]]
    assignments = [match for match in matches if match is not None]
    if returned is None or len(assignments) < len(matches):
        return False
    for inputs in _PROG_INPUTS:
        env = {x: inputs[0], y: inputs[1]}
        for assignment in assignments:
            target, expression = assignment.groups()
            if target in (x, y):
                return False
            env[target] = _eval(ast.parse(expression, mode="eval").body, env)
        if env.get(returned.group(1)) != _reference(ops, *inputs):
            return False
    return True


def _check_prog_safely(prompt: str, answer: str) -> bool:
    try:
        return _check_prog(prompt, answer)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return False


FAMILIES: dict[str, TaskFamily] = {
    family.name: family
    for family in (
        TaskFamily("chain", _gen_chain, _check_chain),
        TaskFamily("word", _gen_word, _check_word, _word_answers),
        TaskFamily("tale", _gen_tale, _check_tale, _tale_answers),
        TaskFamily("prog", _gen_prog, _check_prog_safely),
    )
}
"""The checkable long-answer families (``tasks.held_out(..., suite=FAMILIES)``)."""
