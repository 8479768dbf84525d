"""Worker: builds backend, model, cache engine and model runner from an ExecutorConfig; the gRPC
servicer's one domain object. No gRPC or protobuf here.
"""
from __future__ import annotations

from executor_svc.backends import get_backend
from executor_svc.cache_engine import CacheEngine, bytes_per_block, num_blocks_for
from executor_svc.config import ExecutorConfig
from executor_svc.model_loader import DTYPES, default_model_source, load_model, model_fingerprint
from executor_svc.model_runner import ModelRunner
from executor_svc.step import ExecutorInfo, Step, StepOutput

FEATURES = ("swap", "copy", "chunked_prefill", "seeded_sampling", "logprobs")
_CPU_DEFAULT_GPU_BLOCKS = 1024
_MAX_MODEL_LEN_CAP = 4096


class Worker:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.backend = get_backend(config.backend)
        source = config.model or default_model_source()
        dtype_name = config.resolved_dtype()
        dtype = DTYPES[dtype_name]
        self.model, self.model_config, tokenizer, name = load_model(
            source, dtype, self.backend.device, config.seed, self.backend
        )
        mc = self.model_config
        block_bytes = bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                      config.block_size, dtype)
        num_gpu_blocks = config.num_gpu_blocks or _CPU_DEFAULT_GPU_BLOCKS
        self.cache_engine = CacheEngine(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, num_gpu_blocks,
            num_blocks_for(config.swap_space_gib, block_bytes), dtype, self.backend,
        )
        max_model_len = config.max_model_len or min(mc.max_position_embeddings, _MAX_MODEL_LEN_CAP)
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} > model's {mc.max_position_embeddings}")
        self.info = ExecutorInfo(
            model_name=name,
            fingerprint=model_fingerprint(mc, source, config.seed),
            dtype=dtype_name,
            block_size=config.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=self.cache_engine.num_cpu_blocks,
            max_model_len=max_model_len,
            vocab_size=mc.vocab_size,
            tokenizer=tokenizer,
            backend=self.backend.name,
            features=FEATURES,
        )
        self.runner = ModelRunner(self.model, self.backend, self.cache_engine, self.info)

    def describe(self) -> ExecutorInfo:
        return self.info

    def execute(self, step: Step) -> StepOutput:
        return self.runner.execute(step)

    def reset(self) -> None:
        self.runner.reset()
