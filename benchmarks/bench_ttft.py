"""The fixed cost of one request through both services (issue 12): TTFT of single requests, one
after another, on one pair of services with prefix caching on and the prefix cached, so that the
model's forward (a tiny preset on the CPU backend: well under a millisecond) is a small part of
what is measured and the hops between the client, the scheduler and the executor are the rest.

    python -m benchmarks.bench_ttft --requests 200

bench_serving's prefix-ttft workload measures the same requests with caching off as well, on
a real model; this one only times the cached path, many times, for comparing code versions
(run it alternately from two checkouts: it starts the services from its working directory).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path.cwd()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.local_services import start_services  # noqa: E402


async def _time_requests(address: str, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Each prompt alone on one channel, the next once the previous has finished; TTFT each."""
    import grpc

    from protos import generate_pb2, generate_pb2_grpc

    ttfts = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GeneratorStub(channel)
        for prompt in prompts:
            req = generate_pb2.GenerateRequest()
            req.token_ids.ids.extend(prompt)
            req.stopping.max_tokens, req.stopping.ignore_eos = max_tokens, True
            start, first = time.perf_counter(), None
            async for msg in stub.Generate(req):
                if msg.token_ids and first is None:
                    first = time.perf_counter() - start
            ttfts.append(first)
    return ttfts


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def add_request_arguments(p: argparse.ArgumentParser, requests: int, warmup: int) -> None:
    """The services' model and backend, and the shape and count of the single requests."""
    p.add_argument("--model", default="preset:tiny")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--warmup", type=int, default=warmup, help="untimed requests after the prefix")


def make_prompts(args) -> tuple[list[int], list[list[int]]]:
    """The shared prefix, and the warm-up and timed prompts: the prefix and tokens of their own."""
    rng = random.Random(2)
    prefix = [rng.randrange(1, 30_000) for _ in range(args.prefix_tokens)]
    prompts = [prefix + [rng.randrange(1, 30_000) for _ in range(args.new_tokens)]
               for _ in range(args.warmup + args.requests)]
    return prefix, prompts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_request_arguments(p, requests=100, warmup=10)
    p.add_argument("--max-tokens", type=int, default=1,
                   help="tokens each timed request generates (above 1, the executor has the "
                        "next step's plan while it runs the first)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--json", default=None, help="write the TTFTs here")
    args = p.parse_args(argv)
    prefix, prompts = make_prompts(args)
    extra = ("--no-prefix-caching",) if args.no_prefix_caching else ()
    tmp = Path(tempfile.mkdtemp(prefix="bench_ttft_"))
    services = start_services(tmp, ["--model", args.model, "--backend", args.backend],
                              ["--max-num-batched-tokens", "4096", *extra])
    try:
        ttfts = asyncio.run(_time_requests(services.scheduler_address, [prefix] + prompts,
                                                 args.max_tokens))
        time.sleep(1.0)  # the executor logs its step timing after 0.5 s idle
        timing = re.findall(r"step timing (?:other|decode): .*", services.log_of("executor"))
    finally:
        services.stop()
    timed = ttfts[1 + args.warmup:]
    ms = [1e3 * t for t in timed]
    print(f"{ROOT}: {len(ms)} requests, TTFT median {statistics.median(ms):.2f} ms, "
          f"p10 {_pct(ms, 0.1):.2f}, p90 {_pct(ms, 0.9):.2f}, min {min(ms):.2f} ms", flush=True)
    # On a GPU: the executor's own host time (step_ms) and GPU time (gpu_ms) per step, of all
    # the steps (the prefix's and the warm-up's included); TTFT less step_ms is the services.
    for line in timing[-2:]:
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"root": str(ROOT), "ttft_s": timed}))


if __name__ == "__main__":
    main()
