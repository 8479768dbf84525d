"""Compiles csrc through cupy.RawModule (NVRTC) per device and owns the arch options, the module
caches, launches on torch's current stream and `warmup()`. Imports cupy lazily, no GPU at import.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

CSRC = Path(__file__).resolve().parent / "csrc"

# module name -> (source file, every kernel it defines); warmup() loads all but LAZY's.
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "attention": (
        "attention.cu",
        (
            "prefill_tiles",
            "prefill_bf16_hd64", "prefill_bf16_hd128", "prefill_fp16_hd64", "prefill_fp16_hd128",
            "prefill_wg_bf16_hd64", "prefill_wg_bf16_hd128", "prefill_wg_fp16_hd64",
            "prefill_wg_fp16_hd128", "prefill_wgp_bf16_hd128", "prefill_wgp_fp16_hd128",
            "decode_bf16_hd64", "decode_bf16_hd128", "decode_fp16_hd64", "decode_fp16_hd128",
            "decode_combine_bf16", "decode_combine_fp16",
            "query_tiles", "decode_mq_bf16_hd64", "decode_mq_bf16_hd128", "decode_mq_fp16_hd64",
            "decode_mq_fp16_hd128",
        ),
    ),
    "cache": ("cache.cu", ("reshape_and_cache_i64", "reshape_and_cache_i32", "copy_pages")),
    "ops": (
        "ops.cu",
        (
            "rms_norm_bf16", "rms_norm_fp16", "fused_add_rms_norm_bf16", "fused_add_rms_norm_fp16",
            "rms_norm_fp8_bf16", "rms_norm_fp8_fp16", "fused_add_rms_norm_fp8_bf16",
            "fused_add_rms_norm_fp8_fp16", "quantize_fp8_bf16", "quantize_fp8_fp16",
            "silu_and_mul_fp8_bf16", "silu_and_mul_fp8_fp16", "head_rms_norm_bf16",
            "head_rms_norm_fp16",
            "rotary_embedding_bf16", "rotary_embedding_fp16", "silu_and_mul_bf16",
            "silu_and_mul_fp16", "rotary_embedding_cache_bf16_i64",
            "rotary_embedding_cache_bf16_i32", "rotary_embedding_cache_fp16_i64",
            "rotary_embedding_cache_fp16_i32", "apply_token_bitmask", "gumbel_argmax",
        ),
    ),
    "quant": (
        "quant.cu",
        (
            "w4a16_bf16_m16", "w4a16_bf16_m32", "w4a16_bf16_m64", "w4a16_bf16_m128",
            "w4a16_wgp_bf16_m64", "w4a16_wgp_bf16_m128", "w4a16_wgp_fp16_m64", "w4a16_wgp_fp16_m128",
            "w4a16_wgt_bf16_m64", "w4a16_wgt_bf16_m128", "w4a16_wgt_bf16_m256",
            "w4a16_wgt_fp16_m64", "w4a16_wgt_fp16_m128", "w4a16_wgt_fp16_m256",
            "w4a16_wgs_bf16_m64", "w4a16_wgs_bf16_m128", "w4a16_wgs_bf16_m256",
            "w4a16_wgs_fp16_m64", "w4a16_wgs_fp16_m128", "w4a16_wgs_fp16_m256",
            "w4a16_wgw_bf16_m64", "w4a16_wgw_bf16_m128", "w4a16_wgw_fp16_m64",
            "w4a16_wgw_fp16_m128",
            "w4a16_wgm_bf16_m128", "w4a16_wgm_bf16_m256", "w4a16_wgm_fp16_m128",
            "w4a16_wgm_fp16_m256", "w4a16_wgq_bf16_m128", "w4a16_wgq_bf16_m256",
            "w4a16_wgq_fp16_m128", "w4a16_wgq_fp16_m256",
            "w4a16_fp16_m16", "w4a16_fp16_m32", "w4a16_fp16_m64", "w4a16_fp16_m128",
            "w4_dequant_bf16", "w4_dequant_fp16",
        ),
    ),
    "kv_fp8": (
        "kv_fp8.cu",
        tuple(f"{kind}_{dtype}_hd{hd}_fp8"
              for kind in ("prefill", "prefill_wg", "decode", "decode_mq")
              for dtype in ("bf16", "fp16") for hd in (64, 128))
        + tuple(f"reshape_and_cache_fp8_{dtype}_{index}"
                for dtype in ("bf16", "fp16", "fp32") for index in ("i64", "i32"))
        + tuple(f"rotary_embedding_cache_{dtype}_{index}_fp8"
                for dtype in ("bf16", "fp16") for index in ("i64", "i32")),
    ),
}

# Modules of MODULES only some models need, which warmup() skips, so no start pays their
# compile: quant's prepare() loads it once a model has int4 weights; kv_fp8 compiles on the
# first launch over an FP8 KV cache (the decode graphs' eager pass or the warm-up step, before
# the executor serves).
LAZY: frozenset[str] = frozenset({"quant", "kv_fp8"})

# Modules only benchmarks and tests launch, compiled on their first launch, never by warmup():
# a source built with a macro defined that adds candidate kernels to it, or that makes a
# diagnostic build of production kernels.
# module name -> (source file, the macro, the kernels launched from it)
ON_DEMAND: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # the producer-fed and mma.sync W4A16 tiles recording when each run of K stages starts,
    # retires and is out (benchmarks/trace_quant.py); the same kernels as quant's otherwise
    "quant_trace": (
        "quant.cu",
        "PS_QUANT_TRACE",
        tuple(k for k in MODULES["quant"][1]
              if "_wgt_" in k or "_wgs_" in k or re.fullmatch(r"w4a16_(bf16|fp16)_m\d+", k)),
    ),
    # the 16- and 32-row W4A16 tiles summing their K parts through a cluster (quant.py's
    # CLUSTER_TILES), candidates
    "quant_cluster": (
        "quant.cu",
        "PS_QUANT_CLUSTER",
        ("w4a16_cl_bf16_m16", "w4a16_cl_bf16_m32", "w4a16_cl_fp16_m16", "w4a16_cl_fp16_m32"),
    ),
    "attention_variants": (
        "attention.cu",
        "PS_VARIANTS",
        (
            "prefill_wg1_bf16_hd64", "decode_s2_bf16_hd128", "decode_mqks_bf16_hd64",
            "decode_mqks_bf16_hd128", "decode_mqks_fp16_hd64", "decode_mqks_fp16_hd128",
        ),
    ),
}

_BASE_OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}
_functions: dict[tuple[str, str, int], Any] = {}
_smem_limit: dict[tuple[str, int], int] = {}  # (kernel, device) -> dynamic shared memory allowed
_streams: dict[tuple[int, int], Any] = {}
_arch_used: dict[tuple[str, int], str] = {}  # (module, device) -> the arch option it was built with


def load_source(filename: str) -> str:
    """The source with local `#include "x"` lines inlined, so CuPy's cache key covers headers."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:  # headers use #pragma once; inline each one once
            return ""
        seen.add(name)
        text = (CSRC / name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(filename)


def arch_options(compute_capability: str) -> list[tuple[str, ...]]:
    """Option sets to try, best first: sm_90a on Hopper (wgmma/setmaxnreg-capable), else the
    device's own arch; the empty set lets CuPy choose if NVRTC rejects ours."""
    if compute_capability == "90":
        return [("-arch=sm_90a",), ()]
    return [(f"-arch=sm_{compute_capability}",), ()]


def _device_index(device: torch.device | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def get_module(name: str, device: torch.device | int | None = None) -> Any:
    """The compiled and loaded RawModule `name` on `device` (compiled on first use)."""
    import cupy

    index = _device_index(device)
    key = (name, index)
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock:
        if key in _modules:
            return _modules[key]
        filename, kernels, options = _module_spec(name)
        source = load_source(filename)
        with cupy.cuda.Device(index):
            cc = cupy.cuda.Device(index).compute_capability
            last_error: Exception | None = None
            for arch in arch_options(cc):
                try:
                    module = cupy.RawModule(code=source, options=options + arch)
                    module.get_function(kernels[0])  # forces compile + load now
                    _arch_used[key] = arch[0] if arch else f"cupy default (sm_{cc})"
                    break
                except cupy.cuda.compiler.CompileException as exc:
                    last_error = exc
                    module = None
            if module is None:
                raise RuntimeError(f"could not compile {filename}: {last_error}")
        _modules[key] = module
        return module


def _module_spec(name: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(source file, kernels, NVRTC options) of module `name`, of MODULES or ON_DEMAND."""
    if name in MODULES:
        filename, kernels = MODULES[name]
        return filename, kernels, _BASE_OPTIONS
    filename, macro, kernels = ON_DEMAND[name]
    return filename, kernels, _BASE_OPTIONS + (f"-D{macro}",)


def get_function(module: str, kernel: str, device: torch.device | int | None = None,
                 shared_mem: int = 0) -> Any:
    """A kernel handle; raises its dynamic shared-memory limit when shared_mem passes it (48 KiB
    until then)."""
    index = _device_index(device)
    key = (module, kernel, index)
    fn = _functions.get(key)
    if fn is None:
        fn = get_module(module, index).get_function(kernel)
        _functions[key] = fn
    # Only ever raised: a limit set to each size asked for would fail a later, larger launch
    # whose size had been set before (97 KiB, then 100, then 97: the 100 KiB launch is refused).
    if shared_mem > _smem_limit.get((kernel, index), 48 * 1024):
        fn.max_dynamic_shared_size_bytes = shared_mem
        _smem_limit[(kernel, index)] = shared_mem
    return fn


def current_stream(device: torch.device) -> Any:
    """torch's current stream on `device` as a CuPy ExternalStream (cached per handle)."""
    import cupy

    index = _device_index(device)
    ptr = torch.cuda.current_stream(index).cuda_stream
    stream = _streams.get((ptr, index))
    if stream is None:
        with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external; same object
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cupy.cuda.ExternalStream(ptr, index)
        _streams[(ptr, index)] = stream
    return stream


def launch(module: str, kernel: str, device: torch.device, grid: tuple[int, ...],
           block: tuple[int, ...], args: tuple, shared_mem: int = 0,
           programmatic: bool = False, cluster: tuple[int, int, int] | None = None) -> None:
    """Launch on torch's current stream of `device` (always an explicit stream: a launch on
    CuPy's default stream would silently drop out of a CUDA-graph capture). `programmatic`:
    as a programmatic dependent launch (the kernel must call ps::grid_dependency_wait before it
    touches what the kernel before it reads or writes; see programmatic_launch). `cluster`:
    thread block clusters of these dimensions (sm_90; at most 8 CTAs, each grid dimension a
    multiple of the cluster's)."""
    import cupy

    index = _device_index(device)
    fn = get_function(module, kernel, index, shared_mem)
    with cupy.cuda.Device(index):
        if programmatic or cluster:
            _launch_ex(fn, grid, block, args, shared_mem,
                       torch.cuda.current_stream(index).cuda_stream, programmatic, cluster)
        else:
            fn(grid, block, args, shared_mem=shared_mem, stream=current_stream(device))


# Programmatic dependent launch (Hopper and later): the grid may start while the kernel before
# it in the stream finishes, and waits for it where the kernel says (griddepcontrol.wait);
# CUDA-graph capture keeps the edge programmatic. Thread block clusters (sm_90): CTAs launched
# together on one GPC, reading each other's shared memory. CuPy launches only plainly, so these
# call the driver's cuLaunchKernelEx with cuda.h's structures.
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: value {x, y, z}
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: 72 bytes, the value at 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint * 3), ("rest", ctypes.c_char * 52)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig: 56 bytes
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_driver: Any = None


def _driver_api() -> Any:
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.restype = ctypes.c_int
        if hasattr(lib, "cuTensorMapEncodeTiled"):  # CUDA 12 drivers on
            u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
            lib.cuTensorMapEncodeTiled.argtypes = [
                ctypes.POINTER(TensorMap), ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        if hasattr(lib, "cuOccupancyMaxActiveClusters"):
            lib.cuOccupancyMaxActiveClusters.argtypes = [
                ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig)]
            lib.cuOccupancyMaxActiveClusters.restype = ctypes.c_int
        _driver = lib
    return _driver


def kernel_arguments(args: tuple) -> list:
    """ctypes values of a launch's arguments as the kernels declare them: Python ints are
    pointers, numpy scalars (i32, i64, f32) keep their C type, a TensorMap (tensor_map_2d) is
    passed by value."""
    import numpy as np

    out = []
    for a in args:
        if isinstance(a, TensorMap):
            out.append(a)
        elif isinstance(a, np.int32):
            out.append(ctypes.c_int32(int(a)))
        elif isinstance(a, np.int64):
            out.append(ctypes.c_int64(int(a)))
        elif isinstance(a, np.float32):
            out.append(ctypes.c_float(float(a)))
        elif isinstance(a, int) and not isinstance(a, bool):
            out.append(ctypes.c_uint64(a))
        else:
            raise TypeError(f"a launch argument of type {type(a).__name__}")
    return out


_PROGRAMMATIC_ATTR = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=(1, 0, 0))

# Tensor maps (sm_90): how the tensor memory accelerator reads a 2-D global array in boxes;
# cuda.h's CUtensorMap, 128 bytes aligned to 64, made by the driver and passed by value.
_TMA_DTYPES = {torch.float16: 6, torch.bfloat16: 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16
_TMA_SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B
_TMA_L2_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_MAX_TENSOR_MAPS = 256


class TensorMap(ctypes.Structure):
    _fields_ = [("words", ctypes.c_uint64 * 16)]

    @classmethod
    def aligned(cls) -> "TensorMap":
        """A zeroed map at a 64-byte aligned address, as cuda.h aligns CUtensorMap (ctypes
        aligns a structure to its largest field; the map keeps its buffer alive)."""
        raw = (ctypes.c_ubyte * (ctypes.sizeof(cls) + 64))()
        return cls.from_buffer(raw, -ctypes.addressof(raw) % 64)


_tensor_maps: dict[tuple, TensorMap] = {}


def tensor_map_2d(ptr: int, dtype: torch.dtype, rows: int, cols: int, row_stride: int,
                  box_rows: int, box_cols: int) -> TensorMap:
    """The map of a [rows][cols] array of dtype at ptr (row_stride elements apart) in boxes of
    box_rows x box_cols, 128-byte swizzled (box_cols x the element size must be 128 bytes),
    zeros past its ends; cached by its arguments (an eager product's activations recur at a
    handful of addresses)."""
    key = (ptr, dtype, rows, cols, row_stride, box_rows, box_cols)
    found = _tensor_maps.get(key)
    if found is not None:
        return found
    lib = _driver_api()
    size = torch.finfo(dtype).bits // 8
    tmap = TensorMap.aligned()
    err = lib.cuTensorMapEncodeTiled(
        ctypes.byref(tmap), _TMA_DTYPES[dtype], 2, ctypes.c_void_p(ptr),
        (ctypes.c_uint64 * 2)(cols, rows), (ctypes.c_uint64 * 1)(row_stride * size),
        (ctypes.c_uint32 * 2)(box_cols, box_rows), (ctypes.c_uint32 * 2)(1, 1), 0,
        _TMA_SWIZZLE_128B, _TMA_L2_256B, 0)
    if err:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(err, ctypes.byref(text))
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}: "
                           f"{(text.value or b'unknown').decode()}) for {key[1:]}")
    if len(_tensor_maps) >= _MAX_TENSOR_MAPS:
        _tensor_maps.clear()
    _tensor_maps[key] = tmap
    return tmap


