"""Launchers of the KV-cache kernels (csrc/cache.cu; an FP8 cache's write in csrc/kv_fp8.cu):
cache write, swap_blocks, copy_blocks, as `pagedserve_kernels.reference`. CPU-side caches must be
pinned: the kernel reaches them through their mapped device address. Imports cupy only when
launching.
"""
from __future__ import annotations

import torch

from pagedserve_kernels import _compile
from pagedserve_kernels._compile import i32 as _i32, i64 as _i64
from pagedserve_kernels.reference import KV_FP8

_COPY_THREADS = 256
_HOST_COPY_CTAS = 32       # saturates PCIe in both directions without taking many SMs
_DEVICE_COPY_CTAS_PER_SM = 4
_RESHAPE_THREADS = 256
_ROW_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

_host_to_device_ptr: dict[int, int] = {}
_num_sms: dict[int, int] = {}



def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new K and V rows into their cache slots (one launch, K and V together).

    key, value: [num_tokens, num_kv_heads, head_dim], last dim contiguous, same dtype as the
        cache; into an FP8 cache bf16, fp16 or float32, each element stored as e4m3(x / scale)
        (reference.quantize_kv's rule, bit for bit)
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] contiguous (one layer)
    slot_mapping: [num_tokens] int64 or int32 on the cache's device; a negative slot skips its token
    k_scale, v_scale: an FP8 cache's per-layer scales (kv_scale_args); other caches ignore them
    """
    num_tokens = key.shape[0]
    check_cache_write(key, value, k_cache, v_cache, slot_mapping)
    scales = kv_scale_args(k_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    if scales:
        _reshape_and_cache_fp8(key, value, k_cache, v_cache, slot_mapping, scales)
        return
    num_kv_heads, block_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    es = k_cache.element_size()
    row_chunks = head_dim * es // 16
    total = num_tokens * num_kv_heads * row_chunks
    kernel = "reshape_and_cache_i64" if slot_mapping.dtype == torch.int64 else "reshape_and_cache_i32"
    args = (
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), _i32(num_tokens), _i32(num_kv_heads), _i32(row_chunks),
        _i64(key.stride(0) * es), _i64(key.stride(1) * es),
        _i64(value.stride(0) * es), _i64(value.stride(1) * es), _i64(block_size),
    )
    grid = ((total + _RESHAPE_THREADS - 1) // _RESHAPE_THREADS, 1, 1)
    _compile.launch("cache", kernel, k_cache.device, grid, (_RESHAPE_THREADS, 1, 1), args)


def _reshape_and_cache_fp8(key, value, k_cache, v_cache, slot_mapping, scales) -> None:
    """reshape_and_cache into an FP8 cache: a thread per 8 elements of a row."""
    num_tokens, num_kv_heads, head_dim = key.shape
    total = num_tokens * num_kv_heads * (head_dim // 8)
    index = "i64" if slot_mapping.dtype == torch.int64 else "i32"
    args = (
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), _i32(num_tokens), _i32(num_kv_heads), _i32(head_dim),
        _i64(key.stride(0)), _i64(key.stride(1)), _i64(value.stride(0)), _i64(value.stride(1)),
        _i64(k_cache.shape[2]), *scales,
    )
    grid = ((total + _RESHAPE_THREADS - 1) // _RESHAPE_THREADS, 1, 1)
    _compile.launch("kv_fp8", f"reshape_and_cache_fp8_{_ROW_DTYPES[key.dtype]}_{index}",
                    k_cache.device, grid, (_RESHAPE_THREADS, 1, 1), args)


def kv_scale_args(cache: torch.Tensor, k_scale, v_scale) -> tuple:
    """The FP8 kernels' (k_scale, v_scale) arguments, device pointers read by the kernels (so a
    captured graph keeps the layer's values); () for a cache of another dtype, whose kernels take
    none (the scales are ignored, as the reference twin does). Raises ValueError unless an FP8
    cache comes with both scales as one-element float32 tensors on its device."""
    if cache.dtype != KV_FP8:
        return ()
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32
                or scale.numel() != 1 or scale.device != cache.device):
            got = (f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
                   if isinstance(scale, torch.Tensor) else repr(scale))
            raise ValueError(f"an FP8 KV cache needs {name}, the layer's scale, as a one-element "
                             f"float32 tensor on {cache.device}; got {got}")
    return (k_scale.data_ptr(), v_scale.data_ptr())


def check_cache_write(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Raises ValueError unless reshape_and_cache can write key / value [num_tokens, kv_heads,
    head_dim] (16-byte aligned rows) into these caches at slot_mapping (also RoPE's fused form,
    pagedserve_kernels.ops.rotary_embedding_and_cache): rows of the cache's dtype, or bf16 /
    fp16 / float32 rows of a head_dim that is a multiple of 8 into an FP8 cache."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_cuda or t.dim() != 4 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 4-D CUDA tensor [num_blocks, "
                             f"num_kv_heads, block_size, head_dim], got {tuple(t.shape)} on {t.device}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError("k_cache and v_cache must have the same shape, dtype and device")
    expect = (key.shape[0], k_cache.shape[1], k_cache.shape[3])
    fp8 = k_cache.dtype == KV_FP8
    row_dtype = (key.dtype if key.dtype in _ROW_DTYPES else None) if fp8 else k_cache.dtype
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != expect or t.dtype != row_dtype or t.device != k_cache.device:
            wanted = f"{expect} bf16/fp16/float32 (one dtype)" if fp8 else f"{expect} {row_dtype}"
            raise ValueError(f"{name} must be {wanted} on {k_cache.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
        es = t.element_size()
        if (t.stride(2) != 1 or (t.stride(0) * es) % 16 or (t.stride(1) * es) % 16
                or t.data_ptr() % 16):
            raise ValueError(f"{name} needs a contiguous last dim and 16-byte aligned rows; "
                             f"strides {t.stride()}")
    if fp8 and k_cache.shape[3] % 8:
        raise ValueError(f"an FP8 cache's head_dim must be a multiple of 8, got {k_cache.shape[3]}")
    if not fp8 and (k_cache.shape[3] * k_cache.element_size()) % 16:
        raise ValueError("head_dim * element size must be a multiple of 16 bytes, got "
                         f"{k_cache.shape[3]} * {k_cache.element_size()}")
    if (slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]
            or slot_mapping.dtype not in (torch.int64, torch.int32)
            or slot_mapping.device != k_cache.device or not slot_mapping.is_contiguous()):
        raise ValueError(f"slot_mapping must be a contiguous [{key.shape[0]}] int64/int32 tensor "
                         f"on {k_cache.device}, got {slot_mapping.dtype} {tuple(slot_mapping.shape)} "
                         f"on {slot_mapping.device}")


def swap_blocks(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole pages between two caches (GPU <-> pinned CPU, or GPU <-> GPU), all layers, K
    and V, every pair, in one kernel launch on the GPU side's current stream. Pages move as bytes,
    of any element type (an FP8 page as it is, never requantized).

    src_*, dst_*: [num_layers, num_blocks, num_kv_heads, block_size, head_dim] contiguous (block
        counts may differ between src and dst); CPU tensors must be pinned
    block_mapping: [n, 2] int64 (src_block, dst_block); on the GPU for capture, or a CPU tensor
        (copied asynchronously; pin it). Pairs out of range are skipped, never written.
    After a GPU->CPU swap, synchronize the stream before reading the CPU pages.
    """
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2], got {tuple(block_mapping.shape)}")
    device = _check_pages(src_k, src_v, dst_k, dst_v)
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    mapping = block_mapping
    if mapping.dtype != torch.int64 or mapping.device != device or not mapping.is_contiguous():
        mapping = mapping.to(dtype=torch.int64).contiguous().to(device, non_blocking=True)
    num_layers = src_k.shape[0]
    page_bytes = src_k[0, 0].numel() * src_k.element_size()
    items = num_pairs * num_layers * 2
    host = not (src_k.is_cuda and dst_k.is_cuda)
    ctas = _HOST_COPY_CTAS if host else _DEVICE_COPY_CTAS_PER_SM * _sm_count(device)
    args = (
        _device_ptr(src_k), _device_ptr(src_v), _device_ptr(dst_k), _device_ptr(dst_v),
        mapping.data_ptr(), _i32(num_pairs), _i32(num_layers), _i64(page_bytes),
        _i64(src_k.shape[1]), _i64(dst_k.shape[1]),
    )
    _compile.launch("cache", "copy_pages", device, (min(items, ctas), 1, 1),
                    (_COPY_THREADS, 1, 1), args)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy pages within one GPU cache (copy-on-write), all layers, K and V, one launch.

    k_cache, v_cache: [num_layers, num_blocks, num_kv_heads, block_size, head_dim] on the GPU
    block_mapping: [n, 2] int64 (src_block, dst_block); no block is both a source and a destination
    """
    if not (k_cache.is_cuda and v_cache.is_cuda):
        raise ValueError("copy_blocks needs GPU caches; use swap_blocks for CPU pages")
    swap_blocks(k_cache, v_cache, k_cache, v_cache, block_mapping)


def _check_pages(src_k, src_v, dst_k, dst_v) -> torch.device:
    tensors = {"src_k": src_k, "src_v": src_v, "dst_k": dst_k, "dst_v": dst_v}
    for name, t in tensors.items():
        if t.dim() != 5 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [num_layers, num_blocks, num_kv_heads, "
                             f"block_size, head_dim] tensor, got {tuple(t.shape)}")
        if t.dtype != src_k.dtype:
            raise ValueError(f"{name} is {t.dtype}, src_k is {src_k.dtype}")
        if t.shape[0] != src_k.shape[0] or t.shape[2:] != src_k.shape[2:]:
            raise ValueError(f"{name} {tuple(t.shape)} does not match src_k {tuple(src_k.shape)} "
                             f"outside the block dimension")
        if not t.is_cuda and not t.is_pinned():
            raise ValueError(f"{name} is a CPU tensor that is not pinned: the kernel can only "
                             f"reach pinned host memory")
    if src_k.shape != src_v.shape or dst_k.shape != dst_v.shape:
        raise ValueError("K and V of one side must have the same shape")
    if src_k.device != src_v.device or dst_k.device != dst_v.device:
        raise ValueError("K and V of one side must live on the same device")
    gpus = {t.device for t in tensors.values() if t.is_cuda}
    if not gpus:
        raise ValueError("swap_blocks needs at least one side on the GPU")
    if len(gpus) > 1:
        raise ValueError(f"caches on several GPUs: {sorted(str(d) for d in gpus)}")
    if (src_k[0, 0].numel() * src_k.element_size()) % 16:
        raise ValueError("a page of one layer must be a multiple of 16 bytes")
    return gpus.pop()


def _device_ptr(t: torch.Tensor) -> int:
    """The address through which the device reaches `t`: itself for CUDA tensors; for pinned host
    memory the mapped device pointer (identical to the host pointer under UVA)."""
    if t.is_cuda:
        return t.data_ptr()
    base = t.untyped_storage().data_ptr()
    mapped = _host_to_device_ptr.get(base)
    if mapped is None:
        import cupy

        try:
            mapped = cupy.cuda.runtime.pointerGetAttributes(base).devicePointer or base
        except Exception:  # an older CuPy without the attribute query: UVA maps it 1:1
            mapped = base
        _host_to_device_ptr[base] = mapped
    return mapped + (t.data_ptr() - base)


def _sm_count(device: torch.device) -> int:
    if device.index not in _num_sms:
        _num_sms[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _num_sms[device.index]
