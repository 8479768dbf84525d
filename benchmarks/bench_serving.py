"""Serving benchmark (BENCHMARK.md W1/W2/W3, RESULTS.md W4): both services on this machine's GPU,
every request submitted at once through the public gRPC Generate API (or, with --api http, the
OpenAI completions endpoint, streamed), then the Hugging Face `generate` baseline on the same random
weights, in one command. Prints throughput, TTFT/ITL percentiles, peak KV pages, preemptions,
swapped pages, the prefix cache's hit rate, the executor's GPU-wait share of decode steps, and the
ratio.

    python -m benchmarks.bench_serving --workload W1 --out results.json

Lengths come from random.Random(0) request by request (prompt, then output); prompt ids from a
separate random.Random(1) so that the lengths are exactly BENCHMARK.md's. W4 (conversations.py)
runs in rounds: every conversation's turn k at once, then turn k + 1, whose prompts hold the
outputs of turn k; no HF baseline. `--workload prefix-ttft` starts the services twice, prefix
caching on then off, and times single requests whose long prefix is (or would be) cached.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.conversations import (ConversationRounds, ConversationsSpec,  # noqa: E402
                                      percentile, spec_from_args, turn_lengths)
from benchmarks.conversations import add_arguments as add_conversation_arguments  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402
from scripts.local_services import start_services  # noqa: E402

# Per-workload defaults of --max-num-seqs and --swap-space. W3 admits up to 512 sequences: at 256,
# 256 x ~2,400 tokens fit in the ~110 GB cache and nothing would ever be preempted; 512 prompts of
# ~1,800 tokens fill it, and their growth forces preemption. Its swap space holds ~100 of them.
# W2 admits vLLM's default of 1,024: on the H200 at 0c081c1, 9,170 output tok/s against 8,517 at
# 256 in one call (W1's 256 requests are all admitted either way).
WORKLOAD_DEFAULTS = {"W1": (256, 4.0), "W2": (1024, 4.0), "W3": (512, 32.0), "W4": (256, 4.0),
                     "prefix-ttft": (256, 4.0), "decode-heavy": (512, 4.0)}
CONVERSATION_WORKLOADS = ("W4",)  # run in rounds (conversations.py)
PREFIX_TTFT = "prefix-ttft"
# Timed requests per mode. Ten gave medians 10.0-10.8 ms cached between calls on the H200 with the
# same GPU work (the host's part moves them); fifty cost ~3 s more (caching off: ~52 ms each).
PREFIX_TTFT_REQUESTS = 50


def make_requests(workload: str, vocab: int) -> list[tuple[list[int], int]]:
    n, prompt_lengths, output_lengths = WORKLOADS[workload]
    return draw_requests((prompt_lengths, output_lengths), n, vocab, ids_seed=1)


def draw_requests(lengths, num_requests: int, vocab: int, ids_seed: int | str
                  ) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: lengths from random.Random(0), prompt then output,
    request by request; ids from random.Random(ids_seed) in [1, vocab)."""
    (p_lo, p_hi), (o_lo, o_hi) = lengths
    lengths_rng, ids_rng = random.Random(0), random.Random(ids_seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = lengths_rng.randint(p_lo, p_hi)
        output_len = lengths_rng.randint(o_lo, o_hi)
        requests.append(([ids_rng.randrange(1, vocab) for _ in range(prompt_len)], output_len))
    return requests


@dataclass
class Trace:
    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None


async def _one(stub, prompt: list[int], max_tokens: int, trace: Trace) -> None:
    from protos import generate_pb2

    req = generate_pb2.GenerateRequest()
    req.token_ids.ids.extend(prompt)
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    trace.submitted = time.perf_counter()
    try:
        async for msg in stub.Generate(req):
            if msg.finished:
                trace.completion_tokens = msg.completion_tokens
            else:
                now = time.perf_counter()  # a message may carry several tokens (a slow reader)
                trace.token_times.extend(now for _ in msg.token_ids)
                trace.token_ids.extend(msg.token_ids)
    except Exception as err:  # reported, never hides a lost request
        trace.error = repr(err)


async def _one_http(client, url: str, model: str, prompt: list[int], max_tokens: int,
                    trace: Trace) -> None:
    """One streamed /v1/completions request; a token is each chunk without a finish reason (the
    server sends one per token, its text maybe empty), the count from the usage chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    trace.submitted = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if '"finish_reason":null' in line:  # cheaper than parsing every chunk
                    trace.token_times.append(time.perf_counter())
                elif '"usage":{' in line:
                    trace.completion_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    except Exception as err:  # reported, never hides a lost request
        trace.error = repr(err)


async def _run_all(services, requests, time_limit: float, api: str
                   ) -> tuple[list[Trace], float, bool]:
    async with _client(services, api) as submit:
        start = time.perf_counter()
        traces, timed_out = await _submit_all(submit, requests, time_limit)
    return traces, start, timed_out


async def _run_rounds(services, rounds: ConversationRounds, time_limit: float
                      ) -> tuple[list[Trace], float, bool, list[float]]:
    """Each round's requests at once, the next round once all are done; the traces in round
    order, the start, whether the time limit cut the run short, and each round's wall time."""
    traces, round_walls, timed_out = [], [], False
    async with _client(services, "grpc") as submit:
        start = time.perf_counter()
        for k in range(rounds.spec.turns):
            round_start = time.perf_counter()
            done, timed_out = await _submit_all(submit, rounds.requests(k),
                                                start + time_limit - round_start)
            traces += done
            round_walls.append(time.perf_counter() - round_start)
            if timed_out:
                break
            rounds.add_outputs(k, [t.token_ids for t in done])
    return traces, start, timed_out, round_walls


async def _run_one_by_one(services, prompts: list[list[int]], max_tokens: int) -> list[Trace]:
    """Each prompt alone, the next once the previous has finished."""
    traces = [Trace() for _ in prompts]
    async with _client(services, "grpc") as submit:
        for prompt, trace in zip(prompts, traces):
            await submit(prompt, max_tokens, trace)
    return traces


async def _submit_all(submit, requests, timeout: float) -> tuple[list[Trace], bool]:
    """Submits every (prompt, max_tokens) at once and waits up to `timeout` seconds for all;
    the traces, and whether any request was cancelled at the time limit."""
    traces = [Trace() for _ in requests]
    tasks = [asyncio.ensure_future(submit(p, o, t)) for (p, o), t in zip(requests, traces)]
    _, pending = await asyncio.wait(tasks, timeout=max(timeout, 0.0))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return traces, bool(pending)


@contextlib.asynccontextmanager
async def _client(services, api: str):
    """A function submitting one request through `api` ("grpc" or "http") and tracing it."""
    if api == "grpc":
        import grpc

        from protos import generate_pb2_grpc

        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(services.scheduler_address, options=options) as ch:
            stub = generate_pb2_grpc.GeneratorStub(ch)
            yield lambda prompt, max_tokens, trace: _one(stub, prompt, max_tokens, trace)
        return
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        url = services.http_url
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        yield lambda prompt, max_tokens, trace: _one_http(client, url, model, prompt, max_tokens,
                                                          trace)


class PeakSampler(threading.Thread):
    """Polls the scheduler's metrics for the peak of GPU pages in use."""

    def __init__(self, services, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.services, self.period = services, period
        self.peak_gpu_blocks = 0.0
        self.peak_cpu_blocks = 0.0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                m = self.services.metrics()
                self.peak_gpu_blocks = max(self.peak_gpu_blocks, m.get("pagedserve_gpu_blocks_used", 0))
                self.peak_cpu_blocks = max(self.peak_cpu_blocks, m.get("pagedserve_cpu_blocks_used", 0))
            except Exception:
                pass
            self.stop_event.wait(self.period)

    def __enter__(self) -> PeakSampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.join()


def _step_timing(executor_log: str) -> dict:
    """The executor's last cumulative 'step timing' lines (see executor_svc/step_timing.py)."""
    out = {}
    for kind in ("decode", "other", "allocator"):
        lines = re.findall(rf"step timing {kind}: (.*)", executor_log)
        if lines:
            out[kind] = {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.e+-]+)", lines[-1])}
    return out


@dataclass
class Run:
    """What a run on started services leaves behind for its summary."""

    startup_s: float
    metrics: dict = field(default_factory=dict)
    executor_log: str = ""


@contextlib.contextmanager
def _services(args, name: str, scheduler_extra: tuple[str, ...] = ()):
    """Both services for one run, then (on leaving) their metrics and executor log in the Run."""
    # Logs go straight to --log-dir, so that they survive a run stopped by a time limit.
    if args.log_dir:
        tmp = Path(args.log_dir) / name
        tmp.mkdir(parents=True, exist_ok=True)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    executor_args = ["--model", args.model, "--backend", args.backend,
                     "--swap-space", str(args.swap_space),
                     "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.max_model_len:
        executor_args += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_dtype:
        executor_args += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.gpu_memory_utilization:
        executor_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    scheduler_args = ["--max-num-batched-tokens", str(args.max_num_batched_tokens),
                      "--max-num-seqs", str(args.max_num_seqs),
                      "--max-steps-in-flight", str(args.max_steps_in_flight), *scheduler_extra]
    t0 = time.perf_counter()
    services = start_services(tmp, executor_args, scheduler_args)
    run = Run(startup_s=time.perf_counter() - t0)
    print(f"services ready in {run.startup_s:.0f}s", flush=True)
    try:
        yield services, run
        run.metrics = services.metrics()
        # The executor logs the step timing of a burst's last steps once it has been idle for
        # 0.5 s (executor_svc/step_pipeline.py): wait for that line.
        time.sleep(1.0)
        run.executor_log = services.log_of("executor")
    finally:
        services.stop()


def _caching(args) -> tuple[str, ...]:
    return ("--no-prefix-caching",) if args.no_prefix_caching else ()


def run_serving(args, requests) -> dict:
    with _services(args, args.workload, _caching(args)) as (services, run), \
            PeakSampler(services) as peak:
        print(f"submitting {len(requests)} requests", flush=True)
        traces, start, timed_out = asyncio.run(_run_all(services, requests, args.time_limit,
                                                        args.api))
        print(f"serving done in {time.perf_counter() - start:.0f}s (timed out: {timed_out})",
              flush=True)
    return _summary(traces, [o for _, o in requests], start, timed_out, run, peak)


def run_conversations(args, spec: ConversationsSpec, vocab: int) -> dict:
    """W4: the rounds of `spec`'s conversations on one pair of services."""
    rounds = ConversationRounds(spec, vocab)
    with _services(args, args.workload, _caching(args)) as (services, run), \
            PeakSampler(services) as peak:
        print(f"{spec.turns} rounds of {spec.conversations} requests", flush=True)
        traces, start, timed_out, round_walls = asyncio.run(
            _run_rounds(services, rounds, args.time_limit))
        print(f"serving done in {time.perf_counter() - start:.0f}s (timed out: {timed_out})",
              flush=True)
    outputs = [turns[k].output_len for k in range(spec.turns) for turns in rounds.conversations]
    serving = _summary(traces, outputs, start, timed_out, run, peak)
    serving.update(conversations=spec.conversations, turns=spec.turns,
                   system_tokens=spec.system_tokens, rounds_done=rounds.num_rounds_done,
                   round_wall_s=round_walls)
    return serving


def _summary(traces: list[Trace], outputs: list[int], start: float, timed_out: bool, run: Run,
             peak: PeakSampler) -> dict:
    """The serving figures; `outputs` are the expected output lengths of the whole workload,
    `traces` those of the requests submitted, in the same order."""
    metrics, executor_log = run.metrics, run.executor_log
    ends = [t.token_times[-1] for t in traces if t.token_times]
    wall = (max(ends) if ends else time.perf_counter()) - start
    useful = sum(len(t.token_times) for t in traces)
    ttft = _ttfts(traces)
    itl = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
    complete = sum(1 for t, o in zip(traces, outputs)
                   if len(t.token_times) == o and t.error is None)
    info = re.search(r"worker ready: (.*)", executor_log)
    return {
        "requests": len(outputs), "complete": complete, "timed_out": timed_out,
        "errors": sorted({t.error for t in traces if t.error})[:3],
        "output_tokens": useful, "expected_output_tokens": sum(outputs),
        "wall_s": wall, "output_tok_s": useful / wall if wall > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "peak_gpu_blocks": peak.peak_gpu_blocks, "gpu_blocks_total": metrics.get("pagedserve_gpu_blocks_total"),
        "peak_cpu_blocks": peak.peak_cpu_blocks,
        "preemptions_swap": metrics.get('pagedserve_preemptions_total{mode="swap"}', 0.0),
        "preemptions_recompute": metrics.get('pagedserve_preemptions_total{mode="recompute"}',
                                             0.0),
        "blocks_swapped_out": metrics.get('pagedserve_blocks_swapped_total{direction="out"}', 0.0),
        "blocks_swapped_in": metrics.get('pagedserve_blocks_swapped_total{direction="in"}', 0.0),
        **_prefix_cache(metrics),
        "scheduler_steps": metrics.get("pagedserve_steps_total", metrics.get("pagedserve_steps")),
        "executor_step_timing": _step_timing(executor_log),
        "executor": info.group(1) if info else None,
        "startup_s": run.startup_s,
    }


def _ttfts(traces: list[Trace]) -> list[float]:
    return [t.token_times[0] - t.submitted for t in traces if t.token_times]


def _prefix_cache(metrics: dict) -> dict:
    """Prompt tokens the scheduler looked up in the prefix cache, those it found, and the rate."""
    queries = metrics.get("pagedserve_prefix_cache_queries_total", 0.0)
    hits = metrics.get("pagedserve_prefix_cache_hits_total", 0.0)
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0}


def run_prefix_ttft(args, vocab: int) -> dict:
    """TTFT of single requests, one after another, each a `--system-tokens` prefix and
    `--new-tokens` tokens of its own, after one request of the prefix alone (which also warms
    the services up): prefix caching on (the prefix is cached by then), then off. The ratio is
    off's TTFT median over on's; the hit rates are the timed requests'."""
    ids_rng = random.Random(2)
    prefix_len = args.system_tokens or ConversationsSpec.system_tokens
    prefix = [ids_rng.randrange(1, vocab) for _ in range(prefix_len)]
    prompts = [prefix + [ids_rng.randrange(1, vocab) for _ in range(args.new_tokens)]
               for _ in range(args.num_requests or PREFIX_TTFT_REQUESTS)]
    result = {"prefix_tokens": len(prefix), "new_tokens": args.new_tokens,
              "requests": len(prompts)}
    for name, extra in (("cached", ()), ("uncached", ("--no-prefix-caching",))):
        result[name] = _time_prefix(args, name, extra, prefix, prompts)
    on, off = result["cached"]["ttft_p50_s"], result["uncached"]["ttft_p50_s"]
    result["ratio"] = off / on if on and off else None
    return result


def _time_prefix(args, name: str, scheduler_extra: tuple[str, ...], prefix: list[int],
                 prompts: list[list[int]]) -> dict:
    """prefix-ttft on one pair of services: the prefix alone, then the timed prompts."""
    with _services(args, f"{PREFIX_TTFT}-{name}", scheduler_extra) as (services, run):
        warm = asyncio.run(_run_one_by_one(services, [prefix], max_tokens=1))
        before = services.metrics()
        traces = asyncio.run(_run_one_by_one(services, prompts, max_tokens=1))
    ttft = _ttfts(traces)
    since_warm = {k: v - before.get(k, 0.0) for k, v in run.metrics.items()}
    return {"ttft_s": ttft, "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "warm_ttft_s": (_ttfts(warm) or [None])[0],
            "errors": sorted({t.error for t in warm + traces if t.error})[:3],
            **_prefix_cache(since_warm), "startup_s": run.startup_s}


def run_hf(args, requests) -> dict:
    """transformers generate, static batches in request order, left padding, every sequence of a
    batch generating the batch's longest output; only each request's own tokens count."""
    import torch
    from transformers import GenerationConfig

    from executor_svc.model_loader import build_hf_model

    device = "cuda" if args.backend == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_hf_model(args.model.removeprefix("preset:"), seed=0, dtype=dtype, device=device)
    batches = [requests[i:i + args.hf_batch_size]
               for i in range(0, len(requests), args.hf_batch_size)][:args.hf_batches]
    useful, seconds = 0, 0.0
    for batch in batches:
        longest = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        new = max(o for _, o in batch)
        gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=gen)
        _sync(device)
        seconds += time.perf_counter() - t0
        useful += sum(o for _, o in batch)
        print(f"hf batch of {len(batch)}: {new} new tokens, {time.perf_counter() - t0:.1f}s",
              flush=True)
    del model
    _sync(device)
    return {"batches": len(batches), "batch_size": args.hf_batch_size, "output_tokens": useful,
            "seconds": seconds, "output_tok_s": useful / seconds if seconds else 0.0}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _fmt(serving: dict, hf: dict | None) -> str:
    timing = serving["executor_step_timing"].get("decode", {})
    lines = [
        f"requests complete      {serving['complete']}/{serving['requests']}"
        + (" (TIMED OUT)" if serving["timed_out"] else ""),
        f"output tokens          {serving['output_tokens']} / {serving['expected_output_tokens']}",
        f"wall                   {serving['wall_s']:.1f} s",
        f"output tokens/s        {serving['output_tok_s']:.0f}",
        f"TTFT p50 / p99         {serving['ttft_p50_s']:.2f} / {serving['ttft_p99_s']:.2f} s",
        f"ITL p50 / p99          {serving['itl_p50_ms']:.1f} / {serving['itl_p99_ms']:.1f} ms",
        f"peak KV pages          {serving['peak_gpu_blocks']:.0f} of {serving['gpu_blocks_total']}",
        f"prefix cache hit rate  {serving['prefix_cache_hit_rate']:.1%} "
        f"({serving['prefix_cache_hits']:.0f} of {serving['prefix_cache_queries']:.0f} prompt "
        f"tokens)",
        f"preemptions swap/recompute {serving['preemptions_swap']:.0f} / "
        f"{serving['preemptions_recompute']:.0f}; pages out/in {serving['blocks_swapped_out']:.0f} / "
        f"{serving['blocks_swapped_in']:.0f}",
        f"decode steps (executor) {timing.get('steps', 0):.0f}: wall {timing.get('wall_ms', 0):.2f} ms, "
        f"gap between steps {timing.get('gap_ms', 0):.2f} ms, host step {timing.get('step_ms', 0):.2f} ms "
        f"(launch {timing.get('launch_ms', 0):.2f} ms), "
        f"GPU {timing.get('gpu_ms', 0):.2f} ms -> GPU waits for host "
        f"{100 * timing.get('gpu_wait_frac', 0):.1f}% of each decode step",
    ]
    other = serving["executor_step_timing"].get("other")
    if other:
        lines.append(f"other steps (executor) {other.get('steps', 0):.0f}: wall "
                     f"{other.get('wall_ms', 0):.2f} ms, gap {other.get('gap_ms', 0):.2f} ms, "
                     f"launch {other.get('launch_ms', 0):.2f} ms, GPU {other.get('gpu_ms', 0):.2f} ms")
    allocator = serving["executor_step_timing"].get("allocator")
    if allocator:  # a retry frees the cache (cudaFree syncs the device) inside a launch
        lines.append(f"allocator              {allocator.get('alloc_retries', 0):.0f} retries, "
                     f"{allocator.get('device_allocs', 0):.0f} device allocations, "
                     f"{allocator.get('device_frees', 0):.0f} frees")
    if "round_wall_s" in serving:
        lines.insert(3, f"rounds                 {serving['rounds_done']} of {serving['turns']} "
                        f"({serving['conversations']} conversations): "
                        + ", ".join(f"{w:.1f}" for w in serving["round_wall_s"]) + " s")
    if hf:
        lines.append(f"HF generate            {hf['output_tok_s']:.0f} tok/s "
                     f"({hf['batches']} batch(es) of {hf['batch_size']}"
                     + (f", from {hf['from']}" if "from" in hf else "") + ")")
        lines.append(f"ratio to HF            {serving['output_tok_s'] / hf['output_tok_s']:.1f}x")
    return "\n".join(lines)


