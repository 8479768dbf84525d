"""F.linear's product, and FP8 W8A8's row-wise scaled one, through a cuBLASLt algorithm timed on
the model's own weights (ctypes, the library torch loaded), choices kept per GPU and library
version so a restarted executor rounds alike (`LinearTuner`). Imports torch only.
"""
from __future__ import annotations

import bisect
import ctypes
import json
import logging
import os
import statistics
import tempfile

import torch
import torch.nn.functional as F

from pagedserve_kernels import _compile, fp8, reference

log = logging.getLogger(__name__)

# cuBLAS / cuBLASLt enums (library_types.h, cublas_api.h, cublasLt.h)
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF, _CUDA_R_8F_E4M3 = 0, 2, 14, 28
_DATA_TYPES = {torch.float16: _CUDA_R_16F, torch.bfloat16: _CUDA_R_16BF}
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
# FP8 products: a float32 scale a row of op(A) (the weight's channels) and a column of B (the
# tokens), the "outer vector" mode (cuBLASLt 12.9 on)
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_OUTER_VEC_32F = 3
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1
_CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "stages": 6}
# split-k parts added up in the output buffer (in an order assumed not fixed): never chosen
_REDUCTION_INPLACE = 1
WORKSPACE_BYTES = 32 << 20
MAX_ALGOS = 16  # heuristic candidates asked for (more than a GPU offers for these shapes)
MARGIN = 0.03  # a cuBLASLt algorithm replaces F.linear only when this much faster
TIMED_WEIGHTS = 4  # weights of a group timed together (distinct: no L2 reuse); at most
TIMED_REPLAYS = 3  # graph replays timed per candidate (median)
_MISMATCH = 0.02  # beyond this (of the output's largest magnitude) not F.linear's product
_RUNG = " rung"  # a choices file key's suffix: the fastest cuBLASLt algorithm at that shape
# Whether executors tune FP8 W8A8 products (the tuner takes them either way): as with the W4A16
# candidate tiles, they join once the GPU tests have passed on them and a GPU measured a gain.
TUNE_FP8 = False


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_cublaslt() -> str:
    """The path of the libcublasLt torch loaded (after a bf16 matmul on the GPU)."""
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    a @ a
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcublasLt" in line})
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    return paths[0]