def _launch_ex(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
               shared_mem: int, stream: int, programmatic: bool,
               cluster: tuple[int, int, int] | None) -> None:
    lib = _driver_api()
    values = kernel_arguments(args)
    params = (ctypes.c_void_p * max(1, len(values)))(*map(ctypes.addressof, values))
    config = _launch_config(grid, block, shared_mem, stream)
    if cluster:  # built per launch: only the candidates' launches have one
        attrs = (_LaunchAttribute * 2)(_LaunchAttribute(id=_CLUSTER_DIMENSION, value=cluster),
                                       _PROGRAMMATIC_ATTR)
        config.attrs, config.num_attrs = attrs, 1 + int(programmatic)
    else:
        config.attrs, config.num_attrs = ctypes.pointer(_PROGRAMMATIC_ATTR), 1
    # a RawKernel holds its loaded CUfunction in .kernel (a cupy.cuda.Function)
    err = lib.cuLaunchKernelEx(ctypes.byref(config), fn.kernel.ptr, params, None)
    if err:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(err, ctypes.byref(text))
        raise RuntimeError(f"cuLaunchKernelEx failed ({err}: "
                           f"{(text.value or b'unknown').decode()})")


def _launch_config(grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int,
                   stream: int) -> _LaunchConfig:
    """A CUlaunchConfig without its attributes."""
    config = _LaunchConfig()
    config.grid[:] = (tuple(grid) + (1, 1))[:3]
    config.block[:] = (tuple(block) + (1, 1))[:3]
    config.shared_mem, config.stream = shared_mem, stream
    return config


