"""Chaos soak (not in CI): W1-shaped traffic, scaled down, streamed through gRPC Generate and the
OpenAI HTTP API on the CPU backend while a seeded chaos thread SIGKILLs or SIGSTOPs the executor;
every output must equal an undisturbed run's, token for token, and the pools must end whole.

    python benchmarks/chaos_soak.py --duration 600 --out soak.json
"""
from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Executors are forked while this process holds gRPC channels (see tests/conftest.py for why).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from protos import generate_pb2, generate_pb2_grpc  # noqa: E402
from scripts.local_services import Services, start_services, wait_serving  # noqa: E402

W1_PROMPT, W1_OUTPUT = (64, 1024), (32, 512)  # BENCHMARK.md's W1 ranges, before --scale
VOCAB = 49152  # preset:tiny and SmolLM2 share it
SHARED_PREFIXES, SHARED_PREFIX_LEN = 4, 48  # system prompts that half the requests start with
KINDS = ("kill", "stop-short", "stop-long")
LOGPROB_TOLERANCE = 1e-3  # HTTP token texts can coincide; their logprobs tell the ids apart


@dataclass(frozen=True)
class Spec:
    """One request of the soak's pool; the soak sends them in order, round and round."""

    index: int
    api: str  # "grpc" or "http" (streamed /v1/completions)
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    seed: int | None  # None: greedy


def make_specs(count: int, scale: float, seed: int) -> list[Spec]:
    """W1's lengths (random.Random(0), prompt then output, request by request) times `scale`, ids
    from random.Random(1); the mix (API, n, seed, a shared prefix) from random.Random(seed)."""
    lengths, ids, mix = random.Random(0), random.Random(1), random.Random(seed)
    prefixes = [[ids.randrange(1, VOCAB) for _ in range(SHARED_PREFIX_LEN)]
                for _ in range(SHARED_PREFIXES)]
    specs = []
    for i in range(count):
        prompt_len = max(2, round(lengths.randint(*W1_PROMPT) * scale))
        output_len = max(1, round(lengths.randint(*W1_OUTPUT) * scale))
        prompt = [ids.randrange(1, VOCAB) for _ in range(prompt_len)]
        if mix.random() < 0.5:
            shared = mix.choice(prefixes)[:prompt_len - 1]
            prompt[:len(shared)] = shared
        n = mix.randint(2, 4) if mix.random() < 0.25 else 1
        sampled = n > 1 or mix.random() < 0.5
        api = "http" if mix.random() < 0.5 else "grpc"
        specs.append(Spec(i, api, tuple(prompt), output_len, n,
                          mix.randrange(1 << 31) if sampled else None))
    return specs


@dataclass
class Outcome:
    """What one request streamed, per sample: token ids (gRPC) or token texts (HTTP), text,
    logprobs (HTTP), finish reason; its error; faults of the stream's shape; the longest wait
    from submission to its first message (admission included), and the longest between two of
    its messages (where a chaos event shows)."""

    spec: int
    api: str
    tokens: list[list] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    error: str | None = None
    problems: list[str] = field(default_factory=list)
    first_wait: float = 0.0
    max_gap: float = 0.0
    started: float = 0.0
    last: float | None = None

    @classmethod
    def empty(cls, spec: Spec) -> Outcome:
        return cls(spec.index, spec.api, [[] for _ in range(spec.n)], [""] * spec.n,
                   [[] for _ in range(spec.n)], [None] * spec.n, started=time.monotonic())

    def tick(self) -> None:
        """Times a message's arrival."""
        now = time.monotonic()
        if self.last is None:
            self.first_wait = now - self.started
        else:
            self.max_gap = max(self.max_gap, now - self.last)
        self.last = now

    def check_finished(self) -> None:
        if self.error is None and None in self.finish:
            self.problems.append(f"samples without a finish: {self.finish}")

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def compare(expected: Outcome, got: Outcome) -> str | None:
    """Why `got` differs from `expected` (the first difference), or None."""
    for s, (want, have) in enumerate(zip(expected.tokens, got.tokens, strict=True)):
        if want != have:
            at = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b),
                      min(len(want), len(have)))
            return (f"sample {s}: {len(have)} tokens, {len(want)} expected; first difference "
                    f"at {at}: {have[at:at + 3]} for {want[at:at + 3]}")
        for i, (a, b) in enumerate(zip(expected.logprobs[s], got.logprobs[s])):
            if abs(a - b) > LOGPROB_TOLERANCE:
                return f"sample {s}: token {i}'s logprob {b} for {a}"
    if expected.texts != got.texts:
        return f"texts differ: {got.texts!r} for {expected.texts!r}"
    if expected.finish != got.finish:
        return f"finish reasons {got.finish} for {expected.finish}"
    return None