class CublasLt:
    """The few cuBLASLt calls F.linear's product needs: in cuBLAS's column-major terms
    D[N, M] = op_T(W)[N, K] . X[K, M], W stored as a K x N column-major matrix (torch's [N, K]
    row-major weight), X as K x M (the [M, K] input), D as N x M (the [M, N] output). With
    fp8=True W and X are e4m3 and D[n, m] is scaled by w_scale[n] x x_scale[m] in the float32
    epilogue (fp8_matmul), D in `dtype`."""

    def __init__(self, device: torch.device) -> None:
        self.lib = ctypes.CDLL(_loaded_cublaslt())
        self.lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.version = int(self.lib.cublasLtGetVersion())
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._plans: dict[tuple, tuple] = {}
        self._placeholder: torch.Tensor | None = None  # FP8 searches' scale pointers

    def plan(self, m: int, n: int, k: int, dtype: torch.dtype, fp8: bool = False) -> tuple:
        """(operation, W, X, D descriptors) of one product shape, made once."""
        key = (m, n, k, dtype, fp8)
        if key not in self._plans:
            lib, desc = self.lib, ctypes.c_void_p()
            _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R_32F),
                   "cublasLtMatmulDescCreate")
            attrs = [(_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)]
            if fp8:
                attrs += [(_DESC_A_SCALE_MODE, _SCALE_OUTER_VEC_32F),
                          (_DESC_B_SCALE_MODE, _SCALE_OUTER_VEC_32F)]
            for attr, setting in attrs:
                value = ctypes.c_int32(setting)
                _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value),
                                                          ctypes.c_size_t(4)),
                       "cublasLtMatmulDescSetAttribute")
            layouts = []
            operand = _CUDA_R_8F_E4M3 if fp8 else _DATA_TYPES[dtype]
            # W, X, D; leading dimension = rows
            for (rows, cols), kind in (((k, n), operand), ((k, m), operand),
                                       ((n, m), _DATA_TYPES[dtype])):
                layout = ctypes.c_void_p()
                _check(lib.cublasLtMatrixLayoutCreate(
                    ctypes.byref(layout), kind, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                    ctypes.c_int64(rows)), "cublasLtMatrixLayoutCreate")
                layouts.append(layout)
            self._plans[key] = (desc, *layouts)
        return self._plans[key]

    def algos(self, m: int, n: int, k: int, dtype: torch.dtype,
              count: int = MAX_ALGOS, fp8: bool = False) -> list[Algo]:
        """The heuristic's algorithms for the shape, best guess first, that fit the workspace.
        An FP8 shape's search sees scale pointers set (cuBLASLt may refuse outer-vector scales
        without them, or offer kernels that ignore scales): a placeholder's until a launch sets
        the real ones."""
        desc, w, x, d = self.plan(m, n, k, dtype, fp8)
        if fp8:
            if self._placeholder is None:
                self._placeholder = torch.ones(1, dtype=torch.float32, device=self.workspace.device)
            self._set_scales(desc, self._placeholder, self._placeholder)
        pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)),
               "cublasLtMatmulPreferenceCreate")
        try:
            size = ctypes.c_uint64(WORKSPACE_BYTES)
            _check(self.lib.cublasLtMatmulPreferenceSetAttribute(
                pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.c_size_t(8)),
                "cublasLtMatmulPreferenceSetAttribute")
            results = (_HeuristicResult * count)()
            returned = ctypes.c_int(0)
            _check(self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, w, x, d, d, pref, count, results, ctypes.byref(returned)),
                "cublasLtMatmulAlgoGetHeuristic")
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i].algo for i in range(returned.value)
                if results[i].state == 0 and results[i].workspace_size <= WORKSPACE_BYTES]

    def config(self, algo: Algo) -> dict[str, int]:
        """The algorithm's id, tile, split-k, split-k reduction scheme and stages."""
        out = {}
        for name, attr in _CONFIG_ATTRS.items():
            value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(value), ctypes.c_size_t(4),
                ctypes.byref(written))
            out[name] = int(value.value)
        return out

    def matmul(self, algo: Algo, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """out[M, N] = x[M, K] @ w[N, K]^T on torch's current stream (capturable)."""
        (m, k), n = x.shape, w.shape[0]
        self._launch(self.plan(m, n, k, x.dtype), algo, x, w, out)

    def fp8_matmul(self, algo: Algo, xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                   w_scale: torch.Tensor, out: torch.Tensor) -> None:
        """out[M, N] = (xq[M, K] @ w[N, K]^T) x x_scale[M] x w_scale[N] (e4m3 operands, float32
        scales, contiguous; out bf16 or fp16) on torch's current stream (capturable: the scales'
        addresses are set on the shape's operation before each launch)."""
        (m, k), n = xq.shape, w.shape[0]
        plan = self.plan(m, n, k, out.dtype, True)
        self._set_scales(plan[0], w_scale, x_scale)
        self._launch(plan, algo, xq, w, out)

    def _set_scales(self, desc, a_scale: torch.Tensor, b_scale: torch.Tensor) -> None:
        """The FP8 operation's A (weight channel) and B (token) scale pointers."""
        for attr, scale in ((_DESC_A_SCALE_POINTER, a_scale), (_DESC_B_SCALE_POINTER, b_scale)):
            pointer = ctypes.c_void_p(scale.data_ptr())
            _check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(pointer),
                                                           ctypes.c_size_t(8)),
                   "cublasLtMatmulDescSetAttribute")

    def _launch(self, plan: tuple, algo: Algo, x: torch.Tensor, w: torch.Tensor,
                out: torch.Tensor) -> None:
        """cublasLtMatmul of one plan (operation, W, X, D descriptors) on torch's current
        stream, D written over (beta 0)."""
        desc, wl, xl, dl = plan
        _check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self._one), ctypes.c_void_p(w.data_ptr()), wl,
            ctypes.c_void_p(x.data_ptr()), xl, ctypes.byref(self._zero),
            ctypes.c_void_p(out.data_ptr()), dl, ctypes.c_void_p(out.data_ptr()), dl,
            ctypes.byref(algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(WORKSPACE_BYTES),
            ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)), "cublasLtMatmul")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: cuBLAS status {status}")


