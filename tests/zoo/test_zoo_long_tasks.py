"""The long-answer suite (``dloom.zoo.long_tasks``), its text corpus and its wide tokenizer."""

from __future__ import annotations

import hashlib
import itertools
import random
import re
import statistics

import pytest

from dloom.zoo import corpus
from dloom.zoo import tokenizer as zoo_tokenizer
from dloom.zoo.long_tasks import (
    ALPHABET,
    FAMILIES,
    GEN_LENGTH,
    MAX_ANSWER_CHARS,
    MAX_PROMPT_CHARS,
    MIN_ANSWER_CHARS,
    SUMS,
    SUMS_MAX_VALUE,
    SUMS_STEPS,
    WORD_TOKENS,
    WORDS,
)
from dloom.zoo.tasks import ALPHABET as SHORT_ALPHABET
from dloom.zoo.tasks import FAMILIES as SHORT_FAMILIES
from dloom.zoo.tasks import Example, held_out, is_held_out, train_stream

N = 300


def _examples(family: str, seed: int = 0, n: int = N) -> list[Example]:
    rng = random.Random(seed)
    return [FAMILIES[family].generate(rng) for _ in range(n)]


def test_family_names_are_the_api_and_distinct_from_the_short_suite():
    assert list(FAMILIES) == ["chain", "word", "tale", "prog"]
    assert not set(FAMILIES) & set(SHORT_FAMILIES)
    assert all(f.name == name for name, f in FAMILIES.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_checker_accepts_generated_answers_and_lengths_fit(family):
    for e in _examples(family):
        assert FAMILIES[family].check(e.prompt, e.answer), e
        assert len(e.prompt) <= MAX_PROMPT_CHARS, e
        assert MIN_ANSWER_CHARS <= len(e.answer) <= MAX_ANSWER_CHARS < GEN_LENGTH, e
        assert set(e.prompt + e.answer) <= set(ALPHABET), e


def test_answers_fill_the_region_padding_at_most_35_percent():
    # The bar: on the held-out prompts a benchmark decodes, <eos> padding is at most
    # 35 % of the 128-position region on average (measured: about 31 %).
    examples = held_out(500, suite=FAMILIES)
    padding = statistics.mean(1 - len(e.answer) / GEN_LENGTH for e in examples)
    assert padding <= 0.35
    per_family = {f: statistics.mean(len(e.answer) for e in examples if e.family == f) for f in FAMILIES}
    assert all(len_ >= 70 for len_ in per_family.values()), per_family  # every family long, not only some


def _corruptions(answer: str) -> list[str]:
    """One digit or letter changed at the start, middle and end; truncated; extended; empty."""
    wrong = [answer[:-1], answer[: len(answer) // 2], answer + "1", "", answer + " "]
    for i in (0, len(answer) // 2, len(answer) - 2):
        c = answer[i]
        swap = str((int(c) + 1) % 10) if c.isdigit() else "q" if c.isalpha() else "#"
        wrong.append(answer[:i] + swap + answer[i + 1 :])
    return [w for w in wrong if w != answer]


@pytest.mark.parametrize("family", FAMILIES)
def test_checker_rejects_corrupted_answers(family):
    for e in _examples(family, n=60):
        for wrong in _corruptions(e.answer):
            assert not FAMILIES[family].check(e.prompt, wrong), (e, wrong)


def test_chain_examples():
    check = FAMILIES["chain"].check
    prompt = "chain 61-37+24-18"
    assert check(prompt, "61-37=24;24+24=48;48-18=30")
    for wrong in ("61-37=24;24+24=48;48-18=31",  # last step off by one
                  "61-37=24;24+24=48",  # a step left out
                  "61-37=24;24+24=48;48-18=30;",  # trailing separator
                  "61-37=24;25+24=49;49-18=31"):  # a result not carried over
        assert not check(prompt, wrong), wrong


def test_chain_numbers_have_two_digits():
    for e in _examples("chain", seed=3, n=500):
        assert all(10 <= int(n) <= 99 for n in re.findall(r"\d+", e.prompt + " " + e.answer)), e


def test_word_accepts_every_connective_and_closing_and_checks_each_step():
    check = FAMILIES["word"].check
    prompt = "ann had 15 pears, got 12, ate 3. how many?"
    for first, second in itertools.product(("so", "now", "giving"), repeat=2):
        for end in ("now ann has 24 pears", "ann has 24 pears now", "so ann has 24 pears"):
            assert check(prompt, f"ann had 15 pears. she got 12, {first} 15+12=27. she ate 3, {second} 27-3=24. {end}.")
    good = "ann had 15 pears. she got 12, so 15+12=27. she ate 3, so 27-3=24. now ann has 24 pears."
    for wrong in (good.replace("27-3=24", "27-3=25"),  # arithmetic
                  good.replace("has 24", "has 25"),  # final count
                  good.replace("she got", "he got"),  # pronoun of the name
                  good.replace("she ate 3", "she lost 3"),  # another verb than the prompt's
                  good.replace("so 15+12", "thus 15+12"),  # connective outside the grammar
                  good.replace(" now ann has 24 pears.", "")):  # no closing sentence
        assert not check(prompt, wrong), wrong


def test_every_right_word_solution_fits_the_region():
    # A model that picks any connective and closing the grammar allows must fit the region:
    # before this held, 18 of 125 held-out prompts had right solutions of 128+ characters.
    check, links = FAMILIES["word"].check, r"(so|now|giving)"
    for e in _examples("word", seed=5, n=120):
        head, closing = e.answer[:-1].rsplit(". ", 1)
        name, count, item = re.search(r"(\w+) has (\d+) (\w+)", closing).groups()
        closings = (f"now {name} has {count} {item}", f"{name} has {count} {item} now",
                    f"so {name} has {count} {item}")
        parts = re.split(f", {links} ", head)
        for fill in itertools.product(("so", "now", "giving"), repeat=(len(parts) - 1) // 2):
            body = parts[0] + "".join(f", {w} {rest}" for w, rest in zip(fill, parts[2::2]))
            for end in closings:
                answer = f"{body}. {end}."
                assert check(e.prompt, answer) and len(answer) <= MAX_ANSWER_CHARS, (e.prompt, answer)


def test_tale_accepts_every_grammatical_story_and_rejects_inconsistent_ones():
    check = FAMILIES["tale"].check
    prompt = "tale tom fox park"
    acts = ("ran away", "hid in the grass", "looked at him", "sat down", "came closer")
    ends = ("he smiled and went home", "he waved and said goodbye", "it was a good day for him",
            "he told the story at home")
    for go, adj, act, end in itertools.product(("went", "walked", "ran"), ("big", "red"), acts, ends):
        assert check(prompt, f"tom {go} to the park. there he saw a {adj} fox. the fox {act}. {end}.")
    good = "tom went to the park. there he saw a red fox. the fox looked at him. he smiled and went home."
    for wrong in (good.replace("there he", "there she"), good.replace("at him", "at her"),
                  good.replace("he smiled", "she smiled"), good.replace("red fox", "red cat"),
                  good.replace("the park", "the farm"), good.replace("the fox looked", "the cat looked"),
                  good.replace("red", "green"), good[:-1], good.replace("tom went", "bob went")):
        assert not check(prompt, wrong), wrong


def test_prog_accepts_equivalent_programs_and_rejects_wrong_or_unsafe_ones():
    check = FAMILIES["prog"].check
    prompt = "prog calc(a,b): add,square,dec,mulx"
    reference = "def calc(a,b):\n    t=a+b\n    t=t*t\n    t=t-1\n    t=t*a\n    return t"
    assert check(prompt, reference)
    for equivalent in (reference.replace("t=a+b", "t=b+a"), reference.replace("t=t*t", "t=t**2"),
                       "def calc(a,b):\n    r=a+b\n    r=r*r\n    r=r-1\n    r=r*a\n    return r",
                       "def calc(a,b):\n    s=(a+b)**2\n    s=(s-1)*a\n    return s"):
        assert check(prompt, equivalent), equivalent
    for wrong in (reference.replace("t=t-1", "t=t+1"),  # another operation
                  reference.replace("t=t*a", "t=t*b"),  # the other argument
                  reference.replace("def calc", "def f"),  # another name
                  reference.replace("    return t", "    return a"),
                  reference.replace("t=a+b", "a=a+b"),  # overwrites an argument
                  reference.replace("t=t*t", "t=__import__('os').getpid()"),  # not arithmetic
                  reference.replace("t=t*t", "t=t**99"),  # exponent out of range
                  reference.replace("t=t-1", "t=t//0"),  # raises
                  reference.replace("\n    t=t-1", "\nt=t-1")):  # indentation
        assert not check(prompt, wrong), wrong


def _first_difference(x: str, y: str) -> float:
    """Where two answers first differ, as a share of the shorter one's length."""
    return next(i for i, (a, b) in enumerate(zip(x, y)) if a != b) / min(len(x), len(y))


def _alternatives(e: Example) -> list[str]:
    """Other right answers to ``e.prompt``, each differing from ``e.answer`` in one free slot."""
    if e.family == "word":  # the first step's connective
        link = re.search(r", (so|now|giving) ", e.answer).group(1)
        return [e.answer.replace(f", {link} ", f", {other} ", 1) for other in ("so", "now", "giving") if other != link]
    if e.family == "prog":  # the temporary variable's name
        head, body = e.answer.split("\n", 1)
        temp = re.match(r"    ([a-z])=", body).group(1)
        args = set(re.search(r"\((.),(.)\)", head).groups())
        return [f"{head}\n" + re.sub(rf"\b{temp}\b", other, body) for other in "tuvw" if other not in {temp, *args}]
    raise AssertionError(e.family)


@pytest.mark.parametrize("family", ["word", "prog"])
def test_right_answers_differ_inside_the_answer_not_only_at_its_end(family):
    # A free slot early in the answer: a decoder meets real uncertainty in its middle.
    firsts = []
    for e in _examples(family, n=100):
        for other in _alternatives(e):
            assert FAMILIES[family].check(e.prompt, other), other
            firsts.append(_first_difference(e.answer, other))
    assert statistics.median(firsts) < 0.5, family


def test_tale_prompts_have_many_right_stories_differing_early():
    by_prompt: dict[str, set[str]] = {}
    for e in _examples("tale", n=20_000):
        by_prompt.setdefault(e.prompt, set()).add(e.answer)
    assert statistics.median(len(answers) for answers in by_prompt.values()) >= 5  # ~8.7 draws a prompt
    firsts = [_first_difference(x, y) for answers in by_prompt.values()
              for x, y in itertools.combinations(sorted(answers), 2)]
    assert statistics.median(firsts) < 0.6


def test_checkers_reject_malformed_prompts_without_raising():
    for family in FAMILIES.values():
        assert family.check("", "") is False
        assert family.check("garbage", "whatever it is") is False
        assert family.check("chain 1+2", "def f(a,b):\n    return a") is False


@pytest.mark.parametrize("family", FAMILIES)
def test_generators_are_deterministic_by_seed(family):
    assert _examples(family, seed=3, n=50) == _examples(family, seed=3, n=50)
    assert _examples(family, seed=3, n=50) != _examples(family, seed=4, n=50)


def test_train_and_held_out_splits_are_disjoint():
    train = list(itertools.islice(train_stream(0, suite=FAMILIES), 4_000))
    held = held_out(400, suite=FAMILIES)
    assert {e.family for e in train} == set(FAMILIES) == {e.family for e in held}
    assert not any(is_held_out(e.family, e.prompt) for e in train)
    assert all(is_held_out(e.family, e.prompt) for e in held)
    assert not {(e.family, e.prompt) for e in train} & {(e.family, e.prompt) for e in held}
    assert len({(e.family, e.prompt) for e in held}) == len(held)  # distinct prompts


def test_train_stream_can_mix_in_the_training_only_sources():
    stream = train_stream(0, families=["chain", corpus.TEXT, SUMS], weights=[1, 1, 1], suite=FAMILIES)
    families = {e.family for e in itertools.islice(stream, 100)}
    assert families == {"chain", "text", "sums"}
    with pytest.raises(ValueError, match="unknown task families"):
        next(train_stream(0, families=["add"], suite=FAMILIES))


def test_sums_drills_words_arithmetic_including_one_and_three_digit_results():
    rng = random.Random(0)
    examples = [SUMS.generate(rng) for _ in range(N)]
    results = []
    for e in examples:
        assert SUMS.check(e.prompt, e.answer), e
        assert len(e.prompt) <= MAX_PROMPT_CHARS and len(e.answer) <= MAX_ANSWER_CHARS, e
        steps = e.answer.split(";")
        assert SUMS_STEPS[0] <= len(steps) <= SUMS_STEPS[1], e
        for step in steps:
            count, sign, amount, result = re.fullmatch(r"(\d+)([+-])(\d+)=(\d+)", step).groups()
            assert 2 <= int(count) <= SUMS_MAX_VALUE and 2 <= int(amount), step
            assert int(amount) <= (40 if sign == "+" else int(count) - 1), step
            results.append(int(result))
    assert {len(str(r)) for r in results} == {1, 2, 3}  # what chain's two-digit values never train
    assert "sums" not in FAMILIES  # training-only: never evaluated


def test_sums_checker_rejects_each_wrong_result_and_a_foreign_prompt():
    prompt, answer = "sums 13-8,77+29", "13-8=5;77+29=106"
    assert SUMS.check(prompt, answer)
    for wrong in ("13-8=6;77+29=106", "13-8=5;77+29=96", "13-8=5", "13-8=5;77+29=106;", "77+29=106;13-8=5"):
        assert not SUMS.check(prompt, wrong), wrong
    assert not SUMS.check("chain 13-8+29", "13-8=5;5+29=34")


# --------------------------------------------------------------------------- corpus
def test_corpus_is_the_documented_extract():
    raw = corpus.CORPUS_PATH.read_bytes()
    assert 900_000 < len(raw) < 1_200_000
    provenance = (corpus.CORPUS_PATH.parent / "PROVENANCE.md").read_text()
    assert hashlib.sha256(raw).hexdigest() in provenance  # the file the provenance describes
    assert set(corpus.text()) <= set(ALPHABET)
    assert {"'", "\n", "A"} <= set(corpus.text())  # what the wide alphabet was widened for


def test_text_examples_continue_the_corpus():
    rng = random.Random(0)
    examples = [corpus.TEXT.generate(rng) for _ in range(300)]
    for e in examples:
        assert corpus.MIN_PROMPT_CHARS <= len(e.prompt) <= MAX_PROMPT_CHARS
        assert corpus.MIN_TEXT_ANSWER_CHARS <= len(e.answer) <= MAX_ANSWER_CHARS
        assert e.prompt[-1].isspace() and not e.answer[0].isspace()
        assert corpus.TEXT.check(e.prompt, e.answer)
        assert not corpus.TEXT.check(e.prompt, e.answer[:-1] + "#")
    assert statistics.mean(len(e.answer) for e in examples) > 110  # almost no padding


# ------------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def wide_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("wide")
    zoo_tokenizer.save(directory, ALPHABET, 256)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def test_wide_alphabet_extends_the_short_one_with_the_same_ids():
    assert ALPHABET.startswith(SHORT_ALPHABET) and len(set(ALPHABET)) == len(ALPHABET) == 96
    short, wide = zoo_tokenizer.vocab(), zoo_tokenizer.vocab(ALPHABET)
    assert all(wide[c] == i for c, i in short.items())
    assert len(wide) == 99


def test_wide_tokenizer_round_trips_text_and_every_family(wide_tokenizer):
    vocab = zoo_tokenizer.vocab(ALPHABET)
    rng = random.Random(1)
    texts = [ALPHABET, "O, that this too too solid flesh would melt,\nThaw and resolve itself.\n\n"]
    texts += [e.answer for family in FAMILIES for e in _examples(family, n=30)]
    texts += [corpus.TEXT.generate(rng).answer for _ in range(30)]
    for text in texts:
        ids = wide_tokenizer.encode(text)
        assert ids == [vocab[c] for c in text]  # one token per character, newlines included
        assert wide_tokenizer.decode(ids) == text
    assert wide_tokenizer.model_max_length == 256 and len(wide_tokenizer) == 99


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("words")
    zoo_tokenizer.save(directory, ALPHABET, 128, WORD_TOKENS)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


_WORD_PIECES = re.compile(r"\n    | ?[a-z]+| ?\d+|[\s\S]")
"""How the word tokenizer should split the suite's text: a word or number with its space."""


def test_word_tokenizer_takes_every_word_and_number_of_the_suite_whole(word_tokenizer):
    vocab = zoo_tokenizer.vocab(ALPHABET, WORD_TOKENS)
    assert len(word_tokenizer) == len(vocab) == 3 + 96 + len(WORD_TOKENS)
    assert [vocab[c] for c in ALPHABET] == list(range(3, 99))  # the characters keep the wide ids
    rng = random.Random(7)  # not the draws WORDS was collected from
    examples = [family.generate(rng) for family in (*FAMILIES.values(), SUMS) for _ in range(400)]
    for text in (text for e in examples for text in (e.prompt, e.answer)):
        ids = word_tokenizer.encode(text)
        assert ids == [vocab[piece] for piece in _WORD_PIECES.findall(text)], text  # no word of the suite split
        assert word_tokenizer.decode(ids) == text
    tale = FAMILIES["tale"].generate(random.Random(0)).answer
    assert len(word_tokenizer.encode(tale)) < len(tale) / 3


def test_word_tokenizer_still_encodes_text_outside_the_suite_one_character_a_word():
    tokenizer = zoo_tokenizer.build(ALPHABET, WORD_TOKENS)
    text = "sheep 1234 she said Hello!\n  x\n    v=305;"
    encoding = tokenizer.encode(text)
    assert encoding.tokens == ["s", "h", "e", "e", "p", " ", "1", "234", " she", " said", " ", "H", "e", "l", "l",
                               "o", "!", "\n", " ", " ", "x", "\n    ", "v", "=", "305", ";"]
    assert tokenizer.decode(encoding.ids) == text
    assert set(WORDS) >= {"goodbye", "return", "giving"} and len(set(WORD_TOKENS)) == len(WORD_TOKENS)
    with pytest.raises(ValueError, match="two characters or more"):
        zoo_tokenizer.vocab(ALPHABET, ("ab", "c"))


def test_the_word_checkpoints_hold_the_word_tokenizer_the_trainer_saves(tmp_path):
    from dloom.zoo import CHECKOUT_DIR

    zoo_tokenizer.save(tmp_path, ALPHABET, 128, WORD_TOKENS)
    for name in ("long-dllm-words-ar", "long-dllm-words"):
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (tmp_path / file).read_bytes() == (CHECKOUT_DIR / name / file).read_bytes(), (name, file)


def test_short_tokenizer_files_are_unchanged(tmp_path):
    from dloom.zoo import model_path

    zoo_tokenizer.save(tmp_path)
    for name in ("toy-dllm", "toy-ar", "toy-ar-small"):
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (tmp_path / file).read_bytes() == (model_path(name) / file).read_bytes(), (name, file)


def test_evaluation_selects_the_long_suite_by_name_or_family():
    from dloom.errors import ConfigurationError
    from dloom.evaluation import select_examples

    assert select_examples("long", 8) == held_out(8, suite=FAMILIES)
    assert {e.family for e in select_examples("chain,prog", 6, split="train")} == {"chain", "prog"}
    assert not any(is_held_out(e.family, e.prompt) for e in select_examples("long", 20, split="train"))
    assert select_examples("all", 7) == held_out(7)  # the toy suite, as before
    with pytest.raises(ConfigurationError, match="mix the toy and the long-answer suites"):
        select_examples("add,chain", 4)
    with pytest.raises(ConfigurationError, match="unknown task family 'poem'; known: all, long, add, .*chain"):
        select_examples("poem", 4)
