"""The scheduler's step loop against N Generate streams on the CPU (issue 10): does the executor
get its next plan in time when the same process also streams every token to N clients?

The real Engine and GeneratorServicer on a local gRPC port; N streaming clients in another process;
in place of an executor, a simulated GPU: a step's result is ready `base + per_token x tokens`
milliseconds after the later of its plan's arrival and the previous step's end (the defaults, 4.5
ms + 23 us a token, are the H200's Llama-3-8B steps: ~10.4 ms for 256 decodes, ~28 ms for 1,024,
~190 ms for 8,192 prompt tokens). The GPU idles whenever a plan is late; the table gives that
idle time as a fraction of the run, the step loop's rate and the tokens streamed, and the
scheduler's own cost per step: CPU time of its event loop's thread (the step loop, the Generate
writers and grpc aio's callbacks all run there) and of its whole process, over the steps run.

    python -m benchmarks.bench_streams --streams 256 1024 --stream-interval 1 0

The public listener is the scheduler's own (build_servers): grpc behind the connection gate, or,
with `--gate off`, grpc on the TCP port itself; `--gate on off --repeat 5` gives the gate's cost
as the median of interleaved runs, with the round trip of a unary call (ModelInfo) each way.

No torch, no model, no tokenizer (token ids in, token ids out, as bench_serving sends them).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from protos import executor_pb2  # noqa: E402
from scheduler_svc import wire  # noqa: E402
from scheduler_svc.config import SchedulerConfig  # noqa: E402
from scheduler_svc.engine import Engine  # noqa: E402
from scheduler_svc.engine_types import EngineConfig  # noqa: E402
from scheduler_svc.executor_client import ExecutorLost  # noqa: E402
from scheduler_svc.main import freeze_startup_heap  # noqa: E402
from scheduler_svc.plan import StepPlan  # noqa: E402
from scheduler_svc.request import RequestLimits  # noqa: E402
from scheduler_svc.wire import ExecutorDescription  # noqa: E402

BLOCK_SIZE, VOCAB = 16, 128_000
REPLY_VARIANTS = 8  # sets of random tokens a run of steps over the same seqs cycles through
DESCRIPTION = ExecutorDescription(
    model_name="simulated", fingerprint="s" * 64, dtype="bfloat16", block_size=BLOCK_SIZE,
    num_gpu_blocks=200_000, num_cpu_blocks=0, max_model_len=4096, vocab_size=VOCAB,
    tokenizer="", backend="simulated", instance_id=1)


class SimulatedGpu:
    """The engine's executor link over a simulated GPU that runs one step at a time; plans are
    encoded and results decoded as over the real link (the executor's own host time is not
    simulated: the GPU starts a step as soon as its plan arrives)."""

    def __init__(self, base_ms: float, per_token_us: float, seed: int = 0) -> None:
        self.base_s, self.per_token_s = base_ms / 1e3, per_token_us / 1e6
        self.rng = random.Random(seed)
        self.addresses = ["simulated:0"]
        self.description = self.connected_address = self.fingerprint = None
        self.disconnected_since: float | None = time.monotonic()
        self._ready_at: dict[int, float] = {}  # step id -> when its result is ready
        self._gpu_free_at = 0.0
        self.idle_s = 0.0  # the GPU waiting for a plan, steps after the first
        self.busy_s = 0.0
        self.num_steps = 0
        self._replies: dict[tuple[int, ...], list[bytes]] = {}  # sampled seq ids -> replies
        self._num_replies = 0

    async def connect(self) -> ExecutorDescription:
        self.description, self.connected_address = DESCRIPTION, "simulated:0"
        self.fingerprint, self.disconnected_since = DESCRIPTION.fingerprint, None
        return DESCRIPTION

    async def connect_once(self) -> ExecutorDescription:
        return await self.connect()

    async def send(self, plan: StepPlan) -> None:
        wire.plan_to_proto(plan).SerializeToString()  # what the real link spends on it
        now = time.monotonic()
        if self.num_steps and now > self._gpu_free_at:
            self.idle_s += now - self._gpu_free_at
        start = max(now, self._gpu_free_at)
        seconds = self.base_s + self.per_token_s * plan.num_scheduled_tokens
        self._gpu_free_at = start + seconds
        self._ready_at[plan.step_id] = self._gpu_free_at
        self.busy_s += seconds
        self.num_steps += 1

    async def receive(self, plan: StepPlan) -> StepResult:
        ready_at = self._ready_at.pop(plan.step_id, None)
        if ready_at is None:
            raise ExecutorLost("no such step in flight")
        delay = ready_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        reply = (executor_pb2.StepResult(step_id=plan.step_id).SerializeToString()
                 + self._sampled_bytes(plan.sampling_seq_ids))  # as the executor sends it
        return wire.result_from_proto(executor_pb2.StepResult.FromString(reply))

    def _sampled_bytes(self, seq_ids: list[int]) -> bytes:
        """A result's sampled tokens, serialized: what the executor builds in its own process, so
        not charged to the scheduler's loop beyond the first few times (0.4 ms a step at 256
        seqs). A run of steps sampling the same seqs cycles through REPLY_VARIANTS sets of random
        tokens; a field appended to a message's bytes is merged into it when parsed."""
        key = tuple(seq_ids)
        variants = self._replies.get(key)
        if variants is None:
            if len(self._replies) > 64:
                self._replies.clear()
            variants = self._replies[key] = []
        if len(variants) < REPLY_VARIANTS:
            variants.append(executor_pb2.StepResult(sampled=executor_pb2.SampledTokens(
                seq_ids=seq_ids, token_ids=[self.rng.randrange(1, VOCAB) for _ in seq_ids]
            )).SerializeToString())
            return variants[-1]
        self._num_replies += 1
        return variants[self._num_replies % REPLY_VARIANTS]

    def lost(self, reason: str) -> ExecutorLost:
        self.disconnected_since = time.monotonic()
        return ExecutorLost(reason)

    async def close(self) -> None:
        self._ready_at.clear()