def _key(m: int, n: int, k: int, dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')} {m} {n} {k}"


class GemmChoices:
    """What was chosen per product shape ("bfloat16 M N K" -> 8 ints of a cuBLASLt algorithm, or
    None for F.linear) and its rung ("bfloat16 M N K rung" -> the fastest cuBLASLt algorithm, or
    None), read from and written to `path` (None: kept in memory only). A file that does not
    parse is ignored (and replaced on the next save)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.entries: dict[str, list[int] | None] = {}
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    data = json.load(f)
                if not isinstance(data, dict) or not all(
                        v is None or (isinstance(v, list) and len(v) == 8
                                      and all(isinstance(i, int) and 0 <= i < 2**64 for i in v))
                        for v in data.values()):
                    raise ValueError("not a map of shapes to 8 integers or null")
                self.entries = data
            except (OSError, ValueError) as err:
                log.warning("ignoring GEMM choices in %s: %s", path, err)

    def save(self) -> None:
        """Writes the file whole (a temporary, then a rename: two executors writing at once
        leave one's file, never a mix); a folder that cannot be written only costs the next
        start its timing (a warning, not an error)."""
        if not self.path:
            return
        folder = os.path.dirname(self.path) or "."
        tmp = None
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as err:
            log.warning("GEMM choices not saved to %s: %s", self.path, err)
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)


class LinearTuner:
    """F.linear, or for a tuned (rows, weight shape, dtype) the cuBLASLt algorithm found fastest.
    tune() chooses; linear() dispatches on the product's shape alone, so a captured graph keeps
    the kernel chosen before its capture."""

    def __init__(self, device: torch.device, cache_dir: str | None = None) -> None:
        self.device = device
        self.cache_dir = cache_dir  # where the choices file lives; None: memory only
        self._lt: CublasLt | None = None
        self._store: GemmChoices | None = None
        self.algos: dict[tuple, Algo] = {}  # (m, n, k, dtype) -> algorithm; absent: F.linear
        self.tuned: set[tuple] = set()  # (m, n, k, dtype) chosen (algos holds the cuBLASLt ones)
        # (n, k, dtype) -> [(m, the fastest cuBLASLt algorithm at m)], m ascending: the rungs
        self.rungs: dict[tuple, list[tuple[int, Algo]]] = {}
        self._untuned: dict[tuple, Algo | None] = {}  # (m, n, k, dtype) -> its rung's algorithm

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M, K], w: [N, K] -> [M, N] (F.linear's contract), into `out` [M, N] (contiguous)
        when given."""
        if bias is None and self.tuned and x.dim() == 2:
            key = (x.shape[0], w.shape[0], w.shape[1], x.dtype)
            algo = self._algo(key)
            if algo is not None and _lt_ready(x, w, out):
                result = out if out is not None else torch.empty(
                    x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
                if self._run(key, lambda: self._lt.matmul(algo, x, w, result)):
                    return result
        return _linear(x, w, bias, out)

    def fp8_linear(self, xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                   w_scale: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
        """fp8.fp8_scaled_linear's product (xq [M, K] e4m3, x_scale [M, 1] or [1, 1] float32,
        w [N, K] e4m3, w_scale [N] float32), or for a tuned shape the cuBLASLt algorithm found
        fastest (its scales as outer vectors: bf16 out, no bias)."""
        if bias is None and self.tuned and out_dtype == torch.bfloat16 and xq.dim() == 2:
            key = (xq.shape[0], w.shape[0], w.shape[1], FP8)
            algo = self._algo(key)
            if algo is not None and _fp8_ready(xq, x_scale, w, w_scale):
                scale = x_scale.expand(xq.shape[0], 1).contiguous()  # [M, 1]: one per row
                result = torch.empty(xq.shape[0], w.shape[0], dtype=torch.bfloat16,
                                     device=xq.device)
                if self._run(key, lambda: self._lt.fp8_matmul(algo, xq, scale, w, w_scale,
                                                              result)):
                    return result
        return fp8.fp8_scaled_linear(xq, x_scale, w, w_scale, bias, out_dtype)

    def _algo(self, key: tuple) -> Algo | None:
        """The cuBLASLt algorithm of a product shape: the tuned choice, else its rung."""
        return self.algos.get(key) if key in self.tuned else self._rung(key)

    def _run(self, key: tuple, launch) -> bool:
        """Launches a shape's algorithm; False where cuBLASLt refuses an untuned shape's rung
        (nothing ran), which then takes the library's own product from now on."""
        try:
            launch()
        except RuntimeError:
            if key in self.tuned:
                raise  # ran at this very shape when chosen
            self._untuned[key] = None
            return False
        return True

    def _rung(self, key: tuple) -> Algo | None:
        """The algorithm of an untuned row count: that of the smallest tuned count above it
        (the largest below, past the last); None without rungs for the weight's shape.

        Never F.linear where a rung exists: the first product of every cuBLAS kernel a process runs
        waits for the GPU to go idle, and F.linear picks a kernel per row count, so an eager step
        with new row counts would hold its launch until the previous step's GPU work was done. The
        rungs' kernels all ran while tuning, so they never wait."""
        if key in self._untuned:
            return self._untuned[key]
        m, n, k, dtype = key
        rungs = self.rungs.get((n, k, dtype))
        algo = None
        if rungs:
            i = bisect.bisect_left(rungs, m, key=lambda rung: rung[0])
            algo = rungs[min(i, len(rungs) - 1)][1]
        self._untuned[key] = algo
        return algo

    def tune(self, rows: list[int], groups: dict[str, list],
             force_lt: bool = False) -> list[dict]:
        """For each row count and each group of same-shape weights (a model's layers: bf16/fp16
        tensors, or FP8 W8A8's (e4m3 weight, float32 scale per channel) pairs), time the
        library's own product (F.linear's; fp8.fp8_scaled_linear's) against cuBLASLt's heuristic
        algorithms over the group (inside a CUDA graph) and keep the fastest if it beats the
        library by MARGIN (force_lt: keep it anyway; tests); the fastest is that row count's rung
        either way. Shapes the choices file already holds (the choice and the rung) are not
        timed again. Returns one report row per timed product."""
        report, store = [], self._choices()
        for name, weights in groups.items():
            kind = _kind(weights[0])
            if kind is None or any(_kind(w) != kind for w in weights):
                continue
            n, k = _shape(weights[0])
            for m in rows:
                key = _key(m, n, k, kind)
                rung_key = key + _RUNG
                if key in store.entries and rung_key in store.entries and not force_lt:
                    if self._adopt(m, weights[0], store.entries[key], store.entries[rung_key],
                                   True):
                        continue
                    log.warning("GEMM choice %s from %s fails or differs: timing it again", key,
                                store.path)
                row = self.time_choices(name, m, weights[:TIMED_WEIGHTS])
                best = row["best"]
                faster = best is not None and best["us"] < (1 - MARGIN) * row["linear_us"]
                keep = best is not None and (force_lt or faster)
                store.entries[key] = list(best["algo"]) if keep else None
                store.entries[rung_key] = list(best["algo"]) if best is not None else None
                self._adopt(m, weights[0], store.entries[key], store.entries[rung_key], False)
                report.append(row)
        store.save()
        return report

    def _adopt(self, m: int, w, chosen: list[int] | None, rung: list[int] | None,
               check: bool) -> bool:
        """Uses `chosen` (None: the library's product) for m rows of weights shaped as `w`, and
        `rung` (None: no cuBLASLt algorithm qualified) as its rung. With `check` (choices read
        from the file, whoever wrote them), each algorithm runs once on `w` first, and the
        library's product too when chosen (so no kernel of theirs first runs in a step): an
        algorithm cuBLASLt refuses, or whose product is not the library's, is not used and False
        is returned."""
        (n, k), kind = _shape(w), _kind(w)
        algos = {}
        for data in (chosen, rung):
            if data is not None and tuple(data) not in algos:
                algo = Algo((ctypes.c_uint64 * 8)(*data))
                if check and not self._computes_linear(algo, m, w):
                    return False
                algos[tuple(data)] = algo
        if check and chosen is None:
            _Product(self._lt, m, w, self.device).library(w)
        key = (m, n, k, kind)
        self.tuned.add(key)
        if chosen is None:
            self.algos.pop(key, None)
        else:
            self.algos[key] = algos[tuple(chosen)]
        ladder = [r for r in self.rungs.get((n, k, kind), []) if r[0] != m]
        if rung is not None:
            bisect.insort(ladder, (m, algos[tuple(rung)]), key=lambda r: r[0])
        self.rungs[(n, k, kind)] = ladder
        self._untuned.clear()
        return True

    def _computes_linear(self, algo: Algo, m: int, w) -> bool:
        product = _Product(self._cublaslt(), m, w, self.device)
        try:
            product.run(algo, w)
        except RuntimeError:
            return False
        ref = product.library(w).float()
        return (float((product.out.float() - ref).abs().max())
                <= _MISMATCH * (float(ref.abs().max()) or 1.0))

    def choices_path(self) -> str | None:
        """The choices file of this GPU and cuBLASLt version in cache_dir (None without one)."""
        if not self.cache_dir:
            return None
        gpu = torch.cuda.get_device_name(self.device).replace(" ", "_").replace("/", "_")
        return os.path.join(self.cache_dir, f"gemm-{gpu}-cublaslt{self._cublaslt().version}.json")

    def _choices(self) -> GemmChoices:
        path = self.choices_path()
        if self._store is None or self._store.path != path:  # read once per file
            self._store = GemmChoices(path)
        return self._store

    def _cublaslt(self) -> CublasLt:
        if self._lt is None:
            self._lt = CublasLt(self.device)
        return self._lt

    def time_choices(self, name: str, m: int, weights: list) -> dict:
        """Per-product µs of the library's product and of each heuristic algorithm
        (`candidates`, in the heuristic's order) over `weights` (repeated to at least 4
        products), each checked against the library's result; `best`: the fastest algorithm,
        with its 8 integers."""
        product = _Product(self._cublaslt(), m, weights[0], self.device)
        calls = weights * -(-4 // len(weights))
        ref = product.library(weights[0]).float()
        scale = float(ref.abs().max()) or 1.0
        row = {"product": name, "m": m, "n": product.n, "k": product.k,
               "linear_us": graph_us(lambda: [product.library(w) for w in calls],
                                     TIMED_REPLAYS) / len(calls),
               "best": None, "algos": 0, "candidates": []}
        try:
            algos = product.algos()
        except RuntimeError as exc:  # no such product in this cuBLASLt (FP8's outer vectors)
            log.warning("%s m=%d: no cuBLASLt algorithm: %s", name, m, exc)
            algos = []
        for rank, algo in enumerate(algos):
            config = product.lt.config(algo)
            if config["splitk"] > 1 and config["reduction"] == _REDUCTION_INPLACE:
                continue  # a restarted executor must get the same bits
            try:
                product.run(algo, weights[0])
            except RuntimeError as exc:  # offered by the search, refused at the launch
                log.warning("%s m=%d: cuBLASLt algorithm %d refused: %s", name, m, rank, exc)
                continue
            if float((product.out.float() - ref).abs().max()) > _MISMATCH * scale:
                continue  # not the product the library computes: never chosen
            try:
                us = graph_us(lambda: [product.run(algo, w) for w in calls],
                              TIMED_REPLAYS) / len(calls)
            except RuntimeError as exc:  # one heuristic algorithm that fails in a capture
                log.warning("%s m=%d: cuBLASLt algorithm %d skipped: %s", name, m, rank, exc)
                torch.cuda.synchronize(self.device)  # a sticky error surfaces here, not later
                continue
            row["algos"] += 1
            row["candidates"].append({"rank": rank, "us": us, **config})
            if row["best"] is None or us < row["best"]["us"]:
                row["best"] = {"us": us, "rank": rank, "algo": [int(v) for v in algo.data],
                               **config}
        return row


FP8 = torch.float8_e4m3fn


def _kind(weight) -> torch.dtype | None:
    """The dtype a weight's products are tuned and looked up under: a dense bf16/fp16 weight's
    own, FP8 for an FP8 W8A8 (e4m3 weight [N, K], float32 scale [N]) pair; None: never tuned."""
    if isinstance(weight, tuple):
        w, scale = weight
        ok = (w.dtype == FP8 and w.dim() == 2 and w.is_contiguous()
              and scale.dtype == torch.float32 and scale.is_contiguous()
              and scale.numel() == w.shape[0])
        return FP8 if ok else None
    return weight.dtype if weight.dtype in _DATA_TYPES and weight.is_contiguous() else None


def _shape(weight) -> tuple[int, int]:
    w = weight[0] if isinstance(weight, tuple) else weight
    return w.shape[0], w.shape[1]


class _Product:
    """One product shape as the tuner runs it on random rows: the library's own (F.linear's, or
    for an FP8 pair fp8.fp8_scaled_linear's over rows quantized per token) and a cuBLASLt
    algorithm's into `out`."""

    def __init__(self, lt: CublasLt | None, m: int, weight, device: torch.device) -> None:
        self.lt, self.fp8 = lt, isinstance(weight, tuple)
        self.n, self.k = _shape(weight)
        if self.fp8:
            # rows whose magnitudes span 2^-6..2^6, so that per-token scales differ and one
            # applied to the wrong row or axis shows in the comparison
            spread = torch.exp2(torch.linspace(-6, 6, m, device=device))[torch.randperm(
                m, device=device)]
            rows = (torch.randn(m, self.k, device=device) * spread[:, None]).bfloat16()
            self.x, self.x_scale = reference.quantize_fp8(rows)
            dtype = torch.bfloat16
        else:
            dtype = weight.dtype
            self.x = torch.randn(m, self.k, dtype=dtype, device=device)
        self.out = torch.empty(m, self.n, dtype=dtype, device=device)  # the algorithms'
        self.library_out = torch.empty_like(self.out)

    def library(self, weight) -> torch.Tensor:
        if self.fp8:
            return fp8.fp8_scaled_linear(self.x, self.x_scale, *weight, None, torch.bfloat16)
        return torch.mm(self.x, weight.t(), out=self.library_out)

    def run(self, algo: Algo, weight) -> None:
        if self.fp8:
            self.lt.fp8_matmul(algo, self.x, self.x_scale, *weight, self.out)
        else:
            self.lt.matmul(algo, self.x, weight, self.out)

    def algos(self) -> list[Algo]:
        m = self.x.shape[0]
        if self.fp8:
            return self.lt.algos(m, self.n, self.k, torch.bfloat16, fp8=True)
        return self.lt.algos(m, self.n, self.k, self.out.dtype)


def _lt_ready(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """cuBLASLt's layouts here: dense row-major [M, K], [N, K] and the output [M, N], 16-byte
    aligned, one dtype."""
    return (x.dtype == w.dtype and x.dtype in _DATA_TYPES and x.is_contiguous()
            and w.is_contiguous()
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and x.device == w.device
            and (out is None or (out.dtype == x.dtype and out.is_contiguous()
                                 and out.data_ptr() % 16 == 0)))


def _fp8_ready(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
               w_scale: torch.Tensor) -> bool:
    """cuBLASLt's FP8 layouts here: dense row-major e4m3 [M, K] and [N, K], float32 scales (one
    per token, or one for all; one per channel), each 256-byte aligned as the algorithm search
    assumes by default."""
    tensors = (xq, x_scale, w, w_scale)
    return (xq.dtype == w.dtype == FP8 and xq.shape[1] == w.shape[1]
            and x_scale.dtype == w_scale.dtype == torch.float32
            and x_scale.numel() in (1, xq.shape[0]) and w_scale.numel() == w.shape[0]
            and all(t.is_contiguous() and t.data_ptr() % 256 == 0 and t.device == xq.device
                    for t in tensors))


def graph_us(fn, replays: int = 5) -> float:
    """GPU µs of fn() (launches only) captured in a CUDA graph, median of `replays` replays."""
    fn()  # loads kernels, sizes workspaces, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _compile.graph_capture(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None) -> torch.Tensor:
    """F.linear, into `out` when given through the products F.linear itself calls for 2-D
    inputs (addmm with a bias, else mm), so the values are the same."""
    if out is None or x.dim() != 2:
        y = F.linear(x, w, bias)
        return y if out is None else out.copy_(y)
    if bias is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(bias, x, w.t(), out=out)
