"""ExecutorConfig: the executor's one frozen config, built by its main from flags. No env reads."""
from __future__ import annotations

from dataclasses import dataclass


BLOCK_SIZES = (8, 16, 32)  # the paged attention kernels take powers of two from 8; vLLM's CUDA sizes
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is e4m3, as on vLLM's CUDA


@dataclass(frozen=True)
class ExecutorConfig:
    model: str = ""  # "preset:NAME", a local HF folder, a .gguf path; "" = default_model_source()
    # vLLM's --tokenizer: a tokenizer folder or .gguf file served instead of the model's ("" = the
    # model's); lets a preset's random weights take text and grammars
    tokenizer: str = ""
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None = float32 on cpu, bfloat16 on cuda
    backend: str = "cpu"  # "cpu" | "cuda"
    block_size: int = 16
    # vLLM's --kv-cache-dtype: "auto" (the model's dtype), "fp8" or "fp8_e4m3" (e4m3 pages with
    # per-layer scales: twice the pages of a 16-bit cache in the same memory)
    kv_cache_dtype: str = "auto"
    num_gpu_blocks: int | None = None  # None = 1024 on cpu; cuda: sized from free memory
    swap_space_gib: float = 1.0  # CPU swap space (pinned on cuda)
    # share of the GPU's memory weights + KV + activations may use (vLLM's default)
    gpu_memory_utilization: float = 0.92
    # Tokens and sequences in a step (step_limits.py): recommended to the scheduler and, on a GPU,
    # the largest step the memory profile and graphs are sized for; None = vLLM's rule for the device
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
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

    def resolved_kv_cache_dtype(self) -> str:
        """The KV cache's element type by name: the model's dtype, or "fp8_e4m3"."""
        if self.kv_cache_dtype == "auto":
            return self.resolved_dtype()
        if self.kv_cache_dtype in KV_CACHE_DTYPES:
            return "fp8_e4m3"
        raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
