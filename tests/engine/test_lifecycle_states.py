"""The worker side of a request's lifecycle (vllm_kvcomp/engine/lifecycle.py) without vLLM:
every legal path, and an illegal transition is an error, never a silent state."""

from __future__ import annotations

import pytest

from vllm_kvcomp.engine.lifecycle import IllegalTransition, Lifecycle, Phase


def test_prompt_end_then_decode_and_recompressions():
    life = Lifecycle()
    assert life.phase is Phase.PREFILL and not life.compression_pending
    life.prompt_complete(100)
    assert life.phase is Phase.PROMPT_END and life.prompt_end == 100 and life.compression_pending
    life.compressed()
    assert life.phase is Phase.DECODE and life.prompt_end is None
    life.decoded()
    life.decoded()
    assert life.steps_since == 2
    life.compressed()  # a decode recompression
    assert life.phase is Phase.DECODE and life.steps_since == 0


def test_streamed_chunks_stay_in_prefill():
    life = Lifecycle()
    life.compressed()  # prefill=stream: a chunk compressed before the prompt is complete
    assert life.phase is Phase.PREFILL and life.prompt_end is None


def test_a_postponed_compaction_waits_and_its_point_moves_with_the_tokens():
    life = Lifecycle()
    life.prompt_complete(100)
    life.await_spares(7)
    assert life.phase is Phase.AWAITING_SPARES and life.spares_needed == 7 and life.compression_pending
    life.prompt_complete(101)  # a token decoded meanwhile, over the uncompressed cache
    assert life.phase is Phase.AWAITING_SPARES and life.prompt_end == 101
    life.compressed()
    assert life.phase is Phase.DECODE and life.spares_needed == 0 and life.prompt_end is None


@pytest.mark.parametrize(("setup", "transition"), [
    ([], lambda life: life.decoded()),  # no decode before the prompt is compressed
    ([], lambda life: life.await_spares(3)),  # nothing to wait for in prefill
    (["prompt", "compress"], lambda life: life.prompt_complete(5)),  # a decoding prompt is done
    (["prompt", "compress"], lambda life: life.await_spares(3)),
])
def test_illegal_transitions_raise(setup, transition):
    life = Lifecycle()
    for step in setup:
        life.prompt_complete(10) if step == "prompt" else life.compressed()
    before = (life.phase, life.prompt_end, life.steps_since)
    with pytest.raises(IllegalTransition):
        transition(life)
    assert (life.phase, life.prompt_end, life.steps_since) == before