def _clients(address: str, num: int, prompt_len: int, max_tokens: int, out) -> None:
    """In its own process: `num` streams at once; sends back tokens received and the wall."""
    import grpc

    from protos import generate_pb2, generate_pb2_grpc

    async def run() -> tuple[int, float, list[float]]:
        rng = random.Random(1)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GeneratorStub(channel)

            async def one() -> tuple[int, float]:
                req = generate_pb2.GenerateRequest()
                req.token_ids.ids.extend(rng.randrange(1, VOCAB) for _ in range(prompt_len))
                req.stopping.max_tokens, req.stopping.ignore_eos = max_tokens, True
                start, first, tokens = time.perf_counter(), None, 0
                async for msg in stub.Generate(req):
                    if msg.token_ids and first is None:
                        first = time.perf_counter() - start
                    tokens += len(msg.token_ids)
                return tokens, first

            start = time.perf_counter()
            done = await asyncio.gather(*(one() for _ in range(num)))
            return sum(t for t, _ in done), time.perf_counter() - start, [f for _, f in done]

    out.send(asyncio.run(run()))


def _round_trips(address: str, num: int, out) -> None:
    """In its own process: `num` ModelInfo calls one after another; sends back their median."""
    import grpc

    from protos import generate_pb2, generate_pb2_grpc

    async def run() -> float:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GeneratorStub(channel)
            walls = []
            for _ in range(num):
                start = time.perf_counter()
                await stub.ModelInfo(generate_pb2.ModelInfoRequest())
                walls.append(time.perf_counter() - start)
            return statistics.median(walls)

    out.send(asyncio.run(run()))


