"""W4's requests (benchmarks/RESULTS.md): conversations of several turns sharing one system prompt,
run in rounds, as bench_serving.py and vllm_w4.py both build, scale and report them. Standard
library only: vllm_w4.py imports it inside vLLM's environment, without the project's packages.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ConversationsSpec:
    """W4 by default; the tests scale it down."""

    conversations: int = 64
    turns: int = 8
    system_tokens: int = 2000  # one system prompt, the same for every conversation
    user_tokens: tuple[int, int] = (64, 256)  # new tokens a turn adds to its prompt
    output_tokens: tuple[int, int] = (64, 256)


@dataclass(frozen=True)
class Turn:
    user_ids: list[int]
    output_len: int


def make_turns(spec: ConversationsSpec, vocab: int) -> tuple[list[int], list[list[Turn]]]:
    """The system prompt and each conversation's turns. As W1-W3: lengths from random.Random(0)
    (conversation by conversation, turn by turn: user tokens, then output), ids from
    random.Random(1) in [1, vocab) (the system prompt first)."""
    lengths_rng, ids_rng = random.Random(0), random.Random(1)
    system = [ids_rng.randrange(1, vocab) for _ in range(spec.system_tokens)]
    conversations = []
    for _ in range(spec.conversations):
        turns = []
        for _ in range(spec.turns):
            user_len = lengths_rng.randint(*spec.user_tokens)
            output_len = lengths_rng.randint(*spec.output_tokens)
            turns.append(Turn([ids_rng.randrange(1, vocab) for _ in range(user_len)], output_len))
        conversations.append(turns)
    return system, conversations


class ConversationRounds:
    """Round k holds every conversation's turn k; its prompt is the conversation so far (system
    prompt, then each earlier turn's user tokens and the model's actual output) plus turn k's
    user tokens. `add_outputs(k, ...)` must follow round k before round k + 1 is asked for."""

    def __init__(self, spec: ConversationsSpec, vocab: int) -> None:
        self.spec = spec
        system, self.conversations = make_turns(spec, vocab)
        self.histories = [list(system) for _ in self.conversations]  # turns before the next
        self.num_rounds_done = 0

    def requests(self, k: int) -> list[tuple[list[int], int]]:
        """Round k's (prompt ids, output length), conversation by conversation."""
        assert k == self.num_rounds_done, f"round {k} asked after {self.num_rounds_done} rounds"
        return [(history + turns[k].user_ids, turns[k].output_len)
                for history, turns in zip(self.histories, self.conversations)]

    def add_outputs(self, k: int, outputs: list[list[int]]) -> None:
        """Round k's generated ids, conversation by conversation, join their histories."""
        assert k == self.num_rounds_done and len(outputs) == len(self.histories)
        for history, turns, output in zip(self.histories, self.conversations, outputs):
            history.extend(turns[k].user_ids)
            history.extend(output)
        self.num_rounds_done += 1


def turn_lengths(spec: ConversationsSpec, vocab: int) -> list[list[tuple[int, int]]]:
    """(prompt length, output length) of each conversation's turns, every output at full length
    (EOS ignored): the sizes without running a model."""
    system, conversations = make_turns(spec, vocab)
    lengths = []
    for turns in conversations:
        context, row = len(system), []
        for turn in turns:
            row.append((context + len(turn.user_ids), turn.output_len))
            context += len(turn.user_ids) + turn.output_len
        lengths.append(row)
    return lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that scale W4 down (the tests) or change it; unset flags keep W4's values."""
    group = parser.add_argument_group("W4's conversations (default: RESULTS.md's W4)")
    group.add_argument("--conversations", type=int, default=None, help="W4: 64")
    group.add_argument("--turns", type=int, default=None, help="W4: 8 (a round per turn)")
    group.add_argument("--system-tokens", type=int, default=None,
                       help="the system prompt every conversation starts with; W4: 2000")
    group.add_argument("--user-tokens", type=_int_range, default=None, metavar="LO,HI",
                       help="new tokens a turn adds; W4: 64,256")
    group.add_argument("--output-tokens", type=_int_range, default=None, metavar="LO,HI",
                       help="output tokens of a turn; W4: 64,256")


def spec_from_args(args: argparse.Namespace) -> ConversationsSpec:
    fields = ("conversations", "turns", "system_tokens", "user_tokens", "output_tokens")
    given = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    return dataclasses.replace(ConversationsSpec(), **given)


def _int_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want LO,HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def percentile(values: list[float], q: float) -> float:
    """The sample at rank round(q% of n - 1) (nan for none): the one rule both sides report by."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]
