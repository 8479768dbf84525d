"""The HTTP API's ASGI app in-process over a real Engine and a fake executor link: each error
status in OpenAI's shape, the API key, and a client that goes away cancelling its request (its
pages back in the pool at once), streamed or not. Real sockets and the SDK: tests/integration."""
import asyncio
import json
import os
import signal

import pytest

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.engine_types import EngineConfig
from scheduler_svc.metrics import Metrics
from scheduler_svc.openai_server import OpenAIConfig, OpenAIServer
from test_engine import FakeClient

PROMPT = [11, 12, 13, 14, 15]


class Client:
    """Drives the ASGI app as uvicorn would; `gone` set = the client disconnects."""

    def __init__(self, app) -> None:
        self.app = app

    async def request(self, method: str, path: str, body=None, headers=(), gone=None,
                      on_body=None, reply_headers=None) -> tuple[int, bytes]:
        raw = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": method, "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "scheme": "http",
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
                 "headers": [(k.encode(), v.encode()) for k, v in  # None: left out
                             {"content-type": "application/json", **dict(headers)}.items()
                             if v is not None]}
        pending = [{"type": "http.request", "body": raw, "more_body": False}]
        gone = gone or asyncio.Event()
        status, chunks = [], []

        async def receive():
            if pending:
                return pending.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if reply_headers is not None:
                    reply_headers.update((k.decode(), v.decode()) for k, v in message["headers"])
            elif message.get("body"):
                chunks.append(message["body"])
                if on_body is not None:
                    on_body(message["body"])

        await self.app(scope, receive, send)
        return status[0], b"".join(chunks)


async def with_server(test, config: EngineConfig = EngineConfig(),
                      api: OpenAIConfig = OpenAIConfig(), client=None):
    fake = client or FakeClient()
    engine = Engine(config, fake, Metrics())
    await engine.start()
    server = OpenAIServer(engine, api, engine.metrics.registry)
    client = Client(server.app)
    client.server = server
    try:
        return await asyncio.wait_for(test(client, engine, fake), 60)
    finally:
        await server.stop()  # and its body parser's children
        await engine.stop()


def run(test, **kw):
    return asyncio.run(with_server(test, **kw))


def error_of(status: int, body: bytes) -> tuple[int, dict]:
    return status, json.loads(body)["error"]


def completion(**fields) -> dict:
    return {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, **fields}


