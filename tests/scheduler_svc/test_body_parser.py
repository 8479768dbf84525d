"""Large request bodies parsed in child processes: the same answer as the inline parse, whatever
the body; a bounded wait for a child (then 503's ParserUnavailable); a child that dies or hangs
failing only its own body and replaced; stop ending every child. Real child processes."""
import asyncio
import json
import os
import pickle
import signal

import pytest

from scheduler_svc.body_parser import INLINE_PARSE_BYTES, BodyParser, ParserUnavailable, parse
from scheduler_svc.request import RequestLimits

LIMITS = RequestLimits()
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


def large(**fields) -> bytes:
    """A valid completion body over the inline size: long lists, shared by n > the engine's MAX_N,
    unknown fields at every depth."""
    body = json.dumps({"prompt": [7] * 50_000, "n": 40, "seed": 3, "stop": ["x"], "extra": [1],
                       "stream_options": {"include_usage": True, "deep": [1] * 1000}, **fields})
    assert len(body) > INLINE_PARSE_BYTES
    return body.encode()


def chat_of(num_messages: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": f"m{i}", "x": i}
                                    for i in range(num_messages)], "user": "u"}).encode()


def run(test, **kw):
    async def main():
        parser = BodyParser(LIMITS, **kw)
        try:
            return await asyncio.wait_for(test(parser), 60)
        finally:
            await parser.stop()
    return asyncio.run(main())


BODIES = [("completions", large()), ("chat", chat_of(1000)), ("chat", chat_of(1025)),
          ("completions", large(top_k=2**31)), ("completions", b"{" * 20_000),
          ("completions", large(n="2")), ("chat", chat_of(1000)[:-1] + b', "tools": [1]}')]


def test_large_bodies_parse_in_a_child_as_they_do_inline():
    async def test(parser):
        for kind, data in BODIES:
            parsed = await parser.parse(kind, data, "r")
            assert parsed == parse(kind, data, "r", LIMITS)
            if parsed.specs is not None:  # bounded by the API's limits, not by the body
                assert len(pickle.dumps(parsed.body)) < 2048 and not parsed.body.model_extra
        assert parser.children[0].proc is not None  # they went to a child
        parsed = await parser.parse("completions", large(), "r")
        assert parsed.specs[0].prompt_token_ids is parsed.specs[1].prompt_token_ids
        assert parsed.ignored == ("extra",) and parsed.body.stream_options.include_usage
        assert [parsed.invalid, parsed.refusal] == [None, None]
        refusals = [(await parser.parse(kind, data, "r")).refusal for kind, data in BODIES[2:4]]
        assert [field for field, _ in refusals] == ["prompt.chat.messages", "top_k"]
    run(test, num_children=1)


def test_a_small_body_is_parsed_inline():
    async def test(parser):
        parsed = await parser.parse("chat", CHAT, "r")
        assert parsed.specs[0].chat == [{"role": "user", "content": "hi"}]
        assert all(child.proc is None for child in parser.children)
    run(test)


async def stopped_child(parser: BodyParser, index: int = 0) -> int:
    """Child `index` started and stopped (SIGSTOP): its pid."""
    await parser.start()
    pid = parser.children[index].proc.pid
    os.kill(pid, signal.SIGSTOP)
    return pid


async def until_waiting(parser: BodyParser, num: int) -> None:
    while parser._num_waiting < num:
        await asyncio.sleep(0.01)


def test_a_full_queue_is_refused_at_once_and_the_rest_are_served():
    async def test(parser):
        pid = await stopped_child(parser)
        first = asyncio.create_task(parser.parse("completions", large(), "a"))
        second = asyncio.create_task(parser.parse("completions", large(), "b"))
        await until_waiting(parser, 1)
        with pytest.raises(ParserUnavailable, match="1 large bodies are waiting.*retry in 1s"):
            await parser.parse("completions", large(), "c")
        os.kill(pid, signal.SIGCONT)
        assert [len(p.specs) for p in await asyncio.gather(first, second)] == [3, 3]
    run(test, num_children=1, max_waiting=1)


def test_a_killed_child_fails_only_its_body_and_is_replaced():
    async def test(parser):
        pid = await stopped_child(parser, 0)
        doomed = asyncio.create_task(parser.parse("completions", large(), "a"))
        await asyncio.sleep(0.2)  # it is written to the stopped child
        other = await parser.parse("chat", chat_of(1000), "b")  # the other child serves
        assert len(other.specs[0].chat) == 1000
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ParserUnavailable, match=r"ended \(signal 9\)"):
            await doomed
        again = await asyncio.gather(*(parser.parse("completions", large(), str(i))
                                       for i in range(3)))
        assert all(p == parse("completions", large(), str(i), LIMITS) for i, p in enumerate(again))
        assert parser.children[0].proc.pid != pid
    run(test, num_children=2)


def test_a_hung_child_is_ended_after_the_timeout():
    async def test(parser):
        pid = await stopped_child(parser)
        with pytest.raises(ParserUnavailable, match="took over 1s"):
            await parser.parse("completions", large(), "a")
        assert (await parser.parse("completions", large(), "b")).specs
        assert parser.children[0].proc.pid != pid
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # ended and reaped
    run(test, num_children=1, timeout_s=1.0)


def test_stop_ends_every_child_and_refuses_what_comes_after():
    async def test(parser):
        await parser.start()
        procs = [child.proc for child in parser.children]
        await parser.stop()
        assert [proc.returncode for proc in procs] == [0, 0]  # exited on their own
        with pytest.raises(ParserUnavailable, match="stopping"):
            await parser.parse("completions", large(), "a")
        assert (await parser.parse("chat", CHAT, "b")).specs  # a small body needs no child
    run(test)
