"""RULER's vt, cwe and fwe: deterministic, lengths met, answers checkable from the prompt alone."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from vllm_kvcomp.eval.scoring import score_sample
from vllm_kvcomp.eval.tasks import TASKS, TaskContext, generate, passkey, ruler
from vllm_kvcomp.eval.tasks.base import Sample
from vllm_kvcomp.eval.tasks.sizing import TokenCounter, tolerance

RULER = sorted(ruler.TASKS)
_STATEMENT = re.compile(r"VAR ([A-Z]+) = (?:VAR ([A-Z]+)|(\d+))")
_ENTRY = re.compile(r"(\d+)\. (\S+)")


def _sample(counter: TokenCounter, task: str, length: int, index: int = 0, seed: int = 0) -> Sample:
    return generate(TaskContext(seed, counter), task, length, index)


def _body(prompt: str) -> str:
    """The generated text between the instructions and the question."""
    parts = prompt.split("\n\n")
    assert len(parts) == 3, "prompt should be intro, body, question"
    return parts[1]


def test_ruler_tasks_are_registered_with_word_scoring(bpe_counter) -> None:
    assert RULER == ["cwe", "fwe", "vt"]
    for task in RULER:
        assert TASKS[task] is ruler.TASKS[task]
        assert _sample(bpe_counter, task, 900).turns[0].scorer == "words"


@pytest.mark.parametrize("task", RULER)
def test_same_item_same_sample_other_items_differ(task: str, bpe_counter) -> None:
    first = _sample(bpe_counter, task, 900, index=1, seed=3)
    assert first == _sample(bpe_counter, task, 900, index=1, seed=3)
    for other in (_sample(bpe_counter, task, 900, index=2, seed=3),
                  _sample(bpe_counter, task, 900, index=1, seed=4),
                  _sample(bpe_counter, task, 901, index=1, seed=3)):
        assert other.turns[0].answers != first.turns[0].answers
        assert other.turns[0].user != first.turns[0].user


@pytest.mark.parametrize("task", RULER)
@pytest.mark.parametrize("length", [700, 1500, 4096, 9000])
def test_lengths_met_within_tolerance(task: str, length: int, bpe_counter) -> None:
    sample = _sample(bpe_counter, task, length)
    assert sample.tokens == bpe_counter.count(sample.turns[0].user)
    assert abs(sample.tokens - length) <= tolerance(length), (sample.tokens, length)
    assert sample.length == length and sample.task == task and len(sample.turns) == 1


@pytest.mark.parametrize("task", RULER)
def test_the_question_ends_the_prompt_and_splits_off(task: str, bpe_counter) -> None:
    turn = _sample(bpe_counter, task, 1200).turns[0]
    assert turn.question and turn.question.startswith("Question: ")
    assert turn.user.endswith("\n\n" + turn.question)
    context, question = turn.messages(split=True)
    assert question == {"role": "user", "content": turn.question}
    assert context["content"] + "\n\n" + turn.question == turn.user
    assert not any(a.lower() in turn.question.lower().split() for a in turn.answers)


@pytest.mark.parametrize("task", RULER)
def test_a_reply_with_the_answers_scores_one(task: str, bpe_counter) -> None:
    sample = _sample(bpe_counter, task, 1000)
    answers = sample.turns[0].answers
    assert score_sample(sample, [", ".join(answers)]).exact
    half = score_sample(sample, [" ".join(answers[: len(answers) // 2])])
    assert half.score == pytest.approx((len(answers) // 2) / len(answers))
    assert score_sample(sample, ["I cannot tell."]).score == 0.0


@pytest.mark.parametrize("task", RULER)
def test_too_short_a_length_raises(task: str, bpe_counter) -> None:
    with pytest.raises(ValueError, match="too short"):
        _sample(bpe_counter, task, 40)


def _assignments(prompt: str) -> dict[str, str]:
    """Variable -> what it is assigned (a value, or ``VAR name``), each assigned once."""
    found = _STATEMENT.findall(prompt)
    names = [name for name, _, _ in found]
    assert len(names) == len(set(names)), "a variable is assigned twice"
    return {name: f"VAR {src}" if src else value for name, src, value in found}


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("length", [800, 4096])
def test_vt_chain_reaches_every_answer_and_nothing_else(index: int, length: int, bpe_counter) -> None:
    turn = _sample(bpe_counter, "vt", length, index).turns[0]
    value = re.search(r"assigned the value (\d+) in the text above", turn.question).group(1)
    names = turn.answers
    assert len(names) == ruler.VT_HOPS + 1 and len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    for name in names:
        assert f"VAR {name} =" in turn.user

    assign = _assignments(_body(turn.user))
    holders: set[str] = set()
    frontier = {v for v, rhs in assign.items() if rhs == value}
    while frontier:  # follow the assignments from the value
        holders |= frontier
        frontier = {v for v, rhs in assign.items() if rhs in {f"VAR {h}" for h in frontier}} - holders
    assert holders == set(names)
    assert set(assign) == set(names), "no other variable may be assigned"
    assert _body(turn.user).count(value) == 1


def test_vt_statements_are_spread_in_chain_order(whitespace_counter) -> None:
    turn = _sample(whitespace_counter, "vt", 3000, 2).turns[0]
    body = _body(turn.user)
    starts = [body.index(f"VAR {n} =") for n in turn.answers]
    assert all(a < b for a, b in itertools.pairwise(starts)), "assigned before it is used"
    assert starts[-1] - starts[0] > len(body) / 3
    noise = re.sub(r"VAR [A-Z]+ = (VAR [A-Z]+|\d+)", "", body).split()
    assert set(noise) <= {w for s in passkey.FILLER for w in s.split()}


@pytest.mark.parametrize("index", range(3))
@pytest.mark.parametrize("length", [120, 700, 2048, 4096, 20000])
def test_cwe_answers_are_strictly_the_most_common_words(index: int, length: int,
                                                       whitespace_counter) -> None:
    turn = _sample(whitespace_counter, "cwe", length, index).turns[0]
    entries = _ENTRY.findall(_body(turn.user))
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert len(turn.answers) == ruler.CWE_COMMON == len(set(turn.answers))
    others = [c for w, c in counts.items() if w not in turn.answers]
    assert len(others) >= ruler.CWE_COMMON
    assert min(counts[a] for a in turn.answers) > max(others)
    assert set(counts) <= set(ruler.WORDS)


def test_cwe_follows_ruler_frequencies_where_the_list_has_room(whitespace_counter) -> None:
    def frequencies(length: int) -> tuple[set[int], set[int]]:
        turn = _sample(whitespace_counter, "cwe", length).turns[0]
        counts = Counter(w for _, w in _ENTRY.findall(_body(turn.user)))
        return ({counts[a] for a in turn.answers},
                {c for w, c in counts.items() if w not in turn.answers})

    common, uncommon = frequencies(1024)
    assert common == {6} and uncommon == {1}
    common, uncommon = frequencies(4096)
    assert common == {30} and max(uncommon) == 3
    common, uncommon = frequencies(200)  # short: fewer repeats, common words still ahead
    assert max(common) < 6 and min(common) > max(uncommon)


def test_cwe_words_are_plain_and_not_in_the_instructions() -> None:
    assert len(ruler.WORDS) >= 300 and len(set(ruler.WORDS)) == len(ruler.WORDS)
    assert all(re.fullmatch(r"[a-z]+", w) for w in ruler.WORDS)
    instructions = (ruler.CWE_INTRO + " " + ruler.CWE_QUESTION).lower()
    assert not set(re.findall(r"[a-z]+", instructions)) & set(ruler.WORDS)


@pytest.mark.parametrize("index", range(3))
@pytest.mark.parametrize("length", [700, 2048, 4096, 12000])
def test_fwe_answers_are_the_three_most_frequent_coded_words(index: int, length: int,
                                                            bpe_counter) -> None:
    turn = _sample(bpe_counter, "fwe", length, index).turns[0]
    words = _body(turn.user).split(" ")
    counts = Counter(w for w in words if w != ruler.FWE_NOISE)
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in counts)
    ranked = [c for _, c in counts.most_common()]
    assert len(turn.answers) == 3 and len(ranked) > 3
    assert sorted(counts[a] for a in turn.answers) == sorted(ranked[:3])
    assert min(counts[a] for a in turn.answers) > ranked[3]
    assert words.count(ruler.FWE_NOISE) > ranked[0], "the noise is the most frequent word"


def test_fwe_counts_follow_zipf() -> None:
    counts = ruler.zipf_counts(1000)
    assert counts[0] == int(1000 / ruler.FWE_ZETA) and counts[1] == int(1000 / (4 * ruler.FWE_ZETA))
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 1
    assert int(1000 / ((len(counts) + 1) ** 2 * ruler.FWE_ZETA)) == 0
    for scale in range(ruler.FWE_MIN_SCALE, 3000):
        c = ruler.zipf_counts(scale)
        assert c[3] > c[4], scale