def test_a_completion_over_the_engine():
    async def test(client, engine, fake):
        await engine.wait_ready()
        status, body = await client.request("POST", "/v1/completions", completion(n=2))
        reply = json.loads(body)
        assert status == 200 and reply["object"] == "text_completion"
        assert [c["index"] for c in reply["choices"]] == [0, 1]
        assert reply["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
        assert reply["model"] == "fake"
        # n samples are one engine request: its prompt admitted (and prefilled) once
        assert engine.metrics.registry.get_sample_value("pagedserve_prompt_tokens_total") == 5
    run(test)


@pytest.mark.parametrize("fields,param", [
    ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"prompt": [10**6]}, "prompt"),
    ({"frequency_penalty": 5.0}, "frequency_penalty"), ({"n": "two"}, "n"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs")])
def test_bad_parameters_are_400_naming_them(fields, param):
    async def test(client, engine, fake):
        status, error = error_of(*await client.request("POST", "/v1/completions",
                                                       completion(**fields)))
        assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error")
        assert error["message"].startswith(param)
        assert engine.num_requests == 0
    run(test)


def test_unknown_model_404_bad_json_400_large_body_413_unknown_route_404():
    async def test(client, engine, fake):
        await engine.wait_ready()
        status, error = error_of(*await client.request("POST", "/v1/completions",
                                                       completion(model="gpt-4")))
        assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
        status, error = error_of(*await client.request("POST", "/v1/completions", b"{nope"))
        assert status == 400 and "not valid JSON" in error["message"]
        big = json.dumps(completion(prompt="x" * 4096)).encode()
        status, error = error_of(*await client.request("POST", "/v1/completions", big))
        assert status == 413
        status, error = error_of(*await client.request("GET", "/v2/nothing"))
        assert status == 404
    run(test, api=OpenAIConfig(max_body_bytes=1024))


def test_api_key_is_required_on_v1_only():
    async def test(client, engine, fake):
        await engine.wait_ready()
        for headers in ((), (("authorization", "Bearer wrong"),), (("authorization", "k"),)):
            status, error = error_of(*await client.request("GET", "/v1/models", headers=headers))
            assert (status, error["code"]) == (401, "invalid_api_key")
        status, body = await client.request("GET", "/v1/models",
                                            headers=(("authorization", "Bearer k"),))
        assert status == 200 and json.loads(body)["data"][0]["id"] == "fake"
        assert (await client.request("GET", "/health"))[0] == 200
    run(test, api=OpenAIConfig(api_key="k"))


def test_served_model_names_replace_the_executors():
    async def test(client, engine, fake):
        await engine.wait_ready()
        status, body = await client.request("GET", "/v1/models")
        assert [m["id"] for m in json.loads(body)["data"]] == ["a", "b"]
        status, body = await client.request("POST", "/v1/completions", completion(model="b"))
        assert status == 200 and json.loads(body)["model"] == "b"
        assert (await client.request("POST", "/v1/completions", completion(model="fake")))[0] == 404
    run(test, api=OpenAIConfig(served_model_names=("a", "b")))


def test_queue_full_is_429_and_no_sample_of_the_request_stays():
    async def test(client, engine, fake):
        await engine.wait_ready()
        fake.results_flow.clear()  # at most 1 running and 2 waiting: a 4th prompt is refused
        status, error = error_of(*await client.request("POST", "/v1/completions",
                                                       completion(prompt=[PROMPT] * 4, n=2)))
        assert status == 429 and error["type"] == "rate_limit_error"
        assert engine.num_requests == 0  # the requests admitted were aborted, every sample
    run(test, config=EngineConfig(SchedulerConfig(max_num_seqs=1), max_waiting=2))


def test_no_executor_is_503_and_health_says_so():
    async def test(client, engine, fake):
        status, error = error_of(*await client.request("POST", "/v1/completions", completion()))
        assert status == 503 and "no executor" in error["message"]
        assert (await client.request("GET", "/health"))[0] == 503
        assert (await client.request("GET", "/v1/models"))[0] == 503
    fake = FakeClient()
    fake.attachable.clear()
    run(test, config=EngineConfig(unavailable_grace_s=0), client=fake)


async def assert_cancelled(engine: Engine) -> None:
    """The request is gone and its pages are back in the pool."""
    await asyncio.wait_for(engine.wait_idle(), 5)
    stats = engine.status().scheduler
    assert stats.gpu_blocks_used == 0 and stats.running == stats.waiting == 0, stats
    assert engine.metrics.requests_finished.labels("cancelled")._value.get() >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_its_request(stream):
    both_sampled, first_chunk, gone = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def tamper(n, plan, sampled):  # once both samples run, no step result comes back
        if len(sampled) == 2:
            fake.results_flow.clear()
            both_sampled.set()
        return sampled
    fake = FakeClient(tamper)

    async def test(client, engine, fake):
        await engine.wait_ready()
        fake.results_flow.clear()  # no step ends before both samples are admitted
        call = asyncio.create_task(client.request(
            "POST", "/v1/completions", completion(n=2, max_tokens=100, stream=stream),
            gone=gone, on_body=lambda _: first_chunk.set()))
        while engine.num_requests < 2:
            await asyncio.sleep(0.001)
        fake.results_flow.set()
        await (first_chunk if stream else both_sampled).wait()
        assert engine.num_requests == 2 and engine.status().scheduler.gpu_blocks_used > 0
        gone.set()
        await call
        await assert_cancelled(engine)
    run(test, client=fake)


def test_stream_events_are_framed_and_end_with_done():
    async def test(client, engine, fake):
        await engine.wait_ready()
        status, body = await client.request("POST", "/v1/completions", completion(
            stream=True, stream_options={"include_usage": True}))
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        events = body.decode().split("\n\n")[:-1]
        assert all(e.startswith("data: ") and "\n" not in e for e in events)
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []
        assert all(c["usage"] is None for c in chunks[:-1])
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    run(test)


def test_http_flags(tmp_path, capsys):
    from scheduler_svc.main import parse_config

    config = parse_config([])
    assert (config.http_port, config.api_key, config.served_model_names) == (8000, None, ())
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    config = parse_config(["--http-port", "0", "--api-key-file", str(key_file),
                           "--served-model-name", "a", "b"])
    assert (config.http_port, config.api_key, config.served_model_names) == (0, "s3cret",
                                                                             ("a", "b"))
    with pytest.raises(SystemExit):
        parse_config(["--api-key", "k", "--api-key-file", str(key_file)])
    assert "give --api-key or --api-key-file, not both" in capsys.readouterr().err


@pytest.mark.parametrize("content_type,status", [
    (None, 415), ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("multipart/form-data; boundary=x", 415), ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200)])
def test_only_json_bodies_are_served(content_type, status):
    """A browser posts a form or text/plain cross-site without a CORS preflight: refused."""
    async def test(client, engine, fake):
        await engine.wait_ready()
        got, body = await client.request("POST", "/v1/completions", completion(),
                                         headers=(("content-type", content_type),))
        assert got == status, body
        if status == 415:
            message = json.loads(body)["error"]["message"]
            assert "content-type: application/json" in message
            assert (f"(got {content_type!r})" if content_type else "(got none)") in message
            assert engine.num_requests == 0
    run(test)


def test_echoed_values_are_clipped():
    async def test(client, engine, fake):
        await engine.wait_ready()
        status, error = error_of(*await client.request("POST", "/v1/completions",
                                                       completion(model="m" * (1 << 20))))
        assert status == 404 and len(error["message"]) < 400
        assert f"({1 << 20} characters)" in error["message"]
        status, error = error_of(*await client.request("GET", "/v1/" + "p" * 100_000))
        assert status == 404 and len(error["message"]) < 400
        status, error = error_of(*await client.request("POST", "/v1/completions", completion(
            logit_bias={"k" * 100_000: 1})))
        assert status == 400 and len(error["message"]) < 1200 and len(error["param"]) < 300
    run(test)


def test_a_mid_upload_disconnect_is_quiet(caplog):
    """No ERROR, no traceback, no 500: the client is gone and nobody reads the answer."""
    async def test(client, engine, fake):
        await engine.wait_ready()
        messages = [{"type": "http.request", "body": b'{"prompt": [1', "more_body": True},
                    {"type": "http.disconnect"}]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "scheme": "http",
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
                 "headers": [(b"content-type", b"application/json")]}
        statuses = []

        async def receive():
            return messages.pop(0)

        async def send(message):
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
        await client.app(scope, receive, send)
        assert statuses == [499] and engine.num_requests == 0
    with caplog.at_level("DEBUG"):
        run(test)
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]