def grpc_request(spec: Spec) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(request_id=f"soak-{spec.index}")
    req.token_ids.ids.extend(spec.prompt)
    req.stopping.max_tokens = spec.max_tokens
    req.stopping.ignore_eos = True
    if spec.n > 1:
        req.n = spec.n
    if spec.seed is not None:
        req.sampling.temperature, req.sampling.top_p, req.sampling.seed = 0.8, 0.95, spec.seed
    return req


def run_grpc(stub, spec: Spec, timeout: float) -> Outcome:
    """One Generate stream; a message index that is not the sample's token count so far is a
    missing or duplicated token."""
    out = Outcome.empty(spec)
    try:
        for msg in stub.Generate(grpc_request(spec), timeout=timeout):
            out.tick()
            s = msg.sample_index
            if msg.finished:
                out.finish[s] = generate_pb2.FinishReason.Name(msg.finish_reason)
                if msg.completion_tokens != len(out.tokens[s]):
                    out.problems.append(f"sample {s}: completion_tokens "
                                        f"{msg.completion_tokens}, {len(out.tokens[s])} streamed")
                continue
            if msg.index != len(out.tokens[s]):
                out.problems.append(f"sample {s}: index {msg.index} after "
                                    f"{len(out.tokens[s])} tokens")
            out.tokens[s].extend(msg.token_ids)
            out.texts[s] += msg.text
    except grpc.RpcError as err:
        out.error = f"{err.code().name}: {err.details()}"
    except IndexError:
        out.error = "a sample_index beyond n"
    out.check_finished()
    return out


def http_body(spec: Spec, model: str) -> dict:
    body = {"model": model, "prompt": list(spec.prompt), "max_tokens": spec.max_tokens,
            "n": spec.n, "ignore_eos": True, "stream": True, "logprobs": 0,
            "stream_options": {"include_usage": True}, "temperature": 0}
    if spec.seed is not None:
        body.update(temperature=0.8, top_p=0.95, seed=spec.seed)
    return body