def max_active_clusters(module: str, kernel: str, device: torch.device | int | None,
                        block: tuple[int, int, int], shared_mem: int,
                        cluster: tuple[int, int, int]) -> int | None:
    """Clusters of `cluster` CTAs of `kernel` the device runs at once (the driver's
    cuOccupancyMaxActiveClusters): a cluster's CTAs share one GPC, so where a GPC's SMs are no
    multiple of the cluster some stay idle; None where the driver lacks the call or refuses."""
    lib = _driver_api()
    if not hasattr(lib, "cuOccupancyMaxActiveClusters"):
        return None
    fn = get_function(module, kernel, device, shared_mem)
    attr = (_LaunchAttribute * 1)(_LaunchAttribute(id=_CLUSTER_DIMENSION, value=cluster))
    config = _launch_config(cluster, block, shared_mem, 0)
    config.attrs, config.num_attrs = attr, 1
    count = ctypes.c_int(0)
    with torch.cuda.device(_device_index(device)):
        err = lib.cuOccupancyMaxActiveClusters(ctypes.byref(count), fn.kernel.ptr,
                                               ctypes.byref(config))
    return count.value if err == 0 and count.value > 0 else None


def programmatic_launch(device: torch.device | int | None = None) -> bool:
    """Whether kernels on `device` can be launched programmatically: compute capability 9.0 or
    later and a driver with cuLaunchKernelEx."""
    if not torch.cuda.is_available():
        return False
    index = _device_index(device)
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        _driver_api()
    except (OSError, AttributeError):
        return False
    return True


