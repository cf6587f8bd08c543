"""Task generators: deterministic, answers present once at the requested depth, lengths met."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvcomp.eval.haystack import essay_sentences
from vllm_kvcomp.eval.tasks import TASKS, TaskContext, generate, niah, passkey, plan, ruler
from vllm_kvcomp.eval.tasks import multiturn as mt
from vllm_kvcomp.eval.tasks.base import Turn
from vllm_kvcomp.eval.tasks.sizing import TokenCounter, tolerance

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _ctx(counter: TokenCounter, essay_dir: Path, seed: int = 0) -> TaskContext:
    return TaskContext(seed, counter, DEPTHS, lambda: essay_sentences(essay_dir))


def _haystack(prompt: str) -> str:
    """The filler between the instructions and the question (both separated by blank lines)."""
    parts = prompt.split("\n\n")
    assert len(parts) == 3, "prompt should be intro, haystack, question"
    return parts[1]


@pytest.mark.parametrize("task", list(TASKS))
def test_same_seed_same_sample_and_seeds_differ(task: str, bpe_counter, essay_dir: Path) -> None:
    first = generate(_ctx(bpe_counter, essay_dir, seed=3), task, 800, 1)
    again = generate(_ctx(bpe_counter, essay_dir, seed=3), task, 800, 1)
    other = generate(_ctx(bpe_counter, essay_dir, seed=4), task, 800, 1)
    assert first == again
    assert other.turns[0].answers != first.turns[0].answers
    assert other.turns[0].user != first.turns[0].user
    neighbour = generate(_ctx(bpe_counter, essay_dir, seed=3), task, 800, 2)
    assert neighbour.turns[0].answers != first.turns[0].answers


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [700, 1500, 4000])
def test_lengths_met_within_tolerance(task: str, length: int, bpe_counter, essay_dir: Path) -> None:
    sample = generate(_ctx(bpe_counter, essay_dir), task, length, 0)
    assert sample.tokens == bpe_counter.count(sample.turns[0].user)
    assert abs(sample.tokens - length) <= tolerance(length)


@pytest.mark.parametrize("task", [t for t in TASKS if t not in ruler.TASKS])  # RULER's answers repeat by design
def test_every_answer_occurs_exactly_once(task: str, bpe_counter, essay_dir: Path) -> None:
    for index in range(4):
        sample = generate(_ctx(bpe_counter, essay_dir), task, 800, index)
        context = sample.turns[0].user
        answers = [a for t in sample.turns for a in t.answers]
        assert answers, "a sample must have answers"
        for a in answers:
            assert context.count(a) == 1
        for turn in sample.turns[1:]:
            assert not any(a in turn.user for a in answers)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_answer_starts_name_what_is_asked_and_give_nothing_away(task: str, bpe_counter, essay_dir: Path) -> None:
    """RULER's answer prefixes (completions: a base model continues them); none for multiturn."""
    for index in range(3):
        sample = generate(_ctx(bpe_counter, essay_dir), task, 800, index)
        for turn in sample.turns:
            if task == "multiturn":
                assert turn.answer_start is None
                continue
            assert turn.answer_start and not any(a in turn.answer_start for a in turn.answers)
        last = sample.turns[-1]
        if task in ("niah", "multi_niah"):  # it names the keys the question asks for
            keys = [w for w in last.question.split() if "-" in w]
            assert keys and all(k.strip("?,.") in last.answer_start for k in keys)
        if task == "vt":  # the value and the number of names, as the question has them
            value = next(w for w in last.question.split() if w.isdigit() and len(w) == 5)
            assert f"value {value}," in last.answer_start
            assert f" {len(last.answers)} variables" in last.answer_start


@pytest.mark.parametrize("task,needle", [("passkey5", "The pass key is"),
                                         ("passkey64", "The pass key is"),
                                         ("niah", "One of the special magic numbers")])
