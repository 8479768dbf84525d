"""Worker: builds backend, model, cache engine and model runner from an ExecutorConfig. On cuda it
also sizes the KV cache from a memory profile, captures the decode graphs and warms every path
before the server reports ready. The gRPC servicer drives `worker.runner`. No gRPC or protobuf here.
"""
from __future__ import annotations

import logging

import torch

from executor_svc.backends import get_backend
from executor_svc.cache_engine import CacheEngine, bytes_per_block, num_blocks_for
from executor_svc.config import ExecutorConfig
from executor_svc.cuda_graphs import BATCH_SIZES, DecodeGraphs
from executor_svc.memory_profile import profile_num_gpu_blocks
from executor_svc.fingerprint import model_fingerprint, start_source_identity
from executor_svc.model_loader import DTYPES, default_model_source, load_model
from executor_svc.model_runner import ModelRunner
from executor_svc.small_step_graphs import SmallStepGraphs
from executor_svc.step import CachedSeqs, ExecutorInfo, NewSeq, SamplingOptions, StepPlan

log = logging.getLogger(__name__)

_CPU_DEFAULT_GPU_BLOCKS = 1024
_MAX_MODEL_LEN_CAP = 4096
# Step sizes tuned between the decode graphs' largest batch and the step budget: rungs for the
# products of eager steps with more rows than a graph
_STEP_RUNGS = (2048, 4096)


class Worker:
    """Builds and owns one ModelRunner (`runner`) and what went into it: `info` (what Describe
    answers), `cache_engine`, and on cuda `memory_profile`."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.backend = get_backend(config.backend)
        source = config.model or default_model_source()
        dtype_name = config.resolved_dtype()
        dtype = DTYPES[dtype_name]
        self.model, self.model_config, tokenizer, name, fingerprint = self._load(source, dtype)
        mc = self.model_config
        block_bytes = bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                      config.block_size, dtype)
        max_model_len = config.max_model_len or min(mc.max_context, _MAX_MODEL_LEN_CAP)
        if max_model_len > mc.max_context:
            raise ValueError(f"max_model_len {max_model_len} > the model's {mc.max_context} "
                             "(max positions, or its sliding window: attention here is full)")
        self.model.set_max_model_len(max_model_len)  # LongRoPE's factor set follows it
        if self.backend.name == "cuda":
            self._tune_linears()
        self.memory_profile = None
        num_gpu_blocks = config.num_gpu_blocks
        if num_gpu_blocks is None and self.backend.name == "cuda":
            self.memory_profile = profile_num_gpu_blocks(
                self.model, config.block_size, block_bytes, config.gpu_memory_utilization,
                config.max_num_batched_tokens, BATCH_SIZES[-1], self.backend.device)
            num_gpu_blocks = self.memory_profile.num_gpu_blocks
        num_gpu_blocks = num_gpu_blocks or _CPU_DEFAULT_GPU_BLOCKS
        self.cache_engine = CacheEngine(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, num_gpu_blocks,
            num_blocks_for(config.swap_space_gib, block_bytes), dtype, self.backend,
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
            backend=self.backend.name,
        )
        graphs = small_graphs = None
        if self.backend.name == "cuda" and not config.enforce_eager:
            max_blocks_per_seq = -(-max_model_len // config.block_size)
            graphs = DecodeGraphs(self.model, self.cache_engine.kv_caches, max_blocks_per_seq)
            if self.backend.kernels_cover(dtype, mc.head_dim):  # the torch twin is not capturable
                small_graphs = SmallStepGraphs(self.model, self.cache_engine.kv_caches,
                                               max_blocks_per_seq)
                small_graphs.capture()
        self.runner = ModelRunner(self.model, self.backend, self.cache_engine, self.info, graphs,
                                  small_graphs)
        if graphs is not None:  # captured here: the graphs count penalties in the runner's rows
            graphs.capture(self.runner.input_batch.token_counts)
        if self.backend.name == "cuda":
            self._warm_up()
        log.info("worker ready: %s, %s, attention %s, %d KV pages (%s, %.1f GiB), %d CPU swap "
                 "pages (%.1f GiB%s), decode graphs %s, small-step graphs %s", name, dtype_name,
                 getattr(self.backend, "attention_impl", lambda *a: "torch")(dtype, mc.head_dim),
                 num_gpu_blocks, self.backend.name, num_gpu_blocks * block_bytes / 2**30,
                 self.cache_engine.num_cpu_blocks,
                 self.cache_engine.num_cpu_blocks * block_bytes / 2**30,
                 " pinned" if self.backend.pin_swap_memory else "",
                 "off" if graphs is None else graphs.batch_sizes,
                 "off" if small_graphs is None else f"{small_graphs.token_sizes} tokens")

    def _load(self, source: str, dtype: torch.dtype):
        """(model, config, tokenizer source, name, fingerprint). The weight files are hashed in a
        background thread while they load (hashlib releases the GIL; the second read of each file
        comes from the page cache); warns when the model comes without a tokenizer."""
        identity = start_source_identity(source, self.config.fingerprint_cache_dir)
        model, model_config, tokenizer, name = load_model(
            source, dtype, self.backend.device, self.config.seed, self.backend)
        if not tokenizer:
            log.warning("model %s has no tokenizer: only token-id prompts will work (text and "
                        "chat requests are refused)", name)
        fingerprint = model_fingerprint(model_config, identity.result(), self.config.seed,
                                        self.backend.device, dtype)
        return model, model_config, tokenizer, name, fingerprint

    def _tune_linears(self) -> None:
        """GEMM algorithms for the rows a step has: every decode-graph batch size (all products),
        and steps of 2,048, 4,096 and max_num_batched_tokens tokens, those up to the budget (all
        but lm_head, which sees only the rows that sample); chosen once per GPU and library
        version, then read from the cache folder. Other row counts (eager steps, also every
        step under enforce_eager) run the algorithm of the next tuned count up (its rung), whose
        kernel has run: a kernel's first run waits for the GPU (pagedserve_kernels/gemm.py)."""
        groups = self.model.linear_groups()
        self.backend.gemm.cache_dir = self.config.fingerprint_cache_dir
        self.backend.tune_linears(groups, list(BATCH_SIZES))
        body = {name: weights for name, weights in groups.items() if name != "lm_head"}
        budget = self.config.max_num_batched_tokens
        steps = sorted({t for t in _STEP_RUNGS if BATCH_SIZES[-1] < t < budget} | {budget})
        self.backend.tune_linears(body, steps)

    def _warm_up(self) -> None:
        """A prefill, then a batched decode (graph replay) launched before the prefill finished
        (its input ids gathered on the device), with a seeded sampled seq, through the runner,
        so that nothing compiles or allocates on the first request; then forgets them."""
        bs = self.config.block_size
        prompt = list(range(1, 2 * bs + 2))
        blocks = min(self.info.num_gpu_blocks, -(-(len(prompt) + 2) // bs))
        greedy, seeded = SamplingOptions(), SamplingOptions(temperature=0.8, top_p=0.9, seed=1)
        new = [NewSeq(i, prompt, list(range(blocks)), 0, len(prompt), opt)
               for i, opt in enumerate((greedy, seeded))]
        prefill = self.runner.launch(StepPlan(1, new_seqs=new))
        decode = self.runner.launch(
            StepPlan(2, cached_seqs=CachedSeqs.of((i, 1, len(prompt), []) for i in range(2))))
        self.runner.finish(prefill)
        self.runner.finish(decode)
        self.runner.reset()
        torch.cuda.synchronize(self.backend.device)
