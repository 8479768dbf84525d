"""Where a cached-prefix request's time goes between the client, the scheduler and the executor
(issue 12): single requests one after another, as bench_ttft sends them, with both services
marking (time.monotonic_ns, one clock for the host's processes) the entry and exit of the
functions on the request's path. Prints, for each pair of consecutive marks, the median time
between them over the timed requests.

    python -m benchmarks.trace_ttft --requests 1000
    python -m benchmarks.trace_ttft --model preset:llama3-8b --backend cuda --requests 200

The marks are wrappers installed from a `sitecustomize` module put on the services' PYTHONPATH
for this run only (TRACE_POINTS names what is wrapped: a renamed function fails the run, not the
trace). Each mark is a line written to a file per process, a few microseconds; the medians
include them.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path.cwd()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (process, module, class or None, function, label, coroutine?)
TRACE_POINTS = (
    ("scheduler", "scheduler_svc.wire", None, "spec_from_proto", "S.spec", False),
    ("scheduler", "scheduler_svc.scheduler", "Scheduler", "add_seq", "S.admit", False),
    ("scheduler", "scheduler_svc.scheduler", "Scheduler", "schedule", "S.schedule", False),
    ("scheduler", "scheduler_svc.block_manager", "BlockManager", "find_cached_prefix",
     "S.find_prefix", False),
    ("scheduler", "scheduler_svc.wire", None, "plan_to_proto", "S.plan_to_proto", False),
    ("scheduler", "scheduler_svc.executor_client", "ExecutorClient", "send", "S.send", True),
    ("scheduler", "scheduler_svc.executor_client", "ExecutorClient", "receive", "S.receive",
     True),
    ("scheduler", "scheduler_svc.scheduler", "Scheduler", "update_from_output", "S.update",
     False),
    ("scheduler", "scheduler_svc.engine", "Engine", "_account", "S.account", False),
    ("scheduler", "scheduler_svc.output", "OutputProcessor", "process_outputs", "S.emit_step",
     False),
    ("scheduler", "scheduler_svc.output", "OutputProcessor", "finish", "S.finish", False),
    ("scheduler", "scheduler_svc.metrics", "Metrics", "observe_scheduler", "S.observe", False),
    ("scheduler", "scheduler_svc.wire", None, "events_to_protos", "S.events_to_protos", False),
    ("executor", "executor_svc.server", "ExecutorServicer", "_launch", "E.launch", False),
    ("executor", "executor_svc.wire", None, "plan_from_proto", "E.parse", False),
    ("executor", "executor_svc.server", "ExecutorServicer", "_finish", "E.finish", False),
    ("executor", "executor_svc.wire", None, "result_to_proto", "E.encode", False),
)

_SITECUSTOMIZE = '''
import functools, importlib, os, sys, threading, time
_out = open(os.environ["PAGEDSERVE_TRACE"] + "." + str(os.getpid()), "a", buffering=1)
_lock = threading.Lock()
def _mark(label):
    with _lock:
        _out.write(f"{time.monotonic_ns()} {label}\\n")
POINTS = %r
def _wrap(module, cls, name, label, is_async):
    owner = importlib.import_module(module)
    owner = getattr(owner, cls) if cls else owner
    inner = getattr(owner, name)
    if is_async:
        async def traced(*args, **kwargs):
            _mark(label + ">")
            try:
                return await inner(*args, **kwargs)
            finally:
                _mark(label + "<")
    else:
        def traced(*args, **kwargs):
            _mark(label + ">")
            try:
                return inner(*args, **kwargs)
            finally:
                _mark(label + "<")
    setattr(owner, name, functools.wraps(inner)(traced))
def _install():
    argv = " ".join(sys.orig_argv)
    process = "scheduler" if "scheduler_svc.main" in argv else (
        "executor" if "executor_svc.main" in argv else None)
    if process is None:
        return
    mine = [p[1:] for p in POINTS if p[0] == process]
    modules = {m for m, *_ in mine}
    for _ in range(1200):  # after the service's own imports (it serves seconds later)
        if modules <= set(sys.modules):
            break
        time.sleep(0.01)
    try:
        for point in mine:
            _wrap(*point)
        _mark("installed")
    except Exception as err:
        _mark("failed " + repr(err).replace(" ", "_"))
threading.Thread(target=_install, daemon=True).start()
'''


async def _send(address: str, prompts: list[list[int]], out) -> None:
    import grpc

    from protos import generate_pb2, generate_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GeneratorStub(channel)
        for prompt in prompts:
            req = generate_pb2.GenerateRequest()
            req.token_ids.ids.extend(prompt)
            req.stopping.max_tokens, req.stopping.ignore_eos = 1, True
            out.write(f"{time.monotonic_ns()} C.send\n")
            first = True
            async for msg in stub.Generate(req):
                if first and msg.token_ids:
                    out.write(f"{time.monotonic_ns()} C.first\n")
                    first = False
            out.write(f"{time.monotonic_ns()} C.end\n")


def read_marks(prefix: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """Every process's marks in time order, and the install lines ('installed' or the error)."""
    marks, installs = [], []
    for path in prefix.parent.glob(prefix.name + ".*"):
        for line in path.read_text().splitlines():
            t, label = line.split(" ", 1)
            if label == "installed" or label.startswith("failed"):
                installs.append(label)
            else:
                marks.append((int(t), label))
    return sorted(marks), installs


