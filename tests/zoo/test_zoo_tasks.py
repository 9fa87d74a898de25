"""The zoo's task suite and character tokenizer: generators, checkers, splits, round-trips."""

from __future__ import annotations

import itertools
import random

import pytest

from dloom.zoo import MODEL_NAMES, model_path
from dloom.zoo import tokenizer as zoo_tokenizer
from dloom.zoo.tasks import (
    ALPHABET,
    FAMILIES,
    GEN_LENGTH,
    MAX_ANSWER_CHARS,
    MAX_PROMPT_CHARS,
    MIN_ANSWER_CHARS,
    Example,
    held_out,
    is_held_out,
    lookup_curriculum,
    train_stream,
)

N = 200  # examples per family drawn by the sampling tests


def _examples(family: str, seed: int = 0, n: int = N) -> list[Example]:
    rng = random.Random(seed)
    return [FAMILIES[family].generate(rng) for _ in range(n)]


def test_family_names_are_the_api():
    assert set(FAMILIES) == {"add", "sort", "reverse", "copy", "lookup", "code", "story"}
    assert all(f.name == name for name, f in FAMILIES.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_checker_accepts_generated_answers(family):
    for e in _examples(family):
        assert e.family == family
        assert FAMILIES[family].check(e.prompt, e.answer), e


@pytest.mark.parametrize("family", FAMILIES)
def test_lengths_and_alphabet(family):
    for e in _examples(family):
        assert len(e.prompt) <= MAX_PROMPT_CHARS, e
        assert MIN_ANSWER_CHARS <= len(e.answer) <= MAX_ANSWER_CHARS < GEN_LENGTH, e
        assert set(e.prompt + e.answer) <= set(ALPHABET), e


def _corruptions(answer: str) -> list[str]:
    """Generic wrong answers: truncated, extended, one character changed, empty."""
    wrong = [answer[:-1], answer[1:], answer + answer[-1], "", answer + " "]
    for i in (0, len(answer) // 2, len(answer) - 1):
        c = answer[i]
        swap = str((int(c) + 1) % 10) if c.isdigit() else ("a" if c != "a" else "b")
        wrong.append(answer[:i] + swap + answer[i + 1 :])
    return [w for w in wrong if w != answer]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "story"])
def test_checker_rejects_corrupted_answers(family):
    for e in _examples(family, n=40):
        for wrong in _corruptions(e.answer):
            assert not FAMILIES[family].check(e.prompt, wrong), (e, wrong)


def test_add_rejects_off_by_one_sum():
    check = FAMILIES["add"].check
    assert check("add 123 45", "123+45=168")
    for wrong in ("123+45=169", "123+45=167", "123+45=68", "123+46=169", "123+45=1680", "45+123=168"):
        assert not check("add 123 45", wrong), wrong


def test_lookup_and_code_examples():
    assert FAMILIES["lookup"].check("k3 b7 x1 d9 m4 ?xbd", "x1,b7,d9")
    assert not FAMILIES["lookup"].check("k3 b7 x1 d9 m4 ?xbd", "b7,x1,d9")  # query order
    assert not FAMILIES["lookup"].check("k3 b7 x1 d9 m4 ?xbd", "x3,b7,d9")  # a neighbour's value
    assert not FAMILIES["lookup"].check("k3 b7 x1 d9 m4 ?xbd", "x1,b7")  # a key left out
    assert not FAMILIES["lookup"].check("k=3 b=7 x=1 ?xb", "x1,b7")  # not a lookup prompt
    assert FAMILIES["code"].check("def sq(x): square", "return x*x")
    assert FAMILIES["code"].check("def f(a,b): max", "return max(a,b)")
    assert not FAMILIES["code"].check("def f(a,b): max", "return max(b,a)")
    assert not FAMILIES["code"].check("def f(a,b): max", "return min(a,b)")
    assert not FAMILIES["code"].check("def f(a): frob", "return a")  # unknown spec


def test_story_accepts_every_grammatical_continuation():
    check = FAMILIES["story"].check
    prompt = "story tom big cat"
    for verb, ending in itertools.product(("saw", "fed", "met", "hugged", "chased"), ("", " again", " today")):
        assert check(prompt, f"tom {verb} the big cat{ending}.")
    answers: dict[str, set[str]] = {}
    for e in _examples("story", n=2000):
        answers.setdefault(e.prompt, set()).add(e.answer)
    assert max(len(a) for a in answers.values()) > 1  # several continuations of one prompt


@pytest.mark.parametrize(
    "wrong",
    [
        "tom saw the big cat",  # no full stop
        "tom saw the big dog.",  # animal not from the prompt
        "ann saw the big cat.",  # name not from the prompt
        "tom saw the old cat.",  # adjective not from the prompt
        "tom ate the big cat.",  # verb outside the grammar
        "tom saw big cat.",  # missing article
        "tom saw the big cat again today.",  # two endings
        "tom saw the big cat yesterday.",  # ending outside the grammar
        "tom saw the big cat. ",  # trailing garbage
        "tom saw the big",  # truncated
    ],
)
def test_story_rejects_ungrammatical_or_inconsistent(wrong):
    assert not FAMILIES["story"].check("story tom big cat", wrong)


def test_checkers_reject_malformed_prompts_without_raising():
    for family in FAMILIES.values():
        assert family.check("", "") is False
        assert family.check("garbage", "whatever it is") is False


