"""Token counters, sentence pools, needle placement and prompt fitting."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from vllm_kvcomp.eval.tasks.sizing import (
    CharEstimateCounter,
    Needle,
    SentencePool,
    TokenCounter,
    TokenizersCounter,
    assemble,
    fit_prompt,
    load_counter,
    tolerance,
)

SENTENCES = ["one two three.", "four five.", "six seven eight nine.", "ten."]


def test_pool_takes_in_order_wraps_and_cuts_last_sentence(whitespace_counter: TokenCounter) -> None:
    pool = SentencePool(SENTENCES, whitespace_counter)
    assert pool.take(0, 5) == [("one two three.", 3), ("four five.", 2)]
    assert pool.take(3, 6) == [("ten.", 1), ("one two three.", 3), ("four five.", 2)]
    assert pool.take(2, 2) == [("six seven", 2)]
    assert pool.take(0, 0) == []
    with pytest.raises(ValueError):
        SentencePool([], whitespace_counter)


def test_assemble_places_needles_at_nearest_boundary() -> None:
    pieces = [(f"s{i}.", 10) for i in range(10)]
    text = assemble(pieces, [Needle("N0.", 0.0), Needle("N1.", 1.0), Needle("NM.", 0.42)])
    words = text.split()
    assert words[0] == "N0." and words[-1] == "N1."
    assert words.index("NM.") == 1 + 4  # after N0 and four 10-token pieces (boundary 40 of 100)
    assert text.count("s") == 10
    with pytest.raises(ValueError, match="depth"):
        assemble(pieces, [Needle("bad", 1.5)])


def test_fit_prompt_exact_with_additive_counter(whitespace_counter: TokenCounter) -> None:
    pool = SentencePool(SENTENCES * 10, whitespace_counter)
    prompt, n = fit_prompt(pool, 1, [Needle("needle here.", 0.5)], 57, lambda h: f"Q: {h} A:")
    assert n == 57 == whitespace_counter.count(prompt)
    assert prompt.startswith("Q: four five.") and "needle here." in prompt


class LeadingSpaceCounter(TokenCounter):
    """Words, plus one token for a leading space: pieces overcount, so sums are not additive."""

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [len(t.split()) + t.startswith(" ") for t in texts]


def test_fit_prompt_corrects_non_additive_counts() -> None:
    counter = LeadingSpaceCounter()
    pool = SentencePool(SENTENCES * 200, counter)
    prompt, n = fit_prompt(pool, 0, [], 1000, lambda h: f"Q: {h} A:")
    assert n == counter.count(prompt)
    assert abs(n - 1000) <= tolerance(1000)


def test_fit_prompt_converges_with_bpe(bpe_counter: TokenCounter, essay_dir: Path) -> None:
    from vllm_kvcomp.eval.haystack import essay_sentences

    pool = SentencePool(essay_sentences(essay_dir), bpe_counter)
    for target in (150, 1000, 6000):
        prompt, n = fit_prompt(pool, 17, [Needle("A needle.", 0.3)], target, lambda h: h + "\nQ?")
        assert n == bpe_counter.count(prompt)
        assert abs(n - target) <= tolerance(target)


def test_load_counter_from_file_and_folder(tokenizer_json: Path, tmp_path: Path) -> None:
    direct = load_counter(tokenizer_json)
    assert isinstance(direct, TokenizersCounter)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    text = "The startup founders build a product."
    assert load_counter(folder).count(text) == direct.count(text) > 0
    with pytest.raises(FileNotFoundError):
        load_counter(tmp_path / "missing")


def test_char_estimate_counter() -> None:
    counter = CharEstimateCounter(4.0)
    assert counter.count_many(["", "abcd", "abcde"]) == [0, 1, 2]
    with pytest.raises(ValueError):
        CharEstimateCounter(0)