def _fmt_prefix_ttft(result: dict) -> str:
    on, off = result["cached"], result["uncached"]
    ms = (lambda x: f"{x * 1e3:.1f} ms" if x is not None else "n/a")
    return "\n".join([
        f"{result['requests']} single requests of a {result['prefix_tokens']}-token prefix + "
        f"{result['new_tokens']} new tokens, one after another",
        f"TTFT median, prefix cached      {ms(on['ttft_p50_s'])} "
        f"(hit rate {on['prefix_cache_hit_rate']:.1%})",
        f"TTFT median, caching off        {ms(off['ttft_p50_s'])} "
        f"(hit rate {off['prefix_cache_hit_rate']:.1%})",
        "ratio (off / cached)            "
        + (f"{result['ratio']:.1f}x" if result["ratio"] else "n/a"),
    ])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W1",
                   choices=[*sorted(WORKLOADS), *CONVERSATION_WORKLOADS, PREFIX_TTFT])
    p.add_argument("--model", default="preset:llama3-8b",
                   help="preset:NAME or a model folder (its config.json gives the prompts' "
                        "vocabulary; quant_folder.py writes quantized ones)")
    p.add_argument("--backend", default="cuda", help="executor backend (cpu: a smoke test)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="only the first N requests (prefix-ttft: N timed requests, default "
                        f"{PREFIX_TTFT_REQUESTS})")
    p.add_argument("--api", choices=("grpc", "http"), default="grpc",
                   help="submit through the gRPC Generate API or the OpenAI completions endpoint "
                        "(streamed; needs httpx; W1-W3 only)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget of a step, both services (offline throughput: 8192 beat "
                        "2048 by 10%% on W1; the services' own default, 2048, favours latency)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: 256 (W1, W4), 1024 (W2), 512 (W3)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the executor's --max-model-len; default: its own (the model's length "
                        "up to 4096), or 8192 for a W4 whose turns pass 4096 tokens (the full "
                        "W4 reaches 5,115; vllm_w4.py runs vLLM at 8192)")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="the executor's --kv-cache-dtype (default: its own, the model's dtype)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="the executor's --gpu-memory-utilization (default: its own)")
    p.add_argument("--swap-space", type=float, default=None,
                   help="executor swap space, GiB; default: 4 (W1, W2, W4), 32 (W3)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="the scheduler's flag (prefix-ttft runs with caching on and off anyway)")
    p.add_argument("--max-steps-in-flight", type=int, default=2, choices=[1, 2, 3],
                   help="the scheduler's flag: plans out at once (its default, 2)")
    p.add_argument("--time-limit", type=float, default=300.0,
                   help="seconds for the serving run; unfinished requests are cancelled")
    add_conversation_arguments(p)  # W4's; --system-tokens is prefix-ttft's prefix too
    p.add_argument("--new-tokens", type=int, default=16,
                   help="prefix-ttft: each timed request's own tokens after the prefix, which "
                        "is --system-tokens long")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--hf-batches", type=int, default=None,
                   help="run only the first N HF batches (its rate is per batch; default all)")
    p.add_argument("--skip-hf", action="store_true", help="(W4 and prefix-ttft have no HF run)")
    p.add_argument("--hf-from", default=None,
                   help="take the HF baseline from this earlier --out JSON (W2 uses W1's rate)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--log-dir", default=None, help="copy the services' logs here")
    args = p.parse_args(argv)
    if args.api == "http" and args.workload not in WORKLOADS:
        p.error("--api http: W1-W3 only (W4 feeds outputs back as token ids; prefix-ttft "
                "times gRPC)")
    seqs, swap = WORKLOAD_DEFAULTS[args.workload]
    if args.max_model_len is None and args.workload in CONVERSATION_WORKLOADS:
        lengths = turn_lengths(spec_from_args(args), vocab=2)  # lengths only: any vocab
        if max(p + o for row in lengths for p, o in row) > 4096:  # the executor's default cap
            args.max_model_len = 8192
    args.max_num_seqs = args.max_num_seqs or seqs
    args.swap_space = swap if args.swap_space is None else args.swap_space
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    vocab = model_vocab(args.model)
    hf = None
    if args.workload == PREFIX_TTFT:
        serving = run_prefix_ttft(args, vocab)
    elif args.workload in CONVERSATION_WORKLOADS:
        serving = run_conversations(args, spec_from_args(args), vocab)
    else:
        requests = make_requests(args.workload, vocab)[:args.num_requests]
        serving = run_serving(args, requests)
        hf = _hf_baseline(args, requests)
    print(json.dumps(serving, indent=1), flush=True)
    result = {"workload": args.workload, "date": time.strftime("%Y-%m-%d"), "serving": serving,
              "hf": hf, "args": vars(args)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"== {args.workload} through {args.api}: {args.model} ==")
    print(_fmt_prefix_ttft(serving) if args.workload == PREFIX_TTFT else _fmt(serving, hf))


def model_vocab(model: str) -> int:
    """The vocabulary prompt ids are drawn below: a preset's, or a folder's config.json's."""
    if model.startswith("preset:"):
        from executor_svc.model_config import preset_hf_config

        return preset_hf_config(model.removeprefix("preset:")).vocab_size
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def _hf_baseline(args, requests) -> dict | None:
    if args.hf_from:
        hf = json.loads(Path(args.hf_from).read_text())["hf"]
        hf["from"] = args.hf_from
        return hf
    return None if args.skip_hf else run_hf(args, requests)


if __name__ == "__main__":
    main()