def run_http(port: int, model: str, spec: Spec, timeout: float) -> Outcome:
    """One streamed /v1/completions request with logprobs (each token's text and offset)."""
    out = Outcome.empty(spec)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(http_body(spec, model)),
                     {"content-type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            out.error = f"HTTP {reply.status}: {reply.read()[:300]!r}"
        else:
            read_sse(reply, out)
    except (OSError, http.client.HTTPException, ValueError, LookupError, TypeError) as err:
        out.error = repr(err)  # a malformed event (no such choice, field or sample) too
    finally:
        conn.close()
    out.check_finished()
    return out


def read_sse(reply, out: Outcome) -> None:
    """Adds a completions stream's events (`reply.readline()` lines) to `out`; the usage must
    count every token streamed, and [DONE] must end it."""
    usage = None
    while line := reply.readline():
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            if usage != out.num_tokens:
                out.problems.append(f"usage counts {usage} tokens, {out.num_tokens} streamed")
            return
        out.tick()
        chunk = json.loads(line[6:])
        if "error" in chunk:
            out.error = f"error event: {chunk['error']}"
            return
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            _apply_choice(out, choice)
    out.error = "the stream ended without [DONE]"


def _apply_choice(out: Outcome, choice: dict) -> None:
    """Adds one chunk's choice; its first token must start where the sample's text ends."""
    s, logprobs = choice["index"], choice.get("logprobs")
    if logprobs:
        offsets = logprobs["text_offset"]
        if offsets[0] != len(out.texts[s]) or offsets != sorted(offsets):
            out.problems.append(f"sample {s}: text offsets {offsets} after "
                                f"{len(out.texts[s])} characters")
        out.tokens[s].extend(logprobs["tokens"])
        out.logprobs[s].extend(logprobs["token_logprobs"])
    out.texts[s] += choice["text"]
    if choice["finish_reason"] is not None:
        out.finish[s] = choice["finish_reason"]


class Client:
    """Sends specs through their APIs; one gRPC channel shared by every thread."""

    def __init__(self, services: Services, timeout: float) -> None:
        self.services, self.timeout = services, timeout
        self.channel = grpc.insecure_channel(services.scheduler_address)
        self.stub = generate_pb2_grpc.GeneratorStub(self.channel)
        conn = http.client.HTTPConnection("127.0.0.1", services.http_port, timeout=60)
        conn.request("GET", "/v1/models")
        self.model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.close()

    def send(self, spec: Spec) -> Outcome:
        if spec.api == "grpc":
            return run_grpc(self.stub, spec, self.timeout)
        return run_http(self.services.http_port, self.model, spec, self.timeout)

    def drive(self, specs: list[Spec], concurrency: int,
              more: Callable[[int], bool]) -> list[Outcome]:
        """`concurrency` clients, each sending the next spec (round and round) as soon as its
        previous one ended, while `more(k)` says the k-th request is to be sent."""
        counter, lock, outcomes = itertools.count(), threading.Lock(), []

        def client() -> None:
            while True:
                with lock:
                    k = next(counter)
                if not more(k):
                    return
                outcomes.append(self.send(specs[k % len(specs)]))

        with ThreadPoolExecutor(concurrency) as pool:
            for future in [pool.submit(client) for _ in range(concurrency)]:
                future.result()
        return outcomes


class Chaos(threading.Thread):
    """Every `interval` seconds (uniform, seeded), one event on the executor: `kill` (SIGKILL,
    then a new executor on its port, awaited until it serves), `stop-short` / `stop-long`
    (SIGSTOP, then SIGCONT after a pause shorter / longer than the scheduler's step timeout).
    `forced` kinds come first, in order, past `until` if need be; then random ones."""

    def __init__(self, services: Services, executor_args: list[str], seed: int,
                 interval: tuple[float, float], step_timeout: float, forced: list[str]) -> None:
        super().__init__(daemon=True, name="chaos")
        self.services, self.executor_args = services, executor_args
        self.rng, self.interval, self.step_timeout = random.Random(seed), interval, step_timeout
        self.forced, self.halt, self.events = list(forced), threading.Event(), []
        self.error: str | None = None
        self.executor = services.procs["executor"]
        self.started = self.until = time.monotonic()

    def run(self) -> None:
        """Events until `until` (monotonic) or `halt`; an event that fails ends the chaos, its
        error kept in `error` (the soak then fails)."""
        while not self.halt.wait(self.rng.uniform(*self.interval)):
            if time.monotonic() >= self.until and not self.forced:
                return
            kind = self.forced.pop(0) if self.forced else self.rng.choice(KINDS)
            at = round(time.monotonic() - self.started, 1)
            try:
                event = self._kill() if kind == "kill" else self._hang(kind)
            except Exception as err:  # noqa: BLE001 - reported in the verdict
                self.error = f"{kind} at {at} s: {err!r}"
                return
            self.events.append({"kind": kind, "at_s": at, **event})
            print(f"chaos: {self.events[-1]}", flush=True)

    def _kill(self) -> dict:
        self.executor.send_signal(signal.SIGKILL)
        self.executor.wait()
        began = time.monotonic()
        name = f"executor-{len(self.events) + 1}"
        port = int(self.services.executor_address.rsplit(":", 1)[1])
        self.services.add_executor(name, self.executor_args, port=port, wait=False)
        self.executor = self.services.procs[name]
        wait_serving(self.services.executor_address, procs={name: self.executor})
        return {"restart_s": round(time.monotonic() - began, 1), "log": name}

    def _hang(self, kind: str) -> dict:
        short = kind == "stop-short"
        low, high = (0.2, 0.7) if short else (1.5, 2.5)
        pause = self.rng.uniform(low, high) * self.step_timeout
        self.executor.send_signal(signal.SIGSTOP)
        try:
            time.sleep(pause)
        finally:
            self.executor.send_signal(signal.SIGCONT)
        return {"pause_s": round(pause, 1)}


def wait_idle(services: Services, timeout: float = 60) -> dict:
    """GetStatus once nothing runs, waits or is swapped and no page is in use (or at `timeout`),
    with the scheduler's page and preemption metrics."""
    deadline = time.monotonic() + timeout
    while True:
        s = services.status()
        whole = (s.running == s.waiting == s.swapped == 0
                 and s.gpu_blocks_used == s.cpu_blocks_used == 0)
        if whole or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # GetStatus has no watch to await
    m = services.metrics()
    picked = {k: v for k, v in m.items() if k.startswith(
        ("pagedserve_gpu_blocks", "pagedserve_cpu_blocks", "pagedserve_preemptions_total",
         "pagedserve_blocks_swapped_total", "pagedserve_requests_", "pagedserve_prefix_cache_"))}
    fields = ("executor_attached", "running", "waiting", "swapped", "gpu_blocks_used",
              "gpu_blocks_total", "cpu_blocks_used", "cpu_blocks_total", "steps", "resyncs",
              "loop_failures")
    return {"whole": whole, **{f: getattr(s, f) for f in fields}, "metrics": picked}


def inject_mismatch(reference: dict[int, Outcome]) -> None:
    """Changes spec 0's expected last token: the checker's own check (the soak must report it)."""
    tokens = reference[0].tokens[0]
    tokens[-1] = tokens[-1] + 1 if isinstance(tokens[-1], int) else tokens[-1] + "?"


def judge(outcomes: list[Outcome], reference: dict[int, Outcome]) -> dict:
    """Failures (an error), stream faults (index, offset or count) and mismatches (tokens, texts
    or finish reasons other than the reference's), each listed with its spec."""
    failures = [{"spec": o.spec, "api": o.api, "error": o.error} for o in outcomes if o.error]
    problems = [{"spec": o.spec, "api": o.api, "problems": o.problems}
                for o in outcomes if o.problems]
    mismatches = []
    for o in outcomes:
        why = None if o.error else compare(reference[o.spec], o)
        if why:
            mismatches.append({"spec": o.spec, "api": o.api, "why": why})
    worst = max(outcomes, key=lambda o: o.max_gap, default=None)
    gaps, firsts = (sorted(getattr(o, f) for o in outcomes) or [0.0]
                    for f in ("max_gap", "first_wait"))
    return {"requests": len(outcomes), "tokens": sum(o.num_tokens for o in outcomes),
            "grpc_requests": sum(o.api == "grpc" for o in outcomes),
            "http_requests": sum(o.api == "http" for o in outcomes),
            "failures": failures, "stream_problems": problems, "mismatches": mismatches,
            "max_gap_s": round(gaps[-1], 2), "max_gap_spec": worst.spec if worst else None,
            "request_max_gap_p50_s": round(gaps[len(gaps) // 2], 2),
            "request_max_gap_p99_s": round(gaps[int(0.99 * (len(gaps) - 1))], 2),
            "first_wait_p50_s": round(firsts[len(firsts) // 2], 2),
            "first_wait_max_s": round(firsts[-1], 2)}


def run_reference(client: Client, services: Services, specs: list[Spec],
                  concurrency: int) -> tuple[dict[int, Outcome], dict]:
    """Every spec once, undisturbed; the outputs, and what the pass saw."""
    began = time.monotonic()
    outcomes = client.drive(specs, concurrency, lambda k: k < len(specs))
    verdict = judge(outcomes, {o.spec: o for o in outcomes})
    idle = wait_idle(services)
    bad = verdict["failures"] or verdict["stream_problems"] or not idle["whole"]
    if bad:
        raise RuntimeError(f"the undisturbed pass itself failed: {verdict} {idle}")
    return {o.spec: o for o in outcomes}, {
        "requests": verdict["requests"], "tokens": verdict["tokens"],
        "seconds": round(time.monotonic() - began, 1), "after": idle}


def run_soak(args, services: Services, client: Client, specs: list[Spec],
             reference: dict[int, Outcome]) -> dict:
    """The specs round and round under chaos for --duration seconds (and until the --force
    events have begun); then the verdict, once every stream has ended and the scheduler is
    idle."""
    before = services.status()
    chaos = Chaos(services, executor_args(args), args.seed, tuple(args.interval),
                  args.step_timeout, [k for k in args.force.split(",") if k])
    chaos.until = time.monotonic() + args.duration
    chaos.start()
    try:
        outcomes = client.drive(specs, args.concurrency,
                                lambda _: time.monotonic() < chaos.until
                                or (bool(chaos.forced) and chaos.is_alive()))
    finally:
        chaos.halt.set()
        chaos.join()
    verdict = judge(outcomes, reference)
    after = wait_idle(services)
    kinds = [e["kind"] for e in chaos.events]
    return {**verdict, "seconds": round(time.monotonic() - chaos.started, 1),
            "kills": kinds.count("kill"), "stops_short": kinds.count("stop-short"),
            "stops_long": kinds.count("stop-long"), "events": chaos.events,
            "chaos_error": chaos.error,
            "resyncs": after["resyncs"] - before.resyncs,
            "loop_failures": after["loop_failures"] - before.loop_failures, "after": after}


def executor_args(args) -> list[str]:
    return ["--model", args.model, "--num-gpu-blocks", str(args.num_gpu_blocks),
            "--swap-space", str(args.swap_space), *args.executor_arg]


def passed(soak: dict) -> bool:
    return not (soak["failures"] or soak["stream_problems"] or soak["mismatches"]
                or soak["loop_failures"] or soak["chaos_error"]) and soak["after"]["whole"] \
        and soak["after"]["executor_attached"]


def preemptions(status: dict) -> dict[str, int]:
    return {mode: int(status["metrics"].get(f'pagedserve_preemptions_total{{mode="{mode}"}}', 0))
            for mode in ("swap", "recompute")}


def summary(soak: dict, reference: dict) -> str:
    after = soak["after"]
    return "\n".join([
        f"reference: {reference['requests']} requests, {reference['tokens']} tokens in "
        f"{reference['seconds']} s, preemptions {preemptions(reference['after'])}",
        f"soak: {soak['requests']} requests ({soak['grpc_requests']} gRPC, "
        f"{soak['http_requests']} HTTP), {soak['tokens']} tokens in {soak['seconds']} s",
        f"chaos: {soak['kills']} kills, {soak['stops_short']} short stops, "
        f"{soak['stops_long']} long stops; {soak['resyncs']} resyncs, "
        f"{soak['loop_failures']} loop failures" + (f"; ERROR {soak['chaos_error']}"
                                                     if soak["chaos_error"] else ""),
        f"failures {len(soak['failures'])}, stream problems {len(soak['stream_problems'])}, "
        f"mismatches {len(soak['mismatches'])}",
        f"longest wait between two messages of a stream {soak['max_gap_s']} s (spec "
        f"{soak['max_gap_spec']}), a request's longest p50 {soak['request_max_gap_p50_s']} s, "
        f"p99 {soak['request_max_gap_p99_s']} s; first message after p50 "
        f"{soak['first_wait_p50_s']} s, max {soak['first_wait_max_s']} s",
        f"preemptions (whole run) {preemptions(after)}; pools whole: {after['whole']} "
        f"(GPU pages used {after['gpu_blocks_used']}/{after['gpu_blocks_total']}, CPU "
        f"{after['cpu_blocks_used']}/{after['cpu_blocks_total']}, running {after['running']}, "
        f"waiting {after['waiting']}, swapped {after['swapped']})",
        "PASSED" if passed(soak) else "FAILED"])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of chaos and traffic")
    p.add_argument("--seed", type=int, default=0, help="seeds the request mix and the chaos")
    p.add_argument("--model", default="preset:tiny",
                   help="the executor's --model (the default GGUF works too, far slower on CPU)")
    p.add_argument("--requests", type=int, default=256,
                   help="distinct requests, sent round and round (W1 has 256)")
    p.add_argument("--scale", type=float, default=0.25, help="W1's prompt and output lengths times")
    p.add_argument("--concurrency", type=int, default=24, help="requests in flight during the soak")
    p.add_argument("--reference-concurrency", type=int, default=4,
                   help="requests in flight in the undisturbed pass (few: no preemption)")
    p.add_argument("--interval", type=float, nargs=2, default=[20.0, 60.0], metavar=("LO", "HI"),
                   help="seconds between two chaos events, uniform")
    p.add_argument("--force", default="",
                   help=f"comma-separated kinds of the first events ({', '.join(KINDS)})")
    p.add_argument("--step-timeout", type=float, default=4.0, help="the scheduler's flag")
    p.add_argument("--num-gpu-blocks", type=int, default=96,
                   help="the executor's KV pages: small, so that sequences are preempted")
    p.add_argument("--swap-space", type=float, default=0.0002,
                   help="the executor's GiB of swap (26 pages of preset:tiny): when it is full, "
                        "preemption falls back to recompute")
    p.add_argument("--executor-arg", action="append", default=[],
                   help="one more executor argument (repeat)")
    p.add_argument("--timeout", type=float, default=300.0, help="each request's deadline")
    p.add_argument("--inject-mismatch", action="store_true",
                   help="alter one expected output, to see the checker report it")
    p.add_argument("--log-dir", default=None, help="the services' logs (default: a new temp dir)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    unknown = set(k for k in args.force.split(",") if k) - set(KINDS)
    if unknown:
        p.error(f"--force: unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="chaos_soak_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", flush=True)
    load_before = os.getloadavg()
    services = start_services(log_dir, executor_args(args),
                              ["--step-timeout", str(args.step_timeout)])
    try:
        client = Client(services, args.timeout)
        specs = make_specs(args.requests, args.scale, args.seed)
        expected, reference = run_reference(client, services, specs, args.reference_concurrency)
        if args.inject_mismatch:
            inject_mismatch(expected)
        soak = run_soak(args, services, client, specs, expected)
    finally:
        services.stop()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(),
              "args": vars(args), "log_dir": str(log_dir),
              "load_before": load_before, "load_after": os.getloadavg(),
              "reference": reference, "soak": soak, "passed": passed(soak)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(summary(soak, reference))
    return 0 if result["passed"] else 1


def _commit() -> str:
    """HEAD's short hash, "+ uncommitted changes" when the tree differs from it."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout
    head = git("rev-parse", "--short", "HEAD").strip()
    if not head:
        return f"unknown: {ROOT} is not a git checkout"
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return head + dirty


if __name__ == "__main__":
    sys.exit(main())
