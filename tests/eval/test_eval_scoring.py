"""Scoring: exact keys, partial 64-digit keys (prefix / digit accuracy), recall, words, multi-turn."""

from __future__ import annotations

import pytest

from vllm_kvcomp.eval.scoring import (
    common_prefix,
    digit_accuracy,
    digit_runs,
    score_key,
    score_recall,
    score_sample,
    score_turn,
    score_words,
)
from vllm_kvcomp.eval.tasks.base import Sample, Turn

KEY64 = "3141592653589793238462643383279502884197169399375105820974944592"


def test_digit_runs_join_single_separators() -> None:
    assert digit_runs("Key: 123 456,789. Also 42.\n7") == ["123456789", "42", "7"]
    assert digit_runs("no digits") == []


def test_exact_match_needs_the_whole_key() -> None:
    assert score_key("The pass key is 57313.", "57313", partial=False).score == 1.0
    assert score_key("It is 57 313, I think", "57313", partial=False).exact
    assert score_key("573130", "57313", partial=False).score == 0.0
    assert score_key("5731", "57313", partial=False).score == 0.0
    assert not score_key("", "57313", partial=False).exact


def test_prefix_score_for_64_digits() -> None:
    full = score_key(f"The pass key is {KEY64}.", KEY64, partial=True)
    assert full.score == 1.0 and full.exact and full.details["digit_acc"] == 1.0

    wrong_at_48 = KEY64[:48] + ("1" if KEY64[48] != "1" else "2") + KEY64[49:]
    s = score_key(wrong_at_48, KEY64, partial=True)
    assert s.score == pytest.approx(48 / 64) and not s.exact
    assert s.details["digit_acc"] == pytest.approx(63 / 64)

    dropped = KEY64[:10] + KEY64[11:]  # one digit lost: later positions shift
    s = score_key(f"1. {dropped}", KEY64, partial=True)
    assert s.score == pytest.approx(common_prefix(dropped, KEY64) / 64)
    assert s.details["digit_acc"] == pytest.approx(digit_accuracy(dropped, KEY64))
    assert s.details["digit_acc"] < 0.5

    first_wrong = ("9" if KEY64[0] != "9" else "8") + KEY64[1:]
    assert score_key(first_wrong, KEY64, partial=True).score == 0.0
    assert score_key("sorry", KEY64, partial=True).score == 0.0
    assert score_key(KEY64 + "7", KEY64, partial=True).score == 1.0  # prefix complete, not exact


def test_recall_counts_whole_numbers_only() -> None:
    answers = ("1234567", "7654321", "1111111", "2222222")
    s = score_recall("a: 1234567; b: 7654321; c: 11111112", answers)
    assert s.score == 0.5 and not s.exact
    assert score_recall(" ".join(answers), answers).exact


def test_words_recall_counts_whole_words_in_any_case() -> None:
    answers = ("apple", "tiger", "QZEOA", "violin")
    assert score_words("apple, tiger, QZEOA and violin", answers).score == 1.0
    assert score_words("apple, tiger, QZEOA and violin", answers).exact
    half = score_words("1. apple 2. tiger 3. pear", answers)
    assert half.score == 0.5 and not half.exact
    assert score_words("Apple TIGER qzeoa Violin.", answers).exact
    embedded = score_words("pineapples, tigers, XQZEOA, violinist", answers)
    assert embedded.score == 0.0
    assert score_words("apple_tiger", answers).score == 0.0
    assert score_words("'apple' (tiger) QZEOA; violin", answers).exact
    assert score_words("", answers).score == 0.0


def test_words_turns_are_scored_as_words_and_number_turns_as_numbers() -> None:
    assert score_turn(Turn("q", ("cat", "dog"), "words"), "The CAT.").score == 0.5
    assert score_turn(Turn("q", ("cat", "dog"), "words"), "category, dogma").score == 0.0
    assert score_turn(Turn("q", ("1234567",), "recall"), "12345678").score == 0.0


def _sample(turns: tuple[Turn, ...]) -> Sample:
    return Sample("t", 0, 0, 100, 100, turns, 16)


def test_sample_score_averages_turns_and_reports_each() -> None:
    sample = _sample((Turn("q1", ("11111",), "exact"), Turn("q2", ("22222",), "exact")))
    s = score_sample(sample, ["11111", "no idea"])
    assert s.score == 0.5 and not s.exact and s.details == {"turn1": 1.0, "turn2": 0.0}
    assert score_sample(sample, ["11111", "It is 22222."]).exact
    with pytest.raises(ValueError, match="replies"):
        score_sample(sample, ["only one"])


def test_single_turn_prefix_sample_keeps_digit_accuracy() -> None:
    s = score_sample(_sample((Turn("q", (KEY64,), "prefix"),)), [KEY64[:32]])
    assert s.score == 0.5 and s.details == {"digit_acc": 0.5}
