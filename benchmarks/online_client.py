"""The online benchmark's client: streamed /v1/completions requests of any OpenAI-compatible server
sent at Poisson (gamma) arrival times or at a fixed concurrency, each traced, and the run's figures.
Only the standard library (http_stream.py); no project service is imported.

Definitions follow vLLM's `benchmarks/serve.py` (`get_request`, `calculate_metrics`) and
`benchmarks/lib/endpoint_request_func.py` (`async_request_openai_completions`): TTFT is the first
chunk carrying output, less the send time; each later such chunk adds one inter-token latency (the
gap since the previous one: a chunk of several tokens is one gap); e2e is the last such chunk less
the send time; output tokens are the usage chunk's `completion_tokens`; TPOT is (e2e - TTFT) /
(output tokens - 1), over requests of more than one token; percentiles interpolate linearly as
numpy's do; throughput divides by the run's wall time, from the first arrival to the last answer.
Arrival gaps are gamma draws (burstiness 1: exponential, a Poisson process) scaled so that the
last arrival falls at n / rate, as vLLM scales them; the concurrency cap holds a request back
before its send time is taken. One difference: a chunk that carries no token (its `token_ids`
empty, or, without them, a last chunk with the finish reason beyond the usage count: the closing
chunk some servers send apart) is no token's arrival, where vLLM's client would add an ITL for it.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

from benchmarks.http_stream import Connections, Endpoint, HttpStatusError, post_stream

PERCENTILES = (50, 90, 99)
MAX_REASON_CHARS = 300  # of one failure's reason kept in the results


@dataclass
class Record:
    """One request: what was asked, and what came back when (seconds, perf_counter)."""

    prompt_len: int
    max_tokens: int
    arrival_s: float = 0.0  # scheduled, from the run's start
    sent: float | None = None  # when the request went out (after any concurrency wait)
    send_lag: float | None = None  # sent less the scheduled time: the client's delay and the cap's
    token_times: list[float] = field(default_factory=list)  # each chunk carrying tokens
    tokens_counted: int = 0  # tokens those chunks carried (1 a chunk without token_ids)
    closing: bool = False  # the last chunk had a finish reason and no token ids
    completion_tokens: int | None = None  # from the usage chunk
    error: str | None = None
    # The JSON schema's name where one constrains the output (it ends with the schema, so any
    # length up to max_tokens completes); None: the output must run to max_tokens.
    schema: str | None = None
    text: str = ""  # a constrained output's text
    finish_reason: str | None = None
    check: str | None = None  # a constrained output against its schema (json_workload.py)

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.tokens_counted

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason[:MAX_REASON_CHARS]


def arrival_offsets(num_requests: int, rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send times from the run's start: all 0 at an infinite rate; else cumulative gamma gaps
    (shape burstiness, mean 1 / rate), scaled so that the last is num_requests / rate."""
    if num_requests <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * num_requests
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be positive, got {rate} and {burstiness}")
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    offsets, total = [], 0.0
    for _ in range(num_requests):
        total += rng.gammavariate(burstiness, theta)
        offsets.append(total)
    scale = (num_requests / rate) / total
    return [t * scale for t in offsets]