def breakdown(marks: list[tuple[int, str]], skip: int) -> tuple[list[tuple[str, str, float, int]],
                                                                 float]:
    """Per request (from one C.send to the next), each label's first mark; for consecutive
    marks of the usual order, the median microseconds between them and how many requests had
    that pair; and the median TTFT (C.send to C.first) in microseconds."""
    requests, current = [], None
    for t, label in marks:
        if label == "C.send":
            current = {}
            requests.append(current)
        if current is not None:
            current.setdefault(label, t)
    requests = [r for r in requests[skip:] if "C.first" in r]
    gaps = collections.defaultdict(list)
    for r in requests:
        order = sorted(r, key=r.get)
        for a, b in zip(order, order[1:]):
            gaps[(a, b)].append((r[b] - r[a]) / 1e3)
    typical = requests[len(requests) // 2]
    order = sorted(typical, key=typical.get)
    rows = [(a, b, statistics.median(gaps[(a, b)]), len(gaps[(a, b)]))
            for a, b in zip(order, order[1:])]
    ttft = statistics.median((r["C.first"] - r["C.send"]) / 1e3 for r in requests)
    return rows, ttft


def put_sitecustomize(folder: Path, text: str, root: Path) -> None:
    """`text` becomes the sitecustomize of the Python processes started from here on (the
    services): written to `folder`, which goes first on PYTHONPATH, `root` (the repository)
    next."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(text)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(folder), str(root), *filter(None, [os.environ.get("PYTHONPATH")])])


def main(argv: list[str] | None = None) -> None:
    from benchmarks.bench_ttft import add_request_arguments, make_prompts
    from scripts.local_services import start_services

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_request_arguments(p, requests=1000, warmup=50)
    args = p.parse_args(argv)
    prefix, prompts = make_prompts(args)
    tmp = Path(tempfile.mkdtemp(prefix="trace_ttft_"))
    put_sitecustomize(tmp / "site", _SITECUSTOMIZE % (TRACE_POINTS,), ROOT)
    prefix_path = tmp / "marks"
    os.environ["PAGEDSERVE_TRACE"] = str(prefix_path)
    services = start_services(tmp, ["--model", args.model, "--backend", args.backend],
                              ["--max-num-batched-tokens", "4096"])
    try:
        with open(f"{prefix_path}.client", "w", buffering=1) as out:
            asyncio.run(_send(services.scheduler_address, [prefix] + prompts, out))
    finally:
        services.stop()
    marks, installs = read_marks(prefix_path)
    if sorted(installs) != ["installed", "installed"]:
        raise SystemExit(f"trace points not installed in both services: {installs}")
    rows, ttft = breakdown(marks, skip=1 + args.warmup)
    print(f"{args.requests} requests ({args.model}, {args.backend}), a {args.prefix_tokens}-token "
          f"prefix + {args.new_tokens}: TTFT median {ttft:.0f} us; between marks (median us, "
          f"requests with that pair):")
    for a, b, us, n in rows:
        print(f"  {a:>22} -> {b:<22} {us:9.1f}  ({n})")


if __name__ == "__main__":
    main()
