"""CUDA backend: the CuPy kernels of pagedserve_kernels, launched on torch's current stream.
Imports cupy and the launchers lazily (in __init__), so this module imports without CUDA.
"""
from __future__ import annotations

import logging
import time

import torch

from executor_svc.quantization import Fp8Activation, Fp8Weight, Int4Weight, takes_fp8_rows
from pagedserve_kernels import fp8, gemm, reference

log = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_KERNEL_HEAD_DIMS = (64, 128)
# Packed steps of at most this many query tokens take the few-query kernel (the decode kernel's
# split of each context over CTAs, a seq's query tokens sharing one read of it): the prefill
# kernel gives each head one 128-row tile, too few CTAs for a short chunk over a long context.
# The choice follows from the tensors' shapes only, so it is fixed inside a captured graph.
# 64 is the largest size measured to pay (benchmarks/RESULTS.md).
FEW_QUERY_MAX = 64
# Step sizes tuned between the decode graphs' largest batch and the step budget: rungs for the
# products of eager steps with more rows than a graph
_STEP_RUNGS = (2048, 4096)
# Layers whose int4 weights tuning times together: for every projection of an 8B model, a
# shape's weights in 8 layers are more than L2 holds, so they come from memory as in a step
_TUNING_LAYERS = 8
# The layers' projections (LayerWeights fields) and the module names a refusal gives them
_PROJECTIONS = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
                "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}