def request_body(model: str, prompt: list[int], max_tokens: int, temperature: float,
                 return_token_ids: bool, schema: dict | None = None) -> dict:
    """EOS ignored and min_tokens = max_tokens: every request produces its full output; with a
    JSON schema (vLLM's `structured_outputs`), the output ends where the schema's JSON does."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if schema is not None:
        del body["min_tokens"], body["ignore_eos"]
        body["structured_outputs"] = {"json": schema}
    if return_token_ids:
        body["return_token_ids"] = True
    return body


async def stream_completion(connections: Connections, body: dict, record: Record,
                            headers: dict[str, str] | None = None) -> None:
    """Sends one streamed completion and traces it into `record`; never raises (a failure is
    the record's error), except cancellation, which it records first."""
    record.sent = time.perf_counter()
    try:
        buffer = b""
        pieces = post_stream(connections, "/v1/completions", body, headers)
        async with contextlib.aclosing(pieces):  # a bad event closes the connection at once
            async for now, data in pieces:
                buffer += data  # the events of one read arrived together, at `now`
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    _on_event(event, now, record)
        _finish(record)
    except asyncio.CancelledError:
        record.fail("cancelled at the time limit")
        raise
    except HttpStatusError as err:
        record.fail(f"HTTP {err.status}: {error_message(err.body.decode(errors='replace'))}")
    except Exception as err:  # noqa: BLE001 - a failed request is a result, never a crash
        record.fail(f"{type(err).__name__}: {err}")


def _on_event(event: bytes, now: float, record: Record) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue  # SSE comments (pings) and other fields
        payload = line[5:].strip()
        if payload == b"[DONE]" or not payload:
            continue
        data = json.loads(payload)
        if data.get("error") or data.get("object") == "error":
            record.fail(f"error event: {error_message(json.dumps(data))}")
        elif data.get("choices"):
            choice = data["choices"][0]
            ids = choice.get("token_ids")
            record.finish_reason = choice.get("finish_reason") or record.finish_reason
            if record.schema is not None:
                record.text += choice.get("text") or ""
            if ids is None or ids:
                record.token_times.append(now)
                record.tokens_counted += 1 if ids is None else len(ids)
            record.closing = ids is None and choice.get("finish_reason") is not None
        elif data.get("usage"):
            record.completion_tokens = data["usage"].get("completion_tokens")


def _finish(record: Record) -> None:
    """Without token ids, a chunk is taken for one token; a last chunk with the finish reason
    that is one more than the usage count is the closing chunk of a server that sends it
    apart (its text may be text held back), not a token's arrival. Then checks the output."""
    if record.closing and record.completion_tokens == record.tokens_counted - 1:
        record.token_times.pop()
        record.tokens_counted -= 1
    if not record.token_times:
        record.fail("no chunk carried a token")
    elif record.schema is None and record.output_tokens != record.max_tokens:
        record.fail(f"{record.output_tokens} of {record.max_tokens} tokens")


def error_message(text: str) -> str:
    """The message of an error body, in OpenAI's shape ({"error": {"message"}}) or vLLM's older
    one ({"object": "error", "message"}), else the body itself."""
    try:
        data = json.loads(text)
        error = data.get("error", data)
        return str(error.get("message", text)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return text


async def run_load(endpoint: Endpoint, bodies: list[dict], records: list[Record],
                   max_concurrency: int | None = None, time_limit: float | None = None,
                   headers: dict[str, str] | None = None) -> float:
    """Sends bodies[i] at records[i].arrival_s after the start, at most `max_concurrency` at a
    time; at `time_limit` seconds, what is unsent or unfinished fails. The run's wall time."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connections = Connections(endpoint)
    start = time.perf_counter()
    deadline = start + time_limit if time_limit else math.inf

    async def one(body: dict, record: Record) -> None:
        async with gate or contextlib.nullcontext():
            record.send_lag = time.perf_counter() - start - record.arrival_s
            await stream_completion(connections, body, record, headers)

    tasks = []
    for body, record in zip(bodies, records):
        send_at = start + record.arrival_s
        if send_at >= deadline:
            record.fail("not sent before the time limit")
            continue
        if send_at > time.perf_counter():
            await asyncio.sleep(send_at - time.perf_counter())
        tasks.append(asyncio.ensure_future(one(body, record)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter())
                                        if deadline < math.inf else None)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    connections.close()
    for record in records:
        if record.sent is None:
            record.fail("cancelled at the time limit before it was sent")
    return wall


def percentile(values: list[float], q: float) -> float | None:
    """numpy's default (linear) percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def request_figures(record: Record) -> dict:
    """TTFT, e2e and TPOT (seconds) and the inter-token latencies of one completed request."""
    ttft = record.token_times[0] - record.sent
    e2e = record.token_times[-1] - record.sent
    n = record.output_tokens
    return {"ttft": ttft, "e2e": e2e, "tpot": (e2e - ttft) / (n - 1) if n > 1 else None,
            "itl": [b - a for a, b in zip(record.token_times, record.token_times[1:])]}


def summarize(records: list[Record], wall_s: float) -> dict:
    """The run's figures: counts, throughputs, and mean and p50/p90/p99 (ms) of TTFT, TPOT,
    ITL and e2e over the completed requests; failures by reason; how many constrained outputs
    parse and validate, and their mean share of max_tokens."""
    done = [r for r in records if r.error is None]
    figures = [request_figures(r) for r in done]
    output_tokens = sum(r.output_tokens for r in done)
    series = {"ttft": [f["ttft"] for f in figures], "e2e": [f["e2e"] for f in figures],
              "tpot": [f["tpot"] for f in figures if f["tpot"] is not None],
              "itl": [gap for f in figures for gap in f["itl"]]}
    out = {"requests": len(records), "completed": len(done), "failed": len(records) - len(done),
           "failure_reasons": dict(collections.Counter(r.error for r in records if r.error)
                                   .most_common(5)),
           "wall_s": wall_s, "prompt_tokens": sum(r.prompt_len for r in done),
           "output_tokens": output_tokens,
           "request_throughput": len(done) / wall_s if wall_s > 0 else 0.0,
           "output_throughput": output_tokens / wall_s if wall_s > 0 else 0.0,
           "chunks_not_one_token": sum(r.tokens_counted != len(r.token_times) for r in done),
           "token_count_mismatch": sum(r.tokens_counted != r.output_tokens for r in done),
           "finish_reasons": dict(collections.Counter(r.finish_reason for r in done)),
           "send_lag_p99_ms": _ms(percentile([r.send_lag for r in records
                                              if r.send_lag is not None], 99))}
    if any(r.schema is not None for r in records):  # how the constrained outputs ended
        out["json_outputs"] = dict(collections.Counter(
            r.check or "not completed" for r in records if r.schema is not None))
        # Two servers' figures compare like for like only where their outputs fill max_tokens alike
        fills = [r.output_tokens / r.max_tokens for r in done if r.schema is not None]
        out["json_fill"] = sum(fills) / len(fills) if fills else None
    for name, values in series.items():
        out[f"mean_{name}_ms"] = _ms(sum(values) / len(values) if values else None)
        for q in PERCENTILES:
            out[f"p{q}_{name}_ms"] = _ms(percentile(values, q))
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def record_row(record: Record) -> dict:
    """A record as saved: its figures when complete, its reason when not (no token times)."""
    row = {k: v for k, v in asdict(record).items()
           if k not in ("token_times", "sent", "closing")}
    row["send_lag_ms"] = _ms(row.pop("send_lag"))
    if record.error is None:
        figures = request_figures(record)
        row.update(ttft_ms=_ms(figures["ttft"]), e2e_ms=_ms(figures["e2e"]),
                   tpot_ms=_ms(figures["tpot"]), chunks=len(record.token_times))
    return row
