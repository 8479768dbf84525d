"""W4's conversations (benchmarks/conversations.py): deterministic turns, prompts that carry the
conversation so far, sizes without a model, and the flags that scale it down."""
from __future__ import annotations

import argparse

import pytest

from benchmarks.conversations import (ConversationRounds, ConversationsSpec, add_arguments,
                                      make_turns, spec_from_args, turn_lengths)

SMALL = ConversationsSpec(conversations=3, turns=3, system_tokens=20, user_tokens=(2, 5),
                          output_tokens=(1, 4))


def fake_outputs(requests: list[tuple[list[int], int]], k: int) -> list[list[int]]:
    return [[1000 * (k + 1) + i] * o for i, (_, o) in enumerate(requests)]


def test_turns_are_deterministic_and_within_ranges():
    system, conversations = make_turns(SMALL, vocab=50)
    assert (system, conversations) == make_turns(SMALL, vocab=50)
    assert len(system) == 20 and len(conversations) == 3
    for turns in conversations:
        assert len(turns) == 3
        for turn in turns:
            assert 2 <= len(turn.user_ids) <= 5 and 1 <= turn.output_len <= 4
            assert all(1 <= t < 50 for t in turn.user_ids)


def test_a_turns_prompt_is_the_conversation_so_far_plus_its_new_tokens():
    rounds = ConversationRounds(SMALL, vocab=50)
    system, conversations = make_turns(SMALL, vocab=50)
    expected = [list(system) for _ in conversations]
    for k in range(SMALL.turns):
        requests = rounds.requests(k)
        for i, (prompt, output_len) in enumerate(requests):
            assert prompt == expected[i] + conversations[i][k].user_ids
            assert output_len == conversations[i][k].output_len
        outputs = fake_outputs(requests, k)
        rounds.add_outputs(k, outputs)
        for i, output in enumerate(outputs):
            expected[i] += conversations[i][k].user_ids + output
    assert rounds.num_rounds_done == SMALL.turns


def test_rounds_go_in_order():
    rounds = ConversationRounds(SMALL, vocab=50)
    with pytest.raises(AssertionError):
        rounds.requests(1)
    rounds.add_outputs(0, fake_outputs(rounds.requests(0), 0))
    with pytest.raises(AssertionError):
        rounds.add_outputs(0, fake_outputs(rounds.requests(1), 0))


def test_turn_lengths_are_those_of_full_outputs():
    rounds = ConversationRounds(SMALL, vocab=50)
    lengths = turn_lengths(SMALL, vocab=50)
    for k in range(SMALL.turns):
        requests = rounds.requests(k)
        assert [(len(p), o) for p, o in requests] == [row[k] for row in lengths]
        rounds.add_outputs(k, fake_outputs(requests, k))


def test_flags_scale_w4_and_leave_the_rest():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert spec_from_args(parser.parse_args([])) == ConversationsSpec()
    spec = spec_from_args(parser.parse_args(["--turns", "2", "--user-tokens", "3,9"]))
    assert spec == ConversationsSpec(turns=2, user_tokens=(3, 9))
    with pytest.raises(SystemExit):
        parser.parse_args(["--output-tokens", "9,3"])