def _in_process(target, *args):
    """What `target(*args, sender)` sends, run in a fresh process."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, sender))
    proc.start()
    return proc, receiver


async def _serve_and_measure(args, num_streams: int, interval: int, depth: int = 2,
                             gate: bool = True) -> dict:
    from scheduler_svc.connection_gate import GateLimits
    from scheduler_svc.server import Listeners, build_servers

    gpu = SimulatedGpu(args.base_ms, args.per_token_us)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=max(num_streams, 1)),
        stream_interval=interval, log_stats_interval_s=0.0, max_steps_in_flight=depth)
    engine = Engine(config, gpu)
    await engine.start()
    await engine.wait_ready()
    freeze_startup_heap()  # as scheduler_svc.main does once ready
    server, admin, _, port, _ = build_servers(engine, Listeners(
        public="127.0.0.1:0", admin="127.0.0.1:0", limits=RequestLimits(),
        gate=GateLimits() if gate else None))
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        clients, receiver = _in_process(_clients, address, num_streams, args.prompt_len,
                                        args.max_tokens)
        loop_cpu, process_cpu = time.thread_time(), time.process_time()
        while not receiver.poll():
            await asyncio.sleep(0.05)
        loop_cpu, process_cpu = time.thread_time() - loop_cpu, time.process_time() - process_cpu
        tokens, wall, ttfts = receiver.recv()
        clients.join(30)
        caller, receiver = _in_process(_round_trips, address, args.round_trips)
        while not receiver.poll():
            await asyncio.sleep(0.01)
        round_trip_s = receiver.recv()
        caller.join(30)
    finally:
        await server.stop(None)
        await admin.stop(None)
        await engine.stop()
    expected = num_streams * args.max_tokens
    return {"streams": num_streams, "stream_interval": interval, "steps_in_flight": depth,
            "gate": gate, "round_trip_s": round_trip_s, "tokens": tokens,
            "expected_tokens": expected, "wall_s": wall, "tok_s": tokens / wall,
            "steps": gpu.num_steps, "gpu_busy_s": gpu.busy_s, "gpu_idle_s": gpu.idle_s,
            "gpu_idle_frac": gpu.idle_s / max(gpu.idle_s + gpu.busy_s, 1e-9),
            "loop_cpu_ms_per_step": 1e3 * loop_cpu / max(gpu.num_steps, 1),
            "process_cpu_ms_per_step": 1e3 * process_cpu / max(gpu.num_steps, 1),
            "ttft_p50_s": statistics.median(t for t in ttfts if t is not None)}


def _row(args, num_streams: int, interval: int, depth: int, gate: bool, out) -> None:
    out.send(asyncio.run(_serve_and_measure(args, num_streams, interval, depth, gate)))


def measure(args, num_streams: int, interval: int, depth: int = 2, gate: bool = True) -> dict:
    """One row in a fresh process: grpc aio keeps state per process that a second event loop
    may trip over."""
    proc, receiver = _in_process(_row, args, num_streams, interval, depth, gate)
    try:
        return receiver.recv()
    finally:
        proc.join(30)


def median_row(rows: list[dict]) -> dict:
    """Each number the median of the repeats (the first row's for the others)."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(row[key] for row in rows)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--stream-interval", type=int, nargs="+", default=[1, 0],
                   help="the engine's stream_interval values to compare (0: adaptive)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--base-ms", type=float, default=4.5, help="simulated step: fixed part")
    p.add_argument("--per-token-us", type=float, default=23.0,
                   help="simulated step: per scheduled token")
    p.add_argument("--max-steps-in-flight", type=int, nargs="+", default=[2],
                   help="the engine's plans out at once, values to compare (the executor "
                        "launches two; a third waits in its inbox, as the simulated GPU's)")
    p.add_argument("--gate", nargs="+", choices=("on", "off"), default=["on"],
                   help="the public port behind the connection gate (the scheduler's), or grpc "
                        "on it directly; values to compare")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each row, interleaved across --gate; the table gives medians")
    p.add_argument("--round-trips", type=int, default=2000,
                   help="ModelInfo calls one after another, after the streams")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    print("| streams | stream interval | steps in flight | gate | tokens | steps | GPU idle "
          "(waiting for a plan) | streamed tok/s | TTFT p50 | scheduler CPU per step: loop "
          "thread, process | ModelInfo round trip p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for num_streams, interval, depth in itertools.product(args.streams, args.stream_interval,
                                                         args.max_steps_in_flight):
        runs: dict[str, list[dict]] = {gate: [] for gate in args.gate}
        for _, gate in itertools.product(range(args.repeat), args.gate):
            runs[gate].append(measure(args, num_streams, interval, depth, gate == "on"))
        for gate, repeats in runs.items():
            row = median_row(repeats)
            rows.append(row)
            print(f"| {num_streams} | {interval or 'adaptive'} | {depth} | {gate} | "
                  f"{row['tokens']} / {row['expected_tokens']} | {row['steps']} | "
                  f"{100 * row['gpu_idle_frac']:.1f}% ({row['gpu_idle_s']:.2f} s) | "
                  f"{row['tok_s']:.0f} | {1e3 * row['ttft_p50_s']:.0f} ms | "
                  f"{row['loop_cpu_ms_per_step']:.2f}, {row['process_cpu_ms_per_step']:.2f} ms | "
                  f"{1e3 * row['round_trip_s']:.3f} ms |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
