"""Worker: builds backend, model, cache engine and model runner from an ExecutorConfig; what the
device needs before serving (GEMM tuning, a memory profile, graph capture, warm-up) it asks of the
backend. The gRPC servicer drives `worker.runner`. No gRPC or protobuf here.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from executor_svc.backends import get_backend
from executor_svc.cache_engine import CacheEngine, bytes_per_block, kv_cache_dtype, num_blocks_for
from executor_svc.config import ExecutorConfig
from executor_svc.cuda_graphs import BATCH_SIZES, TOKEN_SIZES
from executor_svc.fingerprint import model_fingerprint, start_source_identity, tokenizer_identity
from executor_svc.generation_config import read_generation_config
from executor_svc.model_loader import DTYPES, default_model_source, load_model
from executor_svc.model_runner import ModelRunner
from executor_svc.step import ExecutorInfo
from executor_svc.step_limits import (choose_step_limits, decode_graph_sizes, device_of,
                                      piecewise_graph_sizes, small_step_graph_sizes)
from executor_svc.structured_output import hf_tokenizer

log = logging.getLogger(__name__)

_DEFAULT_GPU_BLOCKS = 1024  # where neither the config nor the backend's profile sizes the cache
_MAX_MODEL_LEN_CAP = 4096


class Worker:
    """Builds and owns one ModelRunner (`runner`) and what went into it: `info` (what Describe
    answers), `step_limits` (the steps it recommends and is sized for; also in `info`),
    `cache_engine`, and `memory_profile` (None where the backend profiles none)."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.backend = get_backend(config.backend)
        source = config.model or default_model_source()
        dtype_name = config.resolved_dtype()
        self.dtype = DTYPES[dtype_name]
        kv_name = config.resolved_kv_cache_dtype()
        self.kv_cache_dtype = kv_cache_dtype(kv_name, self.dtype)
        self.backend.check_kv_cache_dtype(self.kv_cache_dtype)  # before minutes of loading
        self.model, self.model_config, tokenizer, name, fingerprint = self._load(source, self.dtype)
        mc = self.model_config
        self.block_bytes = bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                           config.block_size, self.kv_cache_dtype)
        max_model_len = config.max_model_len or min(mc.max_context, _MAX_MODEL_LEN_CAP)
        if max_model_len > mc.max_context:
            raise ValueError(f"max_model_len {max_model_len} > the model's {mc.max_context} "
                             "(max positions, or its sliding window: attention here is full)")
        self.model.set_max_model_len(max_model_len)  # LongRoPE's factor set follows it
        # What it recommends, and on a GPU the largest step everything below is sized for
        self.step_limits = choose_step_limits(device_of(self.backend.device), max_model_len,
                                              config.max_num_batched_tokens, config.max_num_seqs)
        self.backend.prepare_model(self.model, config.fingerprint_cache_dir,
                                   self.step_limits.max_num_batched_tokens)
        num_gpu_blocks = self._num_gpu_blocks()
        self.cache_engine = CacheEngine(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, num_gpu_blocks,
            num_blocks_for(config.swap_space_gib, self.block_bytes), self.kv_cache_dtype,
            self.backend,
        )
        self.info = ExecutorInfo(
            model_name=name,
            fingerprint=fingerprint,
            dtype=dtype_name,
            block_size=config.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=self.cache_engine.num_cpu_blocks,
            max_model_len=max_model_len,
            vocab_size=mc.vocab_size,
            tokenizer=tokenizer,
            generation_config=read_generation_config(source, mc.eos_token_ids),
            backend=self.backend.name,
            step_limits=self.step_limits,
            quantization=mc.quantization or "",
            kv_cache_dtype=kv_name,
        )
        self.runner = self._build_runner()
        self.backend.warm_up(self.runner)
        self._log_ready()

    def _load(self, source: str, dtype: torch.dtype):
        """(model, config, tokenizer source, name, fingerprint). The weight files are hashed in a
        background thread while they load (hashlib releases the GIL; the second read of each file
        comes from the page cache); --tokenizer replaces the model's tokenizer; warns when there is
        none."""
        identity = start_source_identity(source, self.config.fingerprint_cache_dir)
        model, model_config, tokenizer, name = load_model(
            source, dtype, self.backend.device, self.config.seed, self.backend,
            self.config.fingerprint_cache_dir)
        identity = identity.result()
        if self.config.tokenizer:
            tokenizer = str(Path(self.config.tokenizer).resolve())
            _check_tokenizer_fits(tokenizer, model_config.vocab_size)
            identity = {**identity, "tokenizer": tokenizer_identity(tokenizer)}
        if not tokenizer:
            log.warning("model %s has no tokenizer: only token-id prompts will work (text and "
                        "chat requests are refused)", name)
        quantized_kv = self.kv_cache_dtype != dtype
        fingerprint = model_fingerprint(model_config, identity, self.config.seed,
                                        self.backend.device, dtype,
                                        self.config.resolved_kv_cache_dtype() if quantized_kv
                                        else None)
        return model, model_config, tokenizer, name, fingerprint

    def _num_gpu_blocks(self) -> int:
        """The configured KV page count, else the backend's memory profile, else the default."""
        self.memory_profile = None
        if self.config.num_gpu_blocks is not None:
            return self.config.num_gpu_blocks or _DEFAULT_GPU_BLOCKS
        limits = self.step_limits
        # a step samples at most one row per seq, and has at most a seq per token
        self.memory_profile = self.backend.profile_num_blocks(
            self.model, self.config.block_size, self.block_bytes,
            self.config.gpu_memory_utilization, limits.max_num_batched_tokens,
            min(limits.max_num_seqs, limits.max_num_batched_tokens))
        if self.memory_profile is None:
            return _DEFAULT_GPU_BLOCKS
        return self.memory_profile.num_gpu_blocks

    def _build_runner(self) -> ModelRunner:
        """The runner, with the backend's graph runner unless enforce_eager (the sizes the step
        limits call for; `info` names those built); the graphs are captured once the runner
        exists, since the decode graphs count penalties in its rows."""
        graphs = None
        if not self.config.enforce_eager:
            max_blocks_per_seq = -(-self.info.max_model_len // self.config.block_size)
            graphs = self.backend.build_graphs(
                self.model, self.cache_engine.kv_caches, max_blocks_per_seq, self.dtype,
                decode_graph_sizes(self.step_limits, BATCH_SIZES),
                small_step_graph_sizes(self.step_limits, TOKEN_SIZES),
                grammars=bool(self.info.tokenizer),
                piece_sizes=piecewise_graph_sizes(self.step_limits, BATCH_SIZES))
        self.step_limits = replace(
            self.step_limits,
            decode_graph_sizes=graphs.batch_sizes if graphs is not None else (),
            small_step_graph_sizes=graphs.token_sizes if graphs is not None else ())
        self.info = replace(self.info, step_limits=self.step_limits)
        runner = ModelRunner(self.model, self.backend, self.cache_engine, self.info, graphs)
        if graphs is not None:
            graphs.capture(runner.input_batch.token_counts)
        return runner

    def _log_ready(self) -> None:
        info, cache, block_gib = self.info, self.cache_engine, self.block_bytes / 2**30
        decode_sizes = self.step_limits.decode_graph_sizes  # those captured
        token_sizes = self.step_limits.small_step_graph_sizes
        graphs = self.runner.graphs
        piecewise = graphs.piecewise if graphs is not None else None
        piece_sizes = piecewise.token_sizes if piecewise is not None else ()
        self._warn_unscaled_kv_cache()
        log.info("worker ready: %s, %s, attention %s, %d KV pages (%s, %s, %.1f GiB), %d CPU swap "
                 "pages (%.1f GiB%s), decode graphs %s, small-step graphs %s, piecewise graphs %s",
                 info.model_name,
                 info.dtype, self.backend.attention_impl(self.dtype, self.model_config.head_dim),
                 info.num_gpu_blocks, info.backend, info.kv_cache_dtype,
                 info.num_gpu_blocks * block_gib,
                 cache.num_cpu_blocks, cache.num_cpu_blocks * block_gib,
                 " pinned" if self.backend.pin_swap_memory else "",
                 decode_sizes or "off", f"{token_sizes} tokens" if token_sizes else "off",
                 f"{piece_sizes} tokens" if piece_sizes else "off")

    def _warn_unscaled_kv_cache(self) -> None:
        """vLLM's warning: an FP8 cache whose layers' scales are 1.0 (the checkpoint has none)
        saturates past 448 and loses small values."""
        if self.kv_cache_dtype == self.dtype:  # no FP8 cache: no scale read off the device
            return
        unscaled = [i for i, (k, v) in enumerate(self.model.kv_scales)
                    if float(k) == 1.0 and float(v) == 1.0]
        if unscaled:
            log.warning("FP8 KV cache with scales 1.0 in %d of %d layers: the checkpoint has no "
                        "k_scale / v_scale for them, which may cost accuracy (a compressed-tensors "
                        "kv_cache_scheme or an fp8 checkpoint's scales set them)", len(unscaled),
                        len(self.model.kv_scales))


def _check_tokenizer_fits(source: str, vocab_size: int) -> None:
    """--tokenizer's ids must all be rows of the model's logits (grammars mask over them)."""
    hf = hf_tokenizer(source)
    if len(hf) > vocab_size:
        raise ValueError(f"--tokenizer {source}: its {len(hf)} tokens do not fit the model's "
                         f"vocabulary of {vocab_size}")