@pytest.mark.parametrize("index", range(len(DEPTHS)))
def test_needle_sits_at_requested_depth(task: str, needle: str, index: int, essay_dir: Path,
                                        whitespace_counter: TokenCounter) -> None:
    counter = whitespace_counter
    sample = generate(_ctx(counter, essay_dir), task, 2000, index)
    assert sample.depth == DEPTHS[index]
    haystack = _haystack(sample.turns[0].user)
    before, found, rest = haystack.partition(needle)
    assert found, "needle missing"
    after = rest.split(".", 2)[-1] if task.startswith("passkey") else rest.split(".", 1)[1]
    n_before, n_after = counter.count(before), counter.count(after)
    measured = n_before / (n_before + n_after)
    assert abs(measured - sample.depth) <= 0.02, (measured, sample.depth)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_the_first_turn_splits_into_the_document_and_its_question(task: str, bpe_counter, essay_dir: Path) -> None:
    """What ``--scope context`` sends: the document, then the question that ended the prompt."""
    first = generate(_ctx(bpe_counter, essay_dir), task, 1024, 0).turns[0]
    context, question = first.messages(split=True)
    assert question["content"] == first.question and first.question not in context["content"]
    assert context["content"] + "\n\n" + question["content"] == first.user
    assert first.messages(split=False) == [{"role": "user", "content": first.user}]
    with pytest.raises(ValueError, match="question must be the end"):
        Turn("a document. A question?", ("1",), "exact", question="Another?")


def test_passkey_key_lengths_and_scorers(bpe_counter, essay_dir: Path) -> None:
    five = generate(_ctx(bpe_counter, essay_dir), "passkey5", 300, 0).turns[0]
    sixty_four = generate(_ctx(bpe_counter, essay_dir), "passkey64", 300, 0).turns[0]
    assert len(five.answers[0]) == 5 and five.answers[0].isdigit() and five.scorer == "exact"
    key = sixty_four.answers[0]
    assert len(key) == 64 and key.isdigit() and key[0] != "0" and sixty_four.scorer == "prefix"
    assert passkey.NEEDLE.format(key=key) in sixty_four.user
    assert sixty_four.user.endswith(passkey.QUESTION)


def test_multi_needle_asks_for_every_key(bpe_counter, essay_dir: Path) -> None:
    turn = generate(_ctx(bpe_counter, essay_dir), "multi_niah", 1500, 0).turns[0]
    assert len(turn.answers) == niah.MULTI_NEEDLES and turn.scorer == "recall"
    question = turn.user.split("\n\n")[-1]
    for value in turn.answers:
        key = turn.user.split(f" is: {value}.")[0].rsplit("numbers for ", 1)[1]
        assert key in question


def test_multiturn_asks_two_different_people(bpe_counter, essay_dir: Path) -> None:
    sample = generate(_ctx(bpe_counter, essay_dir), "multiturn", 1000, 0)
    first, second = sample.turns
    assert first.user.endswith("Answer with the number only.") and len(sample.turns) == 2
    name1 = first.user.split("What is ")[-1].split("'s")[0]
    name2 = second.user.split("What is ")[-1].split("'s")[0]
    assert name1 != name2 and name1 in mt.NAMES and name2 in mt.NAMES
    assert f"{name1}'s favorite number is {first.answers[0]}." in first.user
    assert f"{name2}'s favorite number is {second.answers[0]}." in first.user


def test_too_short_length_and_missing_haystack_raise(bpe_counter, essay_dir: Path) -> None:
    with pytest.raises(ValueError, match="too short"):
        generate(_ctx(bpe_counter, essay_dir), "passkey64", 20, 0)
    with pytest.raises(ValueError, match="essay haystack"):
        generate(TaskContext(0, bpe_counter), "niah", 500, 0)


def test_plan_orders_items_and_rejects_unknown_tasks() -> None:
    assert plan(["niah", "passkey5"], [100, 200], 2)[:3] == [("niah", 100, 0), ("niah", 100, 1),
                                                            ("niah", 200, 0)]
    assert len(plan(["niah", "passkey5"], [100, 200], 2)) == 8
    with pytest.raises(ValueError, match="unknown task"):
        plan(["passkey7"], [100], 1)
