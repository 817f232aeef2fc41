"""Beam search's bookkeeping (producer.beam_search), the part the API and LLM.beam_search
share: which continuations survive a step, and how finished beams rank."""

from __future__ import annotations

import pytest

from producer.beam_search import Beam, best, step

EOS = 2


def test_a_step_keeps_the_width_best_continuations_over_all_beams() -> None:
    live = [Beam([5], -1.0), Beam([6], -1.5)]
    tops = [[(7, -0.1), (8, -2.0)], [(9, -0.2), (10, -0.3)]]
    nxt, done = step(live, tops, width=2, eos={EOS})
    assert [(b.tokens, b.logprob) for b in nxt] == [([5, 7], -1.1), ([6, 9], pytest.approx(-1.7))]
    assert done == []


def test_an_end_among_the_best_finishes_a_beam_and_a_worse_one_is_dropped() -> None:
    live = [Beam([5], 0.0)]
    nxt, done = step(live, [[(EOS, -0.1), (7, -0.2), (8, -0.3), (EOS + 100, -0.4)]], width=2, eos={EOS})
    assert [(b.tokens, b.finish_reason) for b in done] == [([5, EOS], "stop")]
    assert [b.tokens for b in nxt] == [[5, 7], [5, 8]]  # the end does not take a live slot
    nxt, done = step(live, [[(7, -0.1), (8, -0.2), (EOS, -0.3), (9, -0.4)]], width=2, eos={EOS})
    assert done == [] and [b.tokens for b in nxt] == [[5, 7], [5, 8]]  # ranked third: dropped


def test_best_ranks_by_logprob_over_length_to_the_penalty() -> None:
    short, long = Beam([1, EOS], -2.0, "stop"), Beam([1, 3, 4, 5], -3.0)
    assert [b.tokens for b in best([short], [long], 2, length_penalty=0.0)] == [[1, EOS], [1, 3, 4, 5]]
    ranked = best([short], [long], 2, length_penalty=1.0)  # -1.0 per token against -0.75
    assert [(b.tokens, b.finish_reason) for b in ranked] == [([1, 3, 4, 5], "length"), ([1, EOS], "stop")]
    assert len(best([short], [long], 1, 1.0)) == 1