def test_a_large_body_is_answered_as_a_small_one_and_its_faults_are_400(caplog):
    """Over body_parser.INLINE_PARSE_BYTES a body is parsed in a child process: the same answer,
    the same 400s naming the parameter, the model checked first, the unknown field logged once."""
    async def test(client, engine, fake):
        await engine.wait_ready()
        small = await client.request("POST", "/v1/completions", completion(seed=1))
        big = completion(seed=1, padding_of_this_test="x" * 100_000)
        for _ in range(2):
            status, body = await client.request("POST", "/v1/completions", big)
            assert status == 200 and json.loads(body)["choices"] == json.loads(small[1])["choices"]
        status, error = error_of(*await client.request("POST", "/v1/completions", completion(
            **{f"k{i}": 0 for i in range(20_000)})))
        assert (status, error["message"]) == (
            400, "k0: one of 20000 fields beyond the API's; at most 128 are accepted")
        status, error = error_of(*await client.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": ""}] * 5000}))
        assert (status, error["param"]) == (400, "messages")
        assert error["message"] == "messages: at most 1024 messages, got 5000"
        status, error = error_of(*await client.request("POST", "/v1/completions", completion(
            prompt=[[1]] * 10_000, model="nope")))
        assert status == 404
        status, error = error_of(*await client.request("POST", "/v1/completions", completion(
            n="2", pad="x" * 20_000)))
        assert (status, error["param"]) == (400, "n")
    with caplog.at_level("WARNING", logger="scheduler_svc.openai_protocol"):
        run(test)
    assert sum("padding_of_this_test" in r.getMessage() for r in caplog.records) == 1


def test_a_parser_child_killed_mid_parse_is_503_and_the_next_body_is_served():
    async def test(client, engine, fake):
        await engine.wait_ready()
        parser = client.server.body_parser
        await parser.start()
        pids = [child.proc.pid for child in parser.children]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        big = completion(pad="x" * 100_000)
        headers = [{} for _ in pids]
        calls = [asyncio.create_task(client.request("POST", "/v1/completions", big,
                                                    reply_headers=h)) for h in headers]
        await asyncio.sleep(0.2)  # each is written to a stopped child
        os.kill(pids[0], signal.SIGKILL)
        os.kill(pids[1], signal.SIGCONT)
        (killed, error), (served, _) = await asyncio.gather(*calls)
        assert (killed, served) == (503, 200) and headers[0]["retry-after"] == "1"
        error = json.loads(error)["error"]
        assert error["type"] == "service_unavailable_error"
        assert error["message"] == ("the process parsing this body ended (signal 9); retry in 1s")
        assert (await client.request("POST", "/v1/completions", big))[0] == 200
        assert engine.num_requests == 0
    run(test)
