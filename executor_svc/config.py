"""ExecutorConfig: the executor's one frozen config, built by its main from flags. No env reads."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutorConfig:
    model: str = ""  # "preset:NAME", a local HF folder, a .gguf path; "" = default_model_source()
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None = float32 on cpu, bfloat16 on cuda
    backend: str = "cpu"  # "cpu" | "cuda"
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None = 1024 on cpu; cuda: sized from free memory
    swap_space_gib: float = 1.0  # CPU swap space (pinned on cuda)
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory weights + KV + activations may use
    max_num_batched_tokens: int = 2048  # the largest step the memory profile must leave room for
    enforce_eager: bool = False  # cuda: no CUDA graphs (decode and small steps)
    overlap_steps: bool = True  # launch step N+1 (if its plan is there) before finishing step N
    max_model_len: int | None = None  # None = min(model max positions, 4096)
    seed: int = 0
    # cached weight-file digests and GEMM choices (pagedserve_kernels.gemm);
    # None = made at every start
    fingerprint_cache_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 50052

    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.backend == "cpu" else "bfloat16"