# Python's garbage collector stays off while any thread captures a CUDA graph: a collection
# inside a capture may destroy an unreachable CUDAGraph (a dead runner's, held by a reference
# cycle), whose teardown the driver refuses while a stream captures, and that refusal
# invalidates the capture in progress.
_captures = 0
_collector_was_enabled = False
_collector_lock = threading.Lock()  # not _lock: a capture never waits on a compile


@contextlib.contextmanager
def collector_paused():
    """No garbage collection inside the block (nestable, across threads); garbage made there
    waits for the next collection after it."""
    global _captures, _collector_was_enabled
    with _collector_lock:
        if _captures == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _captures += 1
    try:
        yield
    finally:
        with _collector_lock:
            _captures -= 1
            if _captures == 0 and _collector_was_enabled:
                gc.enable()


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool: Any = None):
    """torch.cuda.graph(graph, pool=pool) with the garbage collector paused (collector_paused):
    how every capture in the services is taken."""
    with collector_paused(), torch.cuda.graph(graph, pool=pool):
        yield


def arch_used(device: torch.device | int | None = None, module: str = "attention") -> str | None:
    return _arch_used.get((module, _device_index(device)))


def warmup(device: torch.device | int | None = None) -> dict[str, float]:
    """Compile (or load from CuPy's cache) every module of MODULES but LAZY's and load its
    kernels (not ON_DEMAND's candidates); seconds per module."""
    seconds: dict[str, float] = {}
    for name, (_, kernels) in MODULES.items():
        if name in LAZY:
            continue
        start = time.perf_counter()
        for kernel in kernels:
            get_function(name, kernel, device)
        seconds[name] = time.perf_counter() - start
    seconds["total"] = sum(seconds.values())
    return seconds


# Scalar kernel arguments with the C types the kernels declare (numpy scalars, as CuPy wants).
def i32(x: int):
    import numpy as np

    return np.int32(x)


def i64(x: int):
    import numpy as np

    return np.int64(x)


def f32(x: float):
    import numpy as np

    return np.float32(x)
