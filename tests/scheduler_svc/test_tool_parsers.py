"""Tool call parsers on text as models write it (Qwen / Hermes tags, SmolLM2's list in a tag, Llama
3.x JSON with and without <|python_tag|>, the JSON that required and named choices enforce): the
same content and calls whether the text comes whole or a few characters at a time, text with no
call passed through as content, truncated calls, and only the first call without parallel calls."""
import json
import random

import pytest

from scheduler_svc.tool_parsers import (HermesToolCalls, Llama3JsonToolCalls, NamedToolCall,
                                        RequiredToolCalls)

WEATHER = '{"city": "Paris", "unit": "celsius"}'
# (parser, model-written text, content, [(name, arguments)])
SAMPLES = [
    # Qwen 2.5 / 3 (hermes): each call in its own tag, text before the first is content
    (HermesToolCalls, f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
     '</tool_call>', None, [("get_weather", WEATHER)]),
    (HermesToolCalls, f'Let me look that up.\n<tool_call>\n{{"name": "get_weather", "arguments": '
     f'{WEATHER}}}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {{"tz": '
     '"CET"}}\n</tool_call>', "Let me look that up.\n",
     [("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    # keys in either order, braces and escapes inside strings
    (HermesToolCalls, '<tool_call>{"arguments": {"q": "a } b \\" {", "n": [1, {"x": null}]}, '
     '"name": "search"}</tool_call>', None,
     [("search", '{"q": "a } b \\" {", "n": [1, {"x": null}]}')]),
    # arguments written as a string of JSON
    (HermesToolCalls, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", '{"a": 1}')]),
    # no arguments: an empty object
    (HermesToolCalls, '<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    # SmolLM2: a list of calls in one tag
    (HermesToolCalls, '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
     '{"name": "get_time", "arguments": {}}\n]</tool_call>', None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    # SmolLM2 with nothing to call, and text with a tag that holds no call: all content
    (HermesToolCalls, "<tool_call>[]</tool_call>", "<tool_call>[]</tool_call>", []),
    (HermesToolCalls, "I use <tool_call> tags like <tool_call>this</tool_call>.",
     "I use <tool_call> tags like <tool_call>this</tool_call>.", []),
    (HermesToolCalls, "The capital of France is Paris. 2 < 3 and <tool", "The capital of France "
     "is Paris. 2 < 3 and <tool", []),
    # truncated (max_tokens): the call as far as it got
    (HermesToolCalls, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None,
     [("get_weather", '{"city": "Par')]),
    # Llama 3.x
    (Llama3JsonToolCalls, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    (Llama3JsonToolCalls, '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
     '{"name": "b", "parameters": {"y": 2.5e3, "z": true}}', None,
     [("a", '{"x": 1}'), ("b", '{"y": 2.5e3, "z": true}')]),
    (Llama3JsonToolCalls, "\n\nThe weather in Paris is sunny.", "\n\nThe weather in Paris is "
     "sunny.", []),
    (Llama3JsonToolCalls, '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, no call
    # what tool_choice "required" enforces
    (RequiredToolCalls, '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"now",'
     '"parameters":{}}]', None, [("get_weather", '{"city":"Paris"}'), ("now", "{}")]),
]


def run(stream, text: str, seed: int | None):
    """(content, [(name, arguments)], ids) of `text` fed whole (seed None) or in pieces of 1-5
    characters; checks each call's first delta has its id and name, the later ones neither."""
    pieces = [text] if seed is None else _pieces(text, random.Random(seed))
    outs = [stream.feed(p) for p in pieces] + [stream.finish()]
    content, calls = "", {}
    for out in outs:
        content += out.content
        for delta in out.tool_calls:
            if delta.index in calls:
                assert delta.id is None and delta.name is None
                calls[delta.index][1] += delta.arguments
            else:
                assert delta.index == len(calls) and delta.id.startswith("chatcmpl-tool-")
                calls[delta.index] = [delta.name, delta.arguments]
    return content, [tuple(c) for c in calls.values()]


def _pieces(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        step = rng.randint(1, 5)
        pieces.append(text[i:i + step])
        i += step
    return pieces


@pytest.mark.parametrize("parser,text,content,calls", SAMPLES)
def test_model_written_calls_parse_alike_whole_and_streamed(parser, text, content, calls):
    whole = run(parser(), text, None)
    assert whole == ("" if content is None else content, calls)
    for seed in range(10):
        assert run(parser(), text, seed) == whole


def test_content_streams_before_the_call_and_stops_at_it():
    stream = HermesToolCalls()
    assert stream.feed("Checking").content == "Checking"
    assert stream.feed(" now <tool").content == " now "  # "<tool" may begin a tag: held
    out = stream.feed('_call>{"name": "f", ')
    assert out.content == "" and out.tool_calls[0].name == "f"
    assert stream.feed('"arguments": {"a": 1}}</tool_call> and more').tool_calls[0].arguments \
        == '{"a": 1}'
    assert stream.finish().content == ""  # text after the call is dropped, as vLLM does


def test_text_held_for_a_call_that_never_comes_is_content_at_the_end():
    stream = Llama3JsonToolCalls()
    assert stream.feed('{"answer": ').content == ""
    assert stream.finish("42}").content == '{"answer": 42}'


def test_without_parallel_calls_only_the_first_goes_out():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", ' \
           '"arguments": {}}</tool_call>'
    assert run(HermesToolCalls(parallel=False), text, 3) == ("", [("a", "{}")])


def test_named_call_is_the_whole_text_and_comes_once():
    stream = NamedToolCall("get_weather")
    first = stream.feed('{"city":')
    [delta] = first.tool_calls
    assert (delta.index, delta.name, delta.arguments) == (0, "get_weather", '{"city":')
    assert delta.id.startswith("chatcmpl-tool-")
    [later] = stream.feed('"Paris"}').tool_calls
    assert (later.id, later.name, later.arguments) == (None, None, '"Paris"}')
    assert stream.finish().tool_calls == []


def test_arguments_add_up_to_the_models_json_text():
    args = {"q": "naïve café ☕", "nested": {"list": [1, 2.5, None, True], "s": "\\u00e9"}}
    text = json.dumps([{"name": "s", "parameters": args}], ensure_ascii=False)
    _, [(name, arguments)] = run(RequiredToolCalls(), text, 7)
    assert name == "s" and json.loads(arguments) == args


ATOMS = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ":", ",", ";", " ", "\n",
         '"name"', '"arguments"', '"parameters"', '"f"', "1", "true", "x", "<", "<|python_tag|>"]


@pytest.mark.parametrize("parser", [HermesToolCalls, Llama3JsonToolCalls, RequiredToolCalls])
def test_any_text_parses_alike_whole_and_streamed_and_without_a_call_is_content(parser):
    """Random runs of the formats' own pieces: no exception, one answer however the text is
    split, and text that yields no call comes back whole as content."""
    rng = random.Random(0)
    for _ in range(1500):
        text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 30)))
        whole = run(parser(), text, None)
        assert run(parser(), text, rng.randrange(1 << 30)) == whole, text
        assert whole[1] or whole[0] == text