class CudaBackend:
    name = "cuda"
    pin_swap_memory = True

    def __init__(self, device: str | torch.device = "cuda", fused_ops: bool = True) -> None:
        """fused_ops=False runs RMSNorm, RoPE and SiLU-and-mul through the torch twins even for
        bf16/fp16 (what the fused kernels are benchmarked against)."""
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda backend needs a CUDA device (torch.cuda.is_available() "
                               "is False); use --backend cpu")
        try:
            import cupy  # noqa: F401  (the kernels need it; fail here, not mid-request)
        except ImportError as err:
            raise RuntimeError("the cuda backend needs CuPy (pip install cupy-cuda13x)") from err
        from pagedserve_kernels import arch_used, attention, cache_ops, ops, quant, warmup

        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        self._attention, self._cache_ops, self._ops = attention, cache_ops, ops
        self._quant = quant  # its kernels compile in prepare_model, for a model with int4 weights
        self.fused_ops = fused_ops
        self.few_query_max = FEW_QUERY_MAX  # packed steps up to it: the few-query kernel
        # paged_few_query_attention's candidate keywords (key_split, split_keys) a benchmark
        # times; empty: production's kernel.
        self.few_query_variant: dict = {}
        from pagedserve_kernels.gemm import LinearTuner

        self.gemm = LinearTuner(self.device)  # F.linear until tune_linears() chooses
        # Compile and load every kernel now (the int4 ones once a model has int4 weights): a
        # compile error stops the executor before it serves.
        self.compile_seconds = warmup(self.device)
        log.info("CuPy kernels ready in %.2fs (%s)", self.compile_seconds["total"],
                 arch_used(self.device))

    @staticmethod
    def check_model(config) -> None:
        """Refuses block-wise FP8 weights, which the scaled product here does not take, by name
        (int4 weights run the W4A16 kernel; prepare_model refuses a group size it cannot read;
        per-channel and per-tensor FP8 run cuBLASLt's scaled product)."""
        if config.quantization is not None and "fp8" in config.quantization \
                and "block" in config.quantization:
            raise ValueError(f"{config.quantization} needs a block-wise FP8 product, which the "
                             "CUDA backend does not have yet (--backend cpu computes it)")

    @staticmethod
    def check_kv_cache_dtype(kv_cache_dtype: torch.dtype) -> None:
        """A cache of the model's dtype or FP8 (e4m3, per-layer scales): the kernels read both
        where they cover the model (kv_fp8.cu, compiled on its first launch), the torch twins
        elsewhere."""

    @staticmethod
    def kernels_cover(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in _KERNEL_DTYPES and head_dim in _KERNEL_HEAD_DIMS

    def attention_impl(self, dtype: torch.dtype, head_dim: int) -> str:
        """The kernels ("cupy") for bf16/fp16 at head_dim 64/128, else "torch" (a capturable
        gather-and-softmax for decode, the reference twin for prefill, e.g. the tests' float32
        tiny preset). The cache write and page copies are always the kernels."""
        return "cupy" if self.kernels_cover(dtype, head_dim) else "torch"

    def elementwise_impl(self, dtype: torch.dtype) -> str:
        """RMSNorm, RoPE (with the cache write) and SiLU-and-mul: kernels for bf16/fp16, the
        reference twins otherwise (float32 stays bit-identical to transformers) or when
        `fused_ops` is False."""
        return "cupy" if self.fused_ops and dtype in _KERNEL_DTYPES else "torch"

    def _elementwise(self, dtype: torch.dtype):
        return self._ops if self.elementwise_impl(dtype) == "cupy" else reference

    # -- attention and the KV cache ---------------------------------------------------------------

    # k_scale / v_scale: the layer's ([] float32 on the device), read by an FP8 cache's kernels.
    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping, k_scale=None,
                          v_scale=None) -> None:
        self._cache_ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale,
                                          v_scale)

    def paged_prefill_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                scale, out=None, sliding_window=None, soft_cap=None, k_scale=None,
                                v_scale=None) -> torch.Tensor:
        """sliding_window / soft_cap: the layer's (None: none), computed inside the kernels."""
        args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out,
                sliding_window, soft_cap, k_scale, v_scale)
        if self.kernels_cover(q.dtype, q.shape[-1]):
            if (q.shape[0] <= self.few_query_max
                    and q.shape[1] // k_cache.shape[1] <= self._attention.MAX_GROUP):
                return self._attention.paged_few_query_attention(*args, **self.few_query_variant)
            return self._attention.paged_prefill_attention(*args)
        return reference.paged_prefill_attention(*args)

    def paged_decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale,
                               out=None, sliding_window=None, soft_cap=None, k_scale=None,
                               v_scale=None) -> torch.Tensor:
        args = (q, k_cache, v_cache, block_tables, seq_lens, scale, out, sliding_window, soft_cap,
                k_scale, v_scale)
        if self.kernels_cover(q.dtype, q.shape[-1]):
            return self._attention.paged_decode_attention(*args)
        return reference.torch_decode_attention(*args)

    def swap_blocks(self, src_k, src_v, dst_k, dst_v, block_mapping) -> None:
        self._cache_ops.swap_blocks(src_k, src_v, dst_k, dst_v, block_mapping)

    def copy_blocks(self, k_cache, v_cache, block_mapping) -> None:
        self._cache_ops.copy_blocks(k_cache, v_cache, block_mapping)

    # -- elementwise ops of the forward -----------------------------------------------------------

    def rms_norm(self, x, weight, eps, out=None, feeds=None):
        """`feeds` an Fp8Weight with per-token dynamic scales: the rows quantized for it in the
        norm's own launch (no pass over them in the model's dtype)."""
        if self._quantizes_for(feeds, x.dtype):
            return Fp8Activation(*self._ops.rms_norm_fp8(x, weight, eps), x.dtype)
        return self._elementwise(x.dtype).rms_norm(x, weight, eps, out)

    def fused_add_rms_norm(self, x, residual, weight, eps, feeds=None):
        if self._quantizes_for(feeds, x.dtype):
            return Fp8Activation(*self._ops.rms_norm_fp8(x, weight, eps, residual),
                                 x.dtype), residual
        return self._elementwise(x.dtype).fused_add_rms_norm(x, residual, weight, eps)

    def _quantizes_for(self, weight, dtype: torch.dtype) -> bool:
        """Whether `weight` takes its rows quantized by a kernel (the norm's, SiLU-and-mul's or
        ops.quantize_fp8): the kernels for the dtype, and cuBLASLt's FP8 product for the weight
        (else the product quantizes in torch, or its twin runs)."""
        return (takes_fp8_rows(weight) and self.elementwise_impl(dtype) == "cupy"
                and fp8.supports(weight.weight))

    def head_rms_norm(self, q, k, q_weight, k_weight, eps) -> None:
        self._elementwise(q.dtype).head_rms_norm(q, k, q_weight, k_weight, eps)

    def rotary_embedding(self, positions, q, k, cos_table, sin_table, interleaved=False) -> None:
        """Partial rotary from the tables' width (rotary_dim = cos_table.shape[1])."""
        self._elementwise(q.dtype).rotary_embedding(positions, q, k, cos_table, sin_table,
                                                    interleaved)

    def rotary_embedding_and_cache(self, positions, q, k, value, cos_table, sin_table, k_cache,
                                   v_cache, slot_mapping, interleaved=False, k_scale=None,
                                   v_scale=None) -> None:
        """RoPE on q and k, then k and value to their cache slots: one kernel for bf16/fp16
        (pagedserve_kernels.ops), else the twin's RoPE and the cache kernel."""
        if self.elementwise_impl(q.dtype) == "cupy":
            self._ops.rotary_embedding_and_cache(positions, q, k, value, cos_table, sin_table,
                                                 k_cache, v_cache, slot_mapping, interleaved,
                                                 k_scale, v_scale)
        else:
            self.rotary_embedding(positions, q, k, cos_table, sin_table, interleaved)
            self.reshape_and_cache(k, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def silu_and_mul(self, x, out=None, feeds=None):
        """`feeds` as rms_norm's: the rows quantized for it in SiLU-and-mul's own launch."""
        if self._quantizes_for(feeds, x.dtype):
            return Fp8Activation(*self._ops.silu_and_mul_fp8(x), x.dtype)
        return self._elementwise(x.dtype).silu_and_mul(x, out)

    def gelu_tanh_and_mul(self, x, out=None) -> torch.Tensor:
        """GeGLU: the torch twin on the GPU (no fused kernel yet; correct, capturable)."""
        return reference.gelu_tanh_and_mul(x, out)

    def apply_token_bitmask(self, logits, bitmask, indices=None) -> None:
        """The kernel (pagedserve_kernels.ops, capturable: the decode graphs' masked variants)
        for float32 logits, as the graphs and the model's logits are; else the torch twin."""
        if logits.dtype == torch.float32 and logits.stride(-1) == 1:
            self._ops.apply_token_bitmask(logits, bitmask, indices)
        else:
            reference.apply_token_bitmask(logits, bitmask, indices)

    # -- matrix products --------------------------------------------------------------------------

    def linear(self, x, weight, bias=None, out=None) -> torch.Tensor:
        """Dense: the tuned GEMM, straight into `out` when given; int4 in the W4A16 kernel's
        layout (prepare_model repacks a bf16/fp16 model's): the kernel, bias fused; an
        Int4Weight (float32 models): its twin; FP8 W8A8: cuBLASLt's scaled product
        (_fp8_linear); the quantized ones copied into `out` when given."""
        if isinstance(weight, torch.Tensor):
            return self.gemm.linear(x, weight, bias, out)
        y = self._quantized_linear(x, weight, bias)
        return y if out is None else out.copy_(y)

    def _quantized_linear(self, x, weight, bias) -> torch.Tensor:
        if isinstance(weight, Int4Weight):
            return reference.int4_linear(x, weight.qweight, weight.scales, weight.zeros,
                                         weight.group_size, weight.perm, bias)
        if isinstance(weight, Fp8Weight):
            return self._fp8_linear(x, weight, bias)
        return self._quant.int4_linear(x, weight, bias)

    def _fp8_linear(self, x, weight: Fp8Weight, bias) -> torch.Tensor:
        """cuBLASLt's scaled product (pagedserve_kernels.fp8) of rows quantized per token by a
        kernel: the op before it (x an Fp8Activation) or ops.quantize_fp8 here; else quantized
        in torch (fp8.fp8_linear); the twin for shapes cuBLASLt's FP8 products do not take."""
        if not isinstance(x, Fp8Activation) and self._quantizes_for(weight, x.dtype):
            x = Fp8Activation(*self._ops.quantize_fp8(x), x.dtype)
        if isinstance(x, Fp8Activation):
            return self.gemm.fp8_linear(x.values, x.scale, weight.weight, weight.weight_scale,
                                        bias, x.dtype)
        if not fp8.supports(weight.weight):
            return reference.fp8_linear(x, weight.weight, weight.weight_scale,
                                        weight.input_scale, weight.per_token, bias)
        return fp8.fp8_linear(x, weight.weight, weight.weight_scale, weight.input_scale,
                              weight.per_token, bias)

    def tune_linears(self, groups: dict[str, list[torch.Tensor]], rows: list[int],
                     force_lt: bool = False) -> list[dict]:
        """Chooses, for each row count and each group of same-shape weights (a model's
        linear_groups()), F.linear or the fastest cuBLASLt algorithm
        (pagedserve_kernels.gemm.LinearTuner; choices kept in self.gemm.cache_dir per GPU and
        cuBLASLt version). Call before capturing graphs: a graph keeps the kernels it was
        captured with."""
        start = time.perf_counter()
        report = self.gemm.tune(rows, groups, force_lt=force_lt)
        log.info("GEMMs for %d row counts x %d products in %.2fs (%d timed, the rest from %s); "
                 "cuBLASLt algorithms in use: %d", len(rows), len(groups),
                 time.perf_counter() - start, len(report), self.gemm.cache_dir,
                 len(self.gemm.algos))
        return report

    # -- what the worker asks of the device before it serves ---------------------------------------

    def prepare_model(self, model, cache_dir: str | None, max_num_batched_tokens: int) -> None:
        """A bf16/fp16 model's int4 projections repacked once (repack_int4), the W4A16 kernels
        compiled and their workspace allocated, before any graph capture. GEMM algorithms for
        the dense products and the rows a step has: every decode-graph batch size (all products),
        and steps of 2,048, 4,096 and max_num_batched_tokens tokens, those up to the budget (all
        but lm_head, which sees only the rows that sample); chosen once per GPU and library
        version, then read from `cache_dir`. Other row counts (eager steps, also every
        step under enforce_eager) run the algorithm of the next tuned count up (its rung), whose
        kernel has run: a kernel's first run waits for the GPU (pagedserve_kernels/gemm.py)."""
        from executor_svc.cuda_graphs import BATCH_SIZES
        from pagedserve_kernels.quant import PackedInt4

        if model.embed_tokens.dtype in _KERNEL_DTYPES and repack_int4(model):
            start = time.perf_counter()
            packed = [[w for field in _PROJECTIONS
                       if isinstance(w := getattr(layer, field), PackedInt4)]
                      for layer in model.layers]
            largest = max(w.n * w.k for layer in packed for w in layer)
            self._quant.prepare(self.device, largest, model.embed_tokens.dtype)
            # each shape's row tiles, and where dequantizing into the scratch beats the kernel,
            # timed on the weights of a few layers (more than L2 holds, as a step reads them)
            # at every decode graph's batch size
            tuned = self._quant.tune_dequant_rows(
                [w for layer in packed[:_TUNING_LAYERS] for w in layer], self.device,
                rows_list=tuple(BATCH_SIZES) + self._quant.TILE_CANDIDATES)
            tiles = self._quant.tile_choice(self.device, model.embed_tokens.dtype)
            log.info("int4 kernels ready in %.2fs (launched %s)", time.perf_counter() - start,
                     "programmatically" if self._quant.launches_programmatically(self.device)
                     else "plainly")
            for (n, k), (rows, times) in tuned.items():
                log.info("int4 %dx%d: row tiles by rows %s, dequantize + cuBLAS from %s rows "
                         "(kernel / dequantized µs by rows: %s)", n, k, tiles.get((n, k)),
                         "no" if rows == self._quant.NEVER else rows,
                         {r: (round(t, 1), round(d, 1)) for r, (t, d) in times.items()})
        groups = {name: weights for name, weights in model.linear_groups().items()
                  if all(isinstance(w, torch.Tensor) for w in weights)}  # dense products
        if gemm.TUNE_FP8:
            groups.update(fp8_groups(model))
        self.gemm.cache_dir = cache_dir
        self.tune_linears(groups, list(BATCH_SIZES))
        body = {name: weights for name, weights in groups.items() if name != "lm_head"}
        budget = max_num_batched_tokens
        steps = sorted({t for t in _STEP_RUNGS if BATCH_SIZES[-1] < t < budget} | {budget})
        self.tune_linears(body, steps)

    def profile_num_blocks(self, model, block_size: int, block_bytes: int, utilization: float,
                           max_num_batched_tokens: int, max_num_seqs: int):
        """The KV pages that fit in `utilization` of the GPU beside the weights, a step's peak
        and the decode graphs (a memory_profile.MemoryProfile)."""
        from executor_svc.memory_profile import profile_num_gpu_blocks

        return profile_num_gpu_blocks(model, block_size, block_bytes, utilization,
                                      max_num_batched_tokens, max_num_seqs, self.device)

    def build_graphs(self, model, kv_caches, max_blocks_per_seq: int, dtype: torch.dtype,
                     decode_sizes: tuple[int, ...], token_sizes: tuple[int, ...],
                     grammars: bool = True, piece_sizes: tuple[int, ...] = ()):
        """CudaGraphs, not captured yet: capture(counts) needs the runner's penalty counts. Small
        steps only where the kernels cover the model: the torch prefill twin is not capturable
        (the piecewise graphs leave attention out, so they need no kernel). Without `grammars`
        no masked twins (up to one per decode graph) are captured."""
        from executor_svc.cuda_graphs import MAX_MASKED_BATCH, CudaGraphs

        if not self.kernels_cover(dtype, model.config.head_dim):
            token_sizes = ()
        return CudaGraphs(model, kv_caches, max_blocks_per_seq, decode_sizes, token_sizes,
                          max_masked_batch=MAX_MASKED_BATCH if grammars else 0,
                          piece_sizes=piece_sizes)

    def graph_workspaces(self) -> list[torch.Tensor]:
        """The attention launchers' scratch tensors, which a captured graph must keep alive."""
        return self._attention.workspaces()

    def warm_up(self, runner) -> None:
        """A prefill, then a batched decode (graph replay) launched before the prefill finished
        (its input ids gathered on the device), with a seeded sampled seq, through the runner,
        so that nothing compiles or allocates on the first request; then forgets them."""
        from executor_svc.step import CachedSeqs, NewSeq, SamplingOptions, StepPlan

        bs = runner.info.block_size
        prompt = list(range(1, 2 * bs + 2))
        blocks = min(runner.info.num_gpu_blocks, -(-(len(prompt) + 2) // bs))
        greedy, seeded = SamplingOptions(), SamplingOptions(temperature=0.8, top_p=0.9, seed=1)
        new = [NewSeq(i, prompt, list(range(blocks)), 0, len(prompt), opt)
               for i, opt in enumerate((greedy, seeded))]
        prefill = runner.launch(StepPlan(1, new_seqs=new))
        decode = runner.launch(
            StepPlan(2, cached_seqs=CachedSeqs.of((i, 1, len(prompt), []) for i in range(2))))
        runner.finish(prefill)
        runner.finish(decode)
        runner.reset()
        torch.cuda.synchronize(self.device)


def repack_int4(model) -> int:
    """Replaces each Int4Weight projection of `model` by its layout for the W4A16 kernel
    (quant.repack, in the model's dtype); the loaded form is dropped. Every one is checked before
    any is repacked: a group size the kernel cannot read is a ValueError naming the layer.
    Returns how many were repacked."""
    from pagedserve_kernels import quant

    dtype = model.embed_tokens.dtype
    found = [(f"model.layers.{i}.{name}", layer, field)
             for i, layer in enumerate(model.layers) for field, name in _PROJECTIONS.items()
             if isinstance(getattr(layer, field), Int4Weight)]
    for name, layer, field in found:
        weight = getattr(layer, field)
        k = weight.shape[1]
        if weight.group_size % quant.CHUNK and weight.group_size != k:
            raise ValueError(f"{name}: int4 group size {weight.group_size} is not supported by "
                             f"the CUDA backend's W4A16 kernel (a multiple of {quant.CHUNK}, or "
                             "one group per output channel); --backend cpu computes it")
    for name, layer, field in found:
        weight = getattr(layer, field)
        setattr(layer, field, quant.repack(weight.qweight, weight.scales, weight.zeros,
                                           weight.group_size, weight.perm, dtype))
    return len(found)


_BIASES = {"qkv": "qkv_bias", "o": "o_bias"}  # linear_groups' products that may carry a bias


def fp8_groups(model) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The products whose weights are all FP8 W8A8 taking rows a kernel quantized per token
    (what _fp8_linear sends to the tuner), as the tuner's (e4m3 weight, scale a channel) pairs;
    only where a tuned product would run: a bf16 model's, without a bias."""
    if model.embed_tokens.dtype != torch.bfloat16:
        return {}
    groups = {}
    for name, weights in model.linear_groups().items():
        field = _BIASES.get(name)
        if field and any(getattr(layer, field) is not None for layer in model.layers):
            continue
        if all(takes_fp8_rows(w) and fp8.supports(w.weight) for w in weights):
            groups[name] = [(w.weight, w.weight_scale) for w in weights]
    return groups