@pytest.mark.parametrize("family", FAMILIES)
def test_generators_are_deterministic_by_seed(family):
    assert _examples(family, seed=3, n=50) == _examples(family, seed=3, n=50)
    assert _examples(family, seed=3, n=50) != _examples(family, seed=4, n=50)


def test_train_stream_and_held_out_are_deterministic():
    assert list(itertools.islice(train_stream(7), 100)) == list(itertools.islice(train_stream(7), 100))
    assert list(itertools.islice(train_stream(7), 100)) != list(itertools.islice(train_stream(8), 100))
    assert held_out(70, seed=2) == held_out(70, seed=2)
    assert held_out(70, seed=2) != held_out(70, seed=3)


def test_held_out_is_balanced_and_distinct():
    examples = held_out(140)
    counts = {f: sum(e.family == f for e in examples) for f in FAMILIES}
    assert set(counts.values()) == {20}
    assert len({(e.family, e.prompt) for e in examples}) == len(examples)
    assert {e.family for e in held_out(10, families=["add", "copy"])} == {"add", "copy"}
    with pytest.raises(ValueError, match="unknown task families"):
        held_out(3, families=["nope"])


def test_train_and_held_out_are_disjoint():
    evaluation = held_out(350)
    assert all(is_held_out(e.family, e.prompt) for e in evaluation)
    train = list(itertools.islice(train_stream(0), 3000))
    assert not any(is_held_out(e.family, e.prompt) for e in train)
    assert not {(e.family, e.prompt) for e in evaluation} & {(e.family, e.prompt) for e in train}
    # the split keeps roughly one prompt in ten
    everything = [e for f in FAMILIES for e in _examples(f, n=400)]
    share = sum(is_held_out(e.family, e.prompt) for e in everything) / len(everything)
    assert 0.06 < share < 0.14


def test_train_stream_weights_and_families():
    drawn = list(itertools.islice(train_stream(0, families=["add", "sort"], weights=[3, 1]), 2000))
    adds = sum(e.family == "add" for e in drawn)
    assert {e.family for e in drawn} == {"add", "sort"}
    assert 0.65 < adds / len(drawn) < 0.85


@pytest.mark.parametrize("pairs", [3, 4])
def test_lookup_curriculum_has_fewer_pairs_and_the_same_checker(pairs):
    drawn = list(itertools.islice(train_stream(0, families=[lookup_curriculum(pairs)]), 200))
    assert {e.family for e in drawn} == {"lookup"}
    assert {e.prompt.count(" ") for e in drawn} == {pairs}
    assert all(FAMILIES["lookup"].check(e.prompt, e.answer) for e in drawn)
    assert not any(is_held_out(e.family, e.prompt) for e in drawn)


@pytest.mark.parametrize("pairs", [2, 5])
def test_lookup_curriculum_refuses_pair_counts_outside_the_range(pairs):
    with pytest.raises(ValueError, match=f"got {pairs}"):
        lookup_curriculum(pairs)


def test_train_stream_refuses_unknown_family():
    with pytest.raises(ValueError, match="unknown task families.*known"):
        next(train_stream(0, families=["ad"]))


def test_training_mix_option_names_bad_families_and_weights():
    import argparse

    from dloom_training.train import _family_weights

    assert _family_weights("lookup=4,lookup3=1.5") == {"lookup": 4.0, "lookup3": 1.5}
    for bad, message in [("lokup=1", "unknown task family 'lokup'"), ("sort=x", "must be a number"),
                         ("sort=-1", "must be >= 0")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            _family_weights(bad)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    zoo_tokenizer.save(directory)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def test_tokenizer_special_tokens(hf_tokenizer):
    assert (hf_tokenizer.pad_token, hf_tokenizer.pad_token_id) == ("<pad>", 0)
    assert (hf_tokenizer.mask_token, hf_tokenizer.mask_token_id) == ("<mask>", zoo_tokenizer.MASK_ID)
    assert (hf_tokenizer.eos_token, hf_tokenizer.eos_token_id) == ("<eos>", zoo_tokenizer.EOS_ID)
    assert hf_tokenizer.padding_side == "left"
    assert len(hf_tokenizer) == len(ALPHABET) + 3
    batch = hf_tokenizer(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0] == [0, 0, 1, 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trip(hf_tokenizer, family):
    vocab = zoo_tokenizer.vocab()
    for e in _examples(family, n=100):
        for text in (e.prompt, e.answer):
            ids = hf_tokenizer.encode(text)
            assert ids == [vocab[c] for c in text]  # one token per character, no BOS/EOS
            assert hf_tokenizer.decode(ids) == text


def test_tokenizer_round_trip_whitespace_and_every_character(hf_tokenizer):
    for text in (ALPHABET, "  a  b ", " ", "x = 1 , y"):
        assert hf_tokenizer.decode(hf_tokenizer.encode(text)) == text
    ids = hf_tokenizer.encode("ab") + [zoo_tokenizer.EOS_ID] * 3
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_model_path_names():
    assert {model_path(name).name for name in MODEL_NAMES} == set(MODEL_NAMES)
    with pytest.raises(ValueError, match="toy-dllm, toy-ar, toy-ar-small"):
        model_path("toy-gpt")
