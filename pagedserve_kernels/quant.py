"""W4A16 products (csrc/quant.cu): an int4 weight repacked once at load (`repack`, pure torch, runs
on the CPU too) into the kernel's layout, dequantized in registers, multiplied on tensor cores;
bf16/fp16 activations, any row count, capturable. Imports cupy only when launching.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import threading
from dataclasses import dataclass, replace

import torch

from pagedserve_kernels import _compile
from pagedserve_kernels._compile import i32 as _i32, i64 as _i64

log = logging.getLogger(__name__)

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# The dequant ors a nibble into the mantissa of this value (128 + n, 1024 + n: exact); a zero
# point is stored as base + zero so (q - zero) is one exact subtraction in the kernel.
MAGIC_BASE = {torch.bfloat16: 128, torch.float16: 1024}
SYMMETRIC_ZERO = 8
PACK = 8  # nibbles per int32
CHUNK = 32  # input rows per packed tile (and the finest group size the kernel reads)
CTA_N = 128  # output columns per thread block (the padded N is a multiple)
STAGE_K = 64  # input rows per pipeline stage (the padded K is a multiple)
_THREADS = 256
DEQUANT_CHUNKS = 8  # k32 chunks a dequantize CTA takes (quant.cu's DQ_CHUNKS)
_STAGES = {1: 6, 2: 5, 4: 4, 8: 4}  # m16 tiles per CTA -> pipeline stages (Cfg in quant.cu)
_STAGES_WG = {4: 6, 8: 4}  # the same for the wgmma kernels (WgCfg in quant.cu)
_STAGES_WGT = {4: 8, 8: 6, 16: 4}  # the same for the producer-fed wgmma tiles (WtCfg)
_STAGES_WGW = 8  # the same for their 256-column form (WtCfg<TOK, 256>)
_WGT_THREADS = 384  # their two consumer warpgroups and their producer warpgroup
_MIN_SPLIT_STAGES = 4  # a split-K part covers at least 256 input rows
PROLOGUE_STAGES = 2  # a thread block's pipeline fill, in stage-times (split_k_choice's model)
WORKSPACE_FLOATS = 1 << 22  # split-K partials per device (16 MiB)
MAX_SPLIT_TILES = 4096  # (row tile, column block) counters per device
# From this many rows a product dequantizes its weight into the device's scratch and runs
# cuBLAS: the kernel re-reads and re-dequantizes the weight for every 64-row tile, which from
# some row count costs more than one dequantizing pass. tune_dequant_rows measures where on the
# device; this is the threshold without it (benchmarks/bench_quant.py, dequant + cuBLAS).
DEQUANT_ROWS = 384
DEQUANT_CANDIDATES = (128, 256, 384, 512, 768, 1024, 2048)  # the row counts tuning times
NEVER = 1 << 30  # a threshold no step reaches: the kernel at every row count
# A product's row tile: (rows a CTA takes, kernel family: "" mma.sync, "wgp" wgmma with the
# dequantizing overlapping the warpgroup's own MMAs, "wgt" wgmma fed by a producer warpgroup,
# "wgs" the wgt tile on a stream-K grid: one CTA an SM, each an equal share of the tiles' K
# stages, so that no SM idles through a last partial wave; "wgw" the wgt tile over 256 columns,
# which reads x from L2 half as often; "wgm" / "wgq" the wgt tile in clusters sharing x, below).
# Up to 32 rows, 16 or 32 on mma.sync; from 33, 64 on mma.sync unless tuning
# (tune_dequant_rows) measured another of TUNED_TILES faster for the product's shape at the
# largest of TILE_CANDIDATES not above the row count: larger tiles dequantize each weight tile
# once for more rows at fewer CTAs an SM; the wgmma kernels (Hopper: the module built for
# sm_90a) multiply on the warpgroup tensor cores. Each shape its own tiles: at one row count
# the best tile of a narrow product (few column blocks) is not a wide one's. Tuning takes any
# tile only where its output agrees with the 64-row kernel's.
Tile = tuple[int, str]
NARROW_TILE: Tile = (64, "")
TUNED_TILES: tuple[Tile, ...] = ((64, ""), (128, ""), (64, "wgp"), (128, "wgp"),
                                 (64, "wgt"), (128, "wgt"), (256, "wgt"),
                                 (64, "wgs"), (128, "wgs"), (256, "wgs"),
                                 (64, "wgw"), (128, "wgw"),
                                 (128, "wgm"), (256, "wgm"), (128, "wgq"), (256, "wgq"))
# The 128- and 256-row producer-fed tiles in clusters of 2 ("wgm") or 4 ("wgq") neighbouring
# column blocks (Hopper) whose stages' x tiles each CTA loads its share of through the tensor
# memory accelerator into all of them (quant.cu's wgt_load_x_mc), so that a wide product reads x
# from L2 a half or a quarter as often; else the wgt tile.
MULTICAST = {"wgm": 2, "wgq": 4}  # family -> CTAs a cluster
MULTICAST_TILES: tuple[Tile, ...] = ((128, "wgm"), (256, "wgm"), (128, "wgq"), (256, "wgq"))
# The families built on the wgt tile's CTA (WtCfg<rows>: its shared memory and 384 threads).
_PRODUCER_FED = ("wgt", "wgs", *MULTICAST)
# The families whose last partial wave tuning may split off into a second launch over the rest
# of the column blocks (_kernel_product's last_wave), in one of WAVE_FORMS: "parts", the wgt
# tile of the same rows with K in parts; "stream", the wgs tile of the same rows sharing the
# rest's K stages out evenly over one CTA an SM (a data-parallel head, a stream-K rest).
_WAVE_SPLIT = ("wgt", *MULTICAST)
WAVE_FORMS = ("parts", "stream")
# The forms tuning times: as with CANDIDATE_TILES, a form joins once the GPU tests have passed on
# it and a GPU has measured it faster somewhere ("stream" waits for both).
TUNED_WAVE_FORMS = ("parts",)
LAST_WAVE_GAIN = 0.98  # tuning splits the last wave off only where it takes under this share
# Tiles bench_quant and the GPU tests run but tuning does not offer: a new tile waits here until
# the GPU tests have passed on it and a GPU has measured it faster somewhere.
CANDIDATE_TILES: tuple[Tile, ...] = ()
# Candidates for the 16- and 32-row tiles (Hopper, their own module, built on first use): their
# K parts summed through a thread block cluster's shared memory (quant.cu's cluster_splits)
# instead of global partials, a fence and an arrival counter, so at most MAX_CLUSTER parts.
CLUSTER_TILES: tuple[Tile, ...] = ((16, "cl"), (32, "cl"))
CLUSTER_MODULE = "quant_cluster"
MAX_CLUSTER = 8  # CTAs in a portable cluster
# K part counts tuning times for the 16- and 32-row tiles beside split_k_choice's own: even
# parts of K (a power of two of its stages) can beat the model's count, which weighs waves of
# thread blocks, not the uneven last part or the memory parallelism of more blocks.
SPLIT_CANDIDATES = (1, 2, 4, 8, 16)
SMALL_TILES = (16, 32)  # the row tiles of up to 32 rows
# The row counts at which tuning times a small tile's K parts: each count's choice serves the
# row counts above the one before it, so that a decode step of one seq does not run the parts
# the tile's sixteen rows were fastest with (fewer, as its activations and MMAs weigh more).
SMALL_TUNE_ROWS = {16: (1, 4, 16), 32: (32,)}
# The row counts tuning picks tiles at by default; the executor adds its decode graphs' batch
# sizes, so that a batch of 160 rows does not run the tile chosen for 128 (two row tiles of a
# 128-row one where one 256-row tile would do).
TILE_CANDIDATES = (64, 128, 256, 384, 512, 768, 1024, 2048)

_lock = threading.Lock()
_workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_stream_k_parts: dict[int, torch.Tensor] = {}  # device -> the wgs kernels' fp32 parts
_scratch: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (device, dtype) -> flat weight
Shape = tuple[int, int]  # a product's (N, K)
# (device, N, K) -> the shape's measured threshold (tune_dequant_rows)
_dequant_rows: dict[tuple[int, int, int], int] = {}
# (device, dtype) -> {(N, K): {TILE_CANDIDATES row count: its tile}}: tuned, and checked, per
# dtype and shape
_tiles: dict[tuple[int, torch.dtype], dict[Shape, dict[int, Tile]]] = {}
# (device, dtype) -> {(N, K): {a SMALL_TUNE_ROWS row count: the K parts tuning measured fastest
# there}}; a row count without an entry keeps split_k_choice's count
_split_counts: dict[tuple[int, torch.dtype], dict[Shape, dict[int, int]]] = {}
# (device, dtype) -> {(N, K): {a TILE_CANDIDATES row count: the WAVE_FORMS form tuning measured
# its tile fastest with its last partial wave split off in, None where whole was}}
_last_waves: dict[tuple[int, torch.dtype], dict[Shape, dict[int, str | None]]] = {}
_resident: dict[tuple[str, int], int] = {}
_slots: dict[tuple[str, int], int] = {}  # (kernel, device) -> _wave_slots
# device -> whether the products are launched programmatically (prepare() decides; see
# set_programmatic): each product kernel's start and first weight loads overlap the end of the
# kernel before it, which matters most for the short products of decode steps.
_programmatic: dict[int, bool] = {}
# Up to this many rows (the decode graphs' sizes, whose launches are captured once): past them a
# product's ramp is a sliver of its time, and an eager launch through ctypes costs host time.
PROGRAMMATIC_ROWS = 1024
# From this many rows: launched programmatically, the 16-row tile slows decode steps of 4-16
# seqs (the o and down products; the cause is open, NOTES.md) where the larger tiles gain.
PROGRAMMATIC_MIN_ROWS = SMALL_TILES[0] + 1


@dataclass(frozen=True)
class PackedInt4:
    """An int4 linear in the kernel's layout (quant.cu's header comment): N, K padded to
    multiples of 128 and 64 with zero scales; `unpack` inverts it."""

    qweight: torch.Tensor  # [Np / 32, Kp / 32, 32, 4] int32: (n32 block, k32 chunk), lane, word
    scales: torch.Tensor  # [ceil(Kp / group), Np / 32, 8, 4]: group, n32 block, g, j (col 8j + g)
    zeros: torch.Tensor | None  # as scales, MAGIC_BASE + zero point; None: symmetric (8)
    n: int
    k: int
    group_size: int  # input rows per group (k for one group per output column)
    perm: torch.Tensor | None  # [K] int64: row k multiplies x[:, perm[k]] (act-order); None: id

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), as a dense weight's."""
        return self.n, self.k

    def to(self, device: torch.device | str) -> "PackedInt4":
        return replace(self, qweight=self.qweight.to(device), scales=self.scales.to(device),
                       zeros=None if self.zeros is None else self.zeros.to(device),
                       perm=None if self.perm is None else self.perm.to(device))


def repack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
           group_size: int, perm: torch.Tensor | None = None,
           dtype: torch.dtype | None = None) -> PackedInt4:
    """The kernel's layout of reference.dequantize_int4's arguments (Int4Weight's fields).

    qweight: [K / 8, N] int32, nibble j of word r is row 8r + j (0..15)
    scales: [K / group_size, N]; zeros: [K / group_size, N] uint8 0..16, or None for 8
    group_size: a multiple of 32, or K (one group per column); perm: [K] or None
    dtype: the activations' (bf16/fp16), scales' by default. Runs where the tensors are.
    """
    dtype = scales.dtype if dtype is None else dtype
    n, k = _check_int4(qweight, scales, zeros, group_size, perm, dtype)
    kp, np_ = _round_up(k, STAGE_K), _round_up(n, CTA_N)
    kc, nb = kp // CHUNK, np_ // CHUNK
    q = torch.zeros(kp, np_, dtype=torch.uint8, device=qweight.device)  # padding: any finite
    q[:k, :n] = unpack_rows(qweight)
    # row 32c + 16kh + 8kb + 2t + h, column 32b + 8j + g -> word [b, c, g, t, j], nibble 4h+2kh+kb
    q = q.view(kc, 2, 2, 4, 2, nb, 4, 8).permute(5, 0, 7, 3, 6, 4, 1, 2).reshape(nb, kc, 32, 4, 8)
    words = _words(q)
    groups = -(-kp // group_size)
    packed_scales = _pack_groups(scales.to(dtype), groups, np_, 0)
    packed_zeros = None
    if zeros is not None:
        base = MAGIC_BASE[dtype]
        packed_zeros = _pack_groups((zeros.float() + base).to(dtype), groups, np_,
                                    base + SYMMETRIC_ZERO)
    if perm is not None:
        perm = perm.to(torch.int64).contiguous()
    return PackedInt4(words.contiguous(), packed_scales, packed_zeros, n, k, group_size, perm)


def unpack(packed: PackedInt4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qweight, scales, zeros) as `repack` took them: the inverse of its layout."""
    n, k, group = packed.n, packed.k, packed.group_size
    nb, kc = packed.qweight.shape[:2]
    shifts = torch.arange(PACK, dtype=torch.int32, device=packed.qweight.device) * 4
    q = (packed.qweight.unsqueeze(-1) >> shifts) & 0xF  # [b, c, lane, j, nibble]
    q = q.view(nb, kc, 8, 4, 4, 2, 2, 2).permute(1, 6, 7, 3, 5, 0, 4, 2)
    q = q.reshape(kc * CHUNK, nb * CHUNK)[:k, :n]
    scales = _unpack_groups(packed.scales)[: k // group, :n]
    zeros = None
    if packed.zeros is not None:
        zeros = (_unpack_groups(packed.zeros)[: k // group, :n].float()
                 - MAGIC_BASE[packed.dtype]).to(torch.uint8)
    return pack_rows(q), scales, zeros


def int4_linear(x: torch.Tensor, packed: PackedInt4, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x[:, perm] @ W^T (+ bias), W = (q - zero) * scale as reference.int4_linear computes it,
    fp32 accumulation, one rounding. From the threshold tuning measured for the device and the
    weight's shape (tune_dequant_rows; else DEQUANT_ROWS) rows, where `prepare` gave the device
    a scratch weight, the weight is dequantized there and cuBLAS multiplies (fp32
    accumulation).

    x: [num_tokens, K] packed.dtype (bf16/fp16) on packed's GPU; any strides (copied when the
       kernel cannot read them: last dim not contiguous, row stride or start not 16-byte aligned)
    bias: [N] x's dtype or None; out: [num_tokens, N], last dim contiguous, or None (allocated)
    returns out. Capturable once `prepare(device)` has run; the split-K workspace is shared by
    all products of a device, so launch them on one stream.
    """
    _check_x(x, packed)
    num_tokens, n = x.shape[0], packed.n
    out = _check_out(out, num_tokens, n, x)
    if num_tokens == 0:
        return out
    if packed.perm is not None:
        x = x.index_select(1, packed.perm)
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    if bias is not None:
        bias = _check_bias(bias, n, x)
    index = _index(x.device)
    if num_tokens >= _dequant_rows.get((index, n, packed.k), DEQUANT_ROWS):
        scratch = _scratch.get((index, x.dtype))
        if scratch is not None and scratch.numel() >= n * packed.k:
            return _dequantized_product(x, packed, bias, out, scratch)
    return _kernel_product(x, packed, bias, out)


def _dequantized_product(x, packed: PackedInt4, bias, out, scratch) -> torch.Tensor:
    """out = x @ W^T (+ bias) with W dequantized into the scratch (x permuted and checked)."""
    weight = dequantize(packed, scratch[:packed.n * packed.k].view(packed.n, packed.k))
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _kernel_product(x, packed: PackedInt4, bias, out, tile: Tile | None = None,
                    splits: int | None = None, last_wave: str | bool | None = None
                    ) -> torch.Tensor:
    """out = x @ W^T (+ bias) in the W4A16 kernel (x permuted, contiguous rows, checked), in row
    tiles `tile` ((16, 32, 64 or 128 rows, "") on mma.sync, (16 or 32, "cl") the candidates
    summing K parts through a cluster (Hopper), (64 or 128, "wgp"), (64, 128 or 256, "wgt" or
    "wgs"), (64 or 128, "wgw") and (128 or 256, "wgm" or "wgq") on wgmma; None: tile_for's
    choice), K in `splits` parts (None: what tuning measured fastest for the 16- and 32-row
    tiles, else split_k_choice's; a count past what the workspace or K allows is lowered to it:
    bench_quant's --splits; "wgs" shares K out itself). `last_wave` (a "wgt", "wgm" or "wgq"
    tile with K whole), one of WAVE_FORMS: launch the column blocks of the whole waves of tiles
    as they are and the rest in a second launch ("parts": the wgt tile with K in parts;
    "stream": the wgs tile), so that the SMs a partial last wave would leave idle share its work
    (head_blocks); None: the form tuning measured fastest, if any; False: one launch."""
    num_tokens = x.shape[0]
    kernel, mt, m_tiles, splits, split_stages = launch_shape(num_tokens, packed, x.device,
                                                             x.dtype, tile, splits)
    kp, np_ = packed.qweight.shape[1] * CHUNK, packed.qweight.shape[0] * CHUNK
    family = _family(kernel)
    blocks = _column_blocks(np_, family)
    if last_wave is None:
        last_wave = (tile is None and num_tokens > SMALL_TILES[-1]
                     and _last_wave_form(num_tokens, x.device, x.dtype, (packed.n, packed.k)))
    split = (wave_split(kernel, x.device, num_tokens, m_tiles, packed, last_wave)
             if last_wave and splits == 1 else None)
    if split is None:
        _launch_product(x, packed, bias, out, kernel, mt, m_tiles, splits, split_stages, 0,
                        blocks)
        return out
    head, tail, tail_splits, tail_stages = split
    _launch_product(x, packed, bias, out, kernel, mt, m_tiles, 1, split_stages, 0, head)
    _launch_product(x, packed, bias, out, tail, mt, m_tiles, tail_splits, tail_stages, head,
                    np_ // CTA_N - head)
    return out


def wave_split(kernel: str, device: torch.device, num_tokens: int, m_tiles: int,
               packed: PackedInt4, form: str = "parts") -> tuple[int, str, int, int] | None:
    """How `kernel` (K whole) splits its last partial wave off on `packed` in `form` (one of
    WAVE_FORMS): (head_blocks, the rest's kernel of the same rows, its K parts, stages a part:
    for "stream" 1 and K's stages, the wgs tile sharing them out itself); None where its family
    has no such split, its tiles fill whole waves or none, the rest would get K whole in parts
    (two launches for one) or has more tiles than the arrival counters."""
    assert form in WAVE_FORMS, form
    if _family(kernel) not in _WAVE_SPLIT:
        return None
    # packed.qweight: [Np / 32, Kp / 32, 32, 4]: Np / 128 column blocks, Kp / 64 K stages
    n_blocks, k_stages = packed.qweight.shape[0] // 4, packed.qweight.shape[1] // 2
    head = head_blocks(kernel, device, m_tiles, n_blocks)
    if not head:
        return None
    rest = n_blocks - head
    if form == "stream":
        tail = kernel.replace(f"_{_family(kernel)}_", "_wgs_")
        return (head, tail, 1, k_stages) if m_tiles * rest <= MAX_SPLIT_TILES else None
    tail = kernel.replace(f"_{_family(kernel)}_", "_wgt_")
    splits, stages = _splits(tail, device, m_tiles, rest, k_stages, num_tokens * rest * CTA_N,
                             min(num_tokens, _kernel_rows(kernel)))
    return (head, tail, splits, stages) if splits > 1 else None


def has_wave_split(num_tokens: int, packed: PackedInt4, device: torch.device,
                   dtype: torch.dtype, tile: Tile, form: str = "parts") -> bool:
    """Whether a product of num_tokens rows in `tile` has a last wave to split off in `form`
    (K whole in the tile, wave_split's split)."""
    kernel, _, m_tiles, splits, _ = launch_shape(num_tokens, packed, device, dtype, tile)
    return splits == 1 and wave_split(kernel, device, num_tokens, m_tiles, packed,
                                      form) is not None


def _last_wave_form(num_tokens: int, device: torch.device, dtype: torch.dtype,
                    shape: Shape) -> str | None:
    """The form tuning split the last wave off in at the row count tile_for takes the tile of
    (None: whole)."""
    chosen = _last_waves.get((_index(device), dtype), {}).get(shape) if _last_waves else None
    if not chosen:
        return None
    return chosen[_bucket(chosen, num_tokens)]


def head_blocks(kernel: str, device: torch.device, m_tiles: int, n_blocks: int) -> int:
    """The column blocks (from 0) whose tiles, over every row tile, fill the product's whole
    waves (its SMs x the CTAs an SM holds), a multiple of the kernel's cluster; 0 where the
    tiles fill whole waves already, or fill none."""
    slots = _wave_slots(kernel, device)
    tiles = m_tiles * n_blocks
    if tiles < slots or tiles % slots == 0:
        return 0
    head = tiles // slots * slots // m_tiles
    head -= head % MULTICAST.get(_family(kernel), 1)
    return head if 0 < head < n_blocks else 0


def _wave_slots(kernel: str, device: torch.device) -> int:
    """CTAs of `kernel` the device runs at once: its SMs x the CTAs an SM holds, or for a
    multicast tile the clusters the driver says fit (GPCs' SMs may leave some idle) x their
    size."""
    key = (kernel, _index(device))
    if key not in _slots:
        slots = _sm_count(device) * _resident_ctas(kernel, device)
        size = MULTICAST.get(_family(kernel))
        if size:
            mt = _kernel_rows(kernel) // 16
            clusters = _compile.max_active_clusters(
                _module(_family(kernel)), kernel, device, (_threads(kernel), 1, 1),
                _smem_bytes(mt, _family(kernel)), (size, 1, 1))
            slots = clusters * size if clusters else slots
        _slots[key] = slots
    return _slots[key]


def _launch_product(x, packed: PackedInt4, bias, out, kernel: str, mt: int, m_tiles: int,
                    splits: int, split_stages: int, first: int, blocks: int) -> None:
    """One launch of `kernel` over the column blocks [first, first + blocks) of the product: the
    weights, scales, zero points, bias and output from column 128 x first on (the scales' and
    zero points' rows keep the product's stride, Np), N counted from there; the split-K
    partials as wide as the launch's columns."""
    num_tokens, family = x.shape[0], _family(kernel)
    kp, np_ = packed.qweight.shape[1] * CHUNK, packed.qweight.shape[0] * CHUNK
    col = first * CTA_N
    # only the wgt and wgs tiles read no further than their blocks: wgw, wgm and wgq bound
    # their loads by column blocks counted from column 0
    assert not col or family in ("wgt", "wgs"), (kernel, first)
    grid = (blocks, splits, m_tiles)
    ws_ptr = counters_ptr = 0
    if family == "wgs":  # its last argument: the launch's column blocks, whose K it shares out
        grid = (stream_k_ctas(m_tiles * blocks * (kp // STAGE_K), x.device), 1, 1)
        split_stages = blocks
        ws_ptr = _stream_k_workspace(x.device).data_ptr()
        counters_ptr = _workspace(x.device)[1].data_ptr()
    elif splits > 1 and family != "cl":  # "cl": the partials stay in the cluster
        ws, counters = _workspace(x.device)
        ws_ptr, counters_ptr = ws.data_ptr(), counters.data_ptr()

    y_ptr, qw_ptr, s_ptr, z_ptr, b_ptr = (out.data_ptr(), packed.qweight.data_ptr(),
                                          packed.scales.data_ptr(), _ptr(packed.zeros), _ptr(bias))
    if col:  # packed.qweight: [Np / 32, Kp / 32, 32, 4] int32, n32 block col / 32 on
        y_ptr += col * out.element_size()
        s_ptr += col * packed.scales.element_size()  # each row keeps its stride: Np
        z_ptr = z_ptr and z_ptr + col * packed.zeros.element_size()
        b_ptr = b_ptr and b_ptr + col * bias.element_size()
        qw_ptr += col // 32 * packed.qweight.stride(0) * packed.qweight.element_size()
    args = (y_ptr, _i64(out.stride(0)), x.data_ptr(), _i64(x.stride(0)), qw_ptr, s_ptr, z_ptr,
            b_ptr, ws_ptr, counters_ptr, _i32(num_tokens), _i32(packed.n - col), _i32(packed.k),
            _i32(kp), _i32(np_), _i32(packed.group_size), _i32(split_stages))
    cluster = {"cluster": (1, splits, 1)} if family == "cl" and splits > 1 else {}
    if family in MULTICAST:  # x by the tensor memory accelerator, a CTA's share of a row tile
        size = MULTICAST[family]
        args += (_compile.tensor_map_2d(x.data_ptr(), x.dtype, num_tokens, packed.k,
                                        x.stride(0), 16 * mt // size, STAGE_K),)
        cluster = {"cluster": (size, 1, 1)}
    _compile.launch(_module(family), kernel, x.device, grid, (_threads(kernel), 1, 1), args,
                    shared_mem=_smem_bytes(mt, family),
                    programmatic=PROGRAMMATIC_MIN_ROWS <= num_tokens <= PROGRAMMATIC_ROWS
                    and _programmatic.get(_index(x.device), False), **cluster)


def launch_shape(num_tokens: int, packed: PackedInt4, device: torch.device, dtype: torch.dtype,
                 tile: Tile | None = None, splits: int | None = None
                 ) -> tuple[str, int, int, int, int]:
    """How _kernel_product launches a product of num_tokens rows: (kernel, m16 tiles a CTA,
    row tiles, K splits, stages per split)."""
    rows, family = tile or tile_for(num_tokens, device, dtype, (packed.n, packed.k))
    mt = rows // 16
    kp, np_ = packed.qweight.shape[1] * CHUNK, packed.qweight.shape[0] * CHUNK
    m_tiles = -(-num_tokens // (16 * mt))
    if family == "wgs" and m_tiles * (np_ // CTA_N) > MAX_SPLIT_TILES:
        family = "wgt"  # more tiles than arrival counters: the same tile without stream-K
    kernel = _kernel_name(dtype, rows, family)
    if family == "wgs":
        return kernel, mt, m_tiles, 1, kp // STAGE_K
    if splits is None and rows in SMALL_TILES and family in ("", "cl") and _split_counts:
        tuned = _split_counts.get((_index(device), dtype), {}).get((packed.n, packed.k), {})
        at = next((r for r in SMALL_TUNE_ROWS[rows] if r >= num_tokens), rows)
        splits = tuned.get(at)
    blocks = _column_blocks(np_, family)
    partials = num_tokens * blocks * _cta_n(family)  # quant.cu's ws rows: the launch's columns
    splits, split_stages = _splits(kernel, device, m_tiles, blocks, kp // STAGE_K, partials,
                                   min(num_tokens, 16 * mt), splits)
    if family == "cl" and splits > MAX_CLUSTER:  # one cluster holds a tile's K parts
        splits, split_stages = _splits(kernel, device, m_tiles, blocks, kp // STAGE_K, partials,
                                       min(num_tokens, 16 * mt), MAX_CLUSTER)
    return kernel, mt, m_tiles, splits, split_stages


def _kernel_name(dtype: torch.dtype, rows: int, family: str) -> str:
    return f"w4a16_{family + '_' if family else ''}{_DTYPES[dtype]}_m{rows}"


def tile_for(num_tokens: int, device: torch.device | int | None = None,
             dtype: torch.dtype = torch.bfloat16, shape: Shape | None = None) -> Tile:
    """The row tile of a product of num_tokens rows: 16 or 32 rows up to 32, else what tuning
    of the device, dtype and shape (N, K) measured fastest at the largest candidate not above
    num_tokens (the smallest's below it), NARROW_TILE for a shape not tuned."""
    if num_tokens <= 32:
        return (16 if num_tokens <= 16 else 32), ""
    chosen = _tiles.get((_index(device), dtype), {}).get(shape) if _tiles else None
    if not chosen:
        return NARROW_TILE
    return chosen[_bucket(chosen, num_tokens)]


def _bucket(tuned: dict[int, object], num_tokens: int) -> int:
    """The tuned row count whose choice serves num_tokens rows: the largest not above it, else
    the smallest."""
    return max((rows for rows in tuned if rows <= num_tokens), default=min(tuned))


def tune_dequant_rows(weights: list[PackedInt4], device: torch.device | int | None = None,
                      tiles: tuple[Tile, ...] = TUNED_TILES,
                      rows_list: tuple[int, ...] = TILE_CANDIDATES
                      ) -> dict[Shape, tuple[int, dict[int, tuple[float, float]]]]:
    """Times the products of `weights` in CUDA graphs, shape by shape, all weights of a shape in
    one graph (several layers' weights of a shape, so that they come from memory as a layer's
    do, not from L2): the 16- and 32-row tiles at each of SMALL_TUNE_ROWS' row counts in each
    of SPLIT_CANDIDATES K parts and split_k_choice's, each count keeping the fastest for the
    rows it serves; the kernel at each of `rows_list` (with DEQUANT_CANDIDATES; counts up to
    32 left out: those run the 16- and 32-row tiles) rows in every one of `tiles` the device
    runs (wgmma: sm_90a) whose output agrees with the 64-row kernel's, and from
    DEQUANT_CANDIDATES rows also dequantized into prepare's scratch then multiplied by cuBLAS.
    Each candidate row count takes the shape's fastest tile (tile_for); the shape dequantizes
    from the smallest candidate from which that beats the kernel at it and every larger one
    (none: NEVER). Before any capture. Returns {(N, K): (its dequantizing threshold, {rows:
    (kernel µs a product in the chosen tile, dequantized µs a product)})}; tile_choice(device)
    gives the tiles."""
    from pagedserve_kernels.gemm import graph_us

    index = _index(device)
    dev, dtype = torch.device("cuda", index), weights[0].dtype
    scratch = _scratch.get((index, dtype))
    if scratch is None or scratch.numel() < max(w.n * w.k for w in weights):
        raise RuntimeError("tune_dequant_rows needs prepare(device, scratch_elements, dtype)")
    by_shape: dict[Shape, list[PackedInt4]] = {}
    for w in weights:
        by_shape.setdefault((w.n, w.k), []).append(w)
    candidates = _agreeing_tiles([group[0] for group in by_shape.values()], dev, tiles)
    table = _tiles.setdefault((index, dtype), {})
    split_table = _split_counts.setdefault((index, dtype), {})
    wave_table = _last_waves.setdefault((index, dtype), {})
    results = {}
    for (n, k), group in by_shape.items():
        table.pop((n, k), None)
        split_table.pop((n, k), None)
        wave_table.pop((n, k), None)
        counts = {}
        for rows in (r for tile_rows in SMALL_TILES for r in SMALL_TUNE_ROWS[tile_rows]):
            x = torch.randn(rows, k, dtype=dtype, device=dev)
            out = torch.empty(rows, n, dtype=dtype, device=dev)
            timed = {count: graph_us(lambda: [_kernel_product(x, w, None, out, None, count)
                                              for w in group])
                     for count in (None, *SPLIT_CANDIDATES)}  # None: the model's, kept on a tie
            best = min(timed, key=timed.get)
            if best is not None:
                counts[rows] = best
        split_table[(n, k)] = counts
        chosen, kernel_us, dequantized, waves = {}, {}, {}, {}
        for rows in sorted({r for r in rows_list if r > 32} | set(DEQUANT_CANDIDATES)):
            x = torch.randn(rows, k, dtype=dtype, device=dev)
            out = torch.empty(rows, n, dtype=dtype, device=dev)
            timed = {tile: graph_us(lambda: [_kernel_product(x, w, None, out, tile)
                                             for w in group]) / len(group)
                     for tile in candidates}
            chosen[rows] = min(timed, key=timed.get)
            kernel_us[rows] = timed[chosen[rows]]
            # a second launch and other bits in the rest's columns: only for a clear gain
            split = {form: _last_wave_us(x, group, out, chosen[rows], dev, form)
                     for form in TUNED_WAVE_FORMS}
            split = {form: us for form, us in split.items()
                     if us is not None and us < LAST_WAVE_GAIN * kernel_us[rows]}
            waves[rows] = min(split, key=split.get) if split else None
            if waves[rows]:
                kernel_us[rows] = split[waves[rows]]
            if rows in DEQUANT_CANDIDATES:
                dequantized[rows] = graph_us(lambda: [_dequantized_product(x, w, None, out,
                                                                           scratch)
                                                      for w in group]) / len(group)
        table[(n, k)] = chosen
        wave_table[(n, k)] = waves
        times = {rows: (kernel_us[rows], dequantized[rows]) for rows in DEQUANT_CANDIDATES}
        _dequant_rows[(index, n, k)] = dequant_threshold(times)
        results[(n, k)] = (_dequant_rows[(index, n, k)], times)
    return results


def _agreeing_tiles(weights: list[PackedInt4], dev: torch.device,
                    tiles: tuple[Tile, ...] = TUNED_TILES) -> list[Tile]:
    """The `tiles` this device runs whose products of 200 random rows (a partial last tile for
    each) agree with NARROW_TILE's within one bf16 rounding of the largest value: the rest are
    logged and never taken."""
    hopper = _compile.arch_used(dev, "quant") == "-arch=sm_90a"
    tiles = [tile for tile in tiles if hopper or not tile[1]]  # wgmma: sm_90a
    dtype = weights[0].dtype
    xs = [torch.randn(200, w.k, dtype=dtype, device=dev) for w in weights]

    def products(tile: Tile) -> list[torch.Tensor]:
        return [_kernel_product(x, w, None, torch.empty(200, w.n, dtype=dtype, device=dev),
                                tile).float() for x, w in zip(xs, weights)]

    refs = products(NARROW_TILE)
    agreeing = []
    for tile in tiles:
        worst = max(_disagreement(out, ref) for out, ref in zip(products(tile), refs))
        if worst <= AGREEMENT:
            agreeing.append(tile)
        else:
            log.warning("int4 kernel %s disagrees with %s (relative error %.3g): not used",
                        _kernel_name(dtype, *tile), _kernel_name(dtype, *NARROW_TILE), worst)
    return agreeing


AGREEMENT = 2.0 ** -7  # one bf16 rounding of the largest value: how far two routes may differ


def _disagreement(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference of two products relative to ref's largest value (1 where ref is
    all zero)."""
    return float(((out - ref).abs().max() / ref.abs().max()).nan_to_num(1.0))


def _last_wave_us(x: torch.Tensor, group: list[PackedInt4], out: torch.Tensor, tile: Tile,
                  dev: torch.device, form: str) -> float | None:
    """µs a product of `group` in `tile` with its last partial wave split off in `form`, where
    the tile has one to split and the split product agrees with the whole one within one bf16
    rounding of the largest value; else None."""
    from pagedserve_kernels.gemm import graph_us

    w = group[0]
    if not has_wave_split(x.shape[0], w, dev, x.dtype, tile, form):
        return None
    whole = _kernel_product(x, w, None, torch.empty_like(out), tile, None, False).float()
    split = _kernel_product(x, w, None, torch.empty_like(out), tile, None, form).float()
    if _disagreement(split, whole) > AGREEMENT:
        log.warning("int4 tile %s%d with its last wave split (%s) disagrees with it whole: "
                    "not used", tile[1] or "m", tile[0], form)
        return None
    return graph_us(lambda: [_kernel_product(x, v, None, out, tile, None, form)
                             for v in group]) / len(group)


def tile_choice(device: torch.device | int | None = None,
                dtype: torch.dtype = torch.bfloat16) -> dict[Shape, dict[int, str]]:
    """{(N, K): {candidate rows: the kernel tuning chose there}} ({} before tuning), for the
    logs; the 16- and 32-row tiles' row counts too where tuning chose their K parts ("m16/k8":
    8 parts); "+parts" or "+stream" where the last partial wave is split off so."""
    index = _index(device)
    parts = _split_counts.get((index, dtype), {})
    waves = _last_waves.get((index, dtype), {})

    def name(shape: Shape, rows: int, tile: Tile) -> str:
        form = waves.get(shape, {}).get(rows)
        return f"{tile[1] or 'm'}{tile[0]}{'+' + form if form else ''}"

    return {shape: {**{rows: f"m{tile_for(rows)[0]}/k{count}"
                       for rows, count in sorted(parts.get(shape, {}).items())},
                    **{rows: name(shape, rows, tile) for rows, tile in sorted(chosen.items())}}
            for shape, chosen in _tiles.get((index, dtype), {}).items()}


def dequant_threshold(times: dict[int, tuple[float, float]]) -> int:
    """The smallest row count of `times` ({rows: (kernel, dequantized)}, or any pair of ways)
    from which the second is faster at it and every larger one; NEVER if not at the largest."""
    threshold = NEVER
    for rows in sorted(times, reverse=True):
        kernel, dequantized = times[rows]
        if dequantized >= kernel:
            break
        threshold = rows
    return threshold


def dequantize(packed: PackedInt4, out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in packed.dtype (F.linear's layout, rows in packed's input order), exactly the
    values int4_linear multiplies: reference.dequantize_int4(...).to(dtype). For large row counts
    a dequantized scratch weight and cuBLAS may beat the fused product."""
    n, k = packed.n, packed.k
    device = packed.qweight.device
    if out is None:
        out = torch.empty(n, k, dtype=packed.dtype, device=device)
    if out.shape != (n, k) or out.dtype != packed.dtype or not out.is_contiguous() \
            or out.device != device or out.data_ptr() % 16:
        raise ValueError(f"out must be a contiguous, 16-byte aligned [{n}, {k}] {packed.dtype} "
                         f"tensor on {device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
    kp, np_ = packed.qweight.shape[1] * CHUNK, packed.qweight.shape[0] * CHUNK
    args = (out.data_ptr(), packed.qweight.data_ptr(), packed.scales.data_ptr(),
            _ptr(packed.zeros), _i32(n), _i32(k), _i32(kp), _i32(np_), _i32(packed.group_size))
    tiles = (np_ // CHUNK) * -(-(kp // CHUNK) // DEQUANT_CHUNKS)  # n32 blocks x chunk groups
    _compile.launch("quant", f"w4_dequant_{_DTYPES[packed.dtype]}", device, (tiles, 1, 1),
                    (_THREADS, 1, 1), args)
    return out


def prepare(device: torch.device | int | None = None, scratch_elements: int = 0,
            dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile the kernels and allocate the device's split-K workspace, and with
    `scratch_elements` (the largest N x K of the weights it will multiply) the scratch weight
    of `dtype` that int4_linear dequantizes into for large row counts: before a CUDA-graph
    capture (nothing is allocated while capturing), and before the KV cache is sized."""
    device = torch.device("cuda", _index(device))
    for name in _compile.MODULES["quant"][1]:
        _compile.get_function("quant", name, device)
    _workspace(device)
    if device.index not in _programmatic:
        set_programmatic(device, _compile.programmatic_launch(device))
    key = (device.index, dtype)
    with _lock:
        if scratch_elements and (key not in _scratch or _scratch[key].numel() < scratch_elements):
            _scratch[key] = torch.empty(scratch_elements, dtype=dtype, device=device)


def set_programmatic(device: torch.device | int | None, on: bool) -> bool:
    """Launch the products on `device` programmatically (on) or plainly; on only where
    _compile.programmatic_launch says the device and driver can, and a programmatic launch of
    a small product (in a CUDA graph too) gives the plain launch's bits. Returns the setting."""
    index = _index(device)
    if on and _compile.programmatic_launch(index):
        try:
            on = _programmatic_agrees(torch.device("cuda", index))
        except (RuntimeError, OSError, TypeError, ctypes.ArgumentError) as exc:
            # the driver refused the launch or its capture, or its entry point differs
            log.warning("W4A16 products launch plainly: %s", exc)
            on = False
    else:
        on = False
    _programmatic[index] = on
    return on


def launches_programmatically(device: torch.device | int | None = None) -> bool:
    """What prepare() or set_programmatic left for `device` (False before either)."""
    return _programmatic.get(_index(device), False)


def _programmatic_agrees(device: torch.device) -> bool:
    """Two dependent products (the second multiplies the first's output), launched plainly,
    then programmatically, eagerly and from a CUDA graph: the same bits each way."""
    g = torch.Generator(device=device).manual_seed(0)
    n = k = 256
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, device=device,
                            dtype=torch.int32)
    scales = torch.rand(k // 128, n, generator=g, device=device).to(torch.bfloat16) * 0.01
    packed = repack(qweight, scales, None, 128)
    x = torch.randn(PROGRAMMATIC_MIN_ROWS, k, generator=g, device=device).to(torch.bfloat16)

    def two(out):
        _kernel_product(x, packed, None, out[0])
        return _kernel_product(out[0], packed, None, out[1])

    outs = {}
    for mode in (False, True):
        _programmatic[device.index] = mode
        eager = torch.empty(2, x.shape[0], n, dtype=x.dtype, device=device)
        two(eager)
        graphed = torch.empty_like(eager)
        graph = torch.cuda.CUDAGraph()
        with _compile.graph_capture(graph):
            two(graphed)
        graph.replay()
        torch.cuda.synchronize(device)
        outs[mode] = (eager, graphed)
    _programmatic.pop(device.index)
    agree = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    if not agree:
        log.warning("W4A16 products launch plainly: a programmatic launch gave other bits")
    return agree


# ---- layout helpers (torch only) ----

def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [8R, C] uint8 0..15: row 8r + j is nibble j of row r."""
    rows, cols = packed.shape
    out = torch.empty(rows, PACK, cols, dtype=torch.uint8, device=packed.device)
    for j in range(PACK):
        out[:, j] = (packed >> (4 * j)) & 0xF
    return out.view(rows * PACK, cols)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[8R, C] 0..15 -> [R, C] int32, the inverse of unpack_rows."""
    return _words(values.reshape(-1, PACK, values.shape[1]).transpose(1, 2))


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] 0..15 -> [...] int32 with nibble p at bits 4p, without int32 overflow: the top
    nibble enters as its signed value times 2^28."""
    words = torch.zeros(nibbles.shape[:-1], dtype=torch.int32, device=nibbles.device)
    for p in range(PACK - 1):
        words += nibbles[..., p].to(torch.int32) << (4 * p)
    top = nibbles[..., PACK - 1].to(torch.int32)
    return words + (top - 16 * (top >= 8).to(torch.int32)) * (1 << 28)


def _pack_groups(t: torch.Tensor, groups: int, np_: int, fill: float) -> torch.Tensor:
    """[G, N] -> [groups, Np / 32, 8, 4] (padding: fill): column 32b + 8j + g at [., b, g, j]."""
    padded = torch.full((groups, np_), fill, dtype=t.dtype, device=t.device)
    padded[: t.shape[0], : t.shape[1]] = t
    return padded.view(groups, np_ // CHUNK, 4, 8).transpose(2, 3).contiguous()


def _unpack_groups(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(2, 3).reshape(t.shape[0], -1)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _check_int4(qweight, scales, zeros, group_size, perm, dtype) -> tuple[int, int]:
    if dtype not in _DTYPES:
        raise ValueError(f"the int4 kernel computes in bfloat16 or float16, not {dtype}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be [K / 8, N] int32, got {tuple(qweight.shape)} "
                         f"{qweight.dtype}")
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if n % PACK or k == 0 or n == 0:
        raise ValueError(f"qweight {tuple(qweight.shape)}: N must be a positive multiple of 8")
    if group_size <= 0 or k % group_size or (group_size % CHUNK and group_size != k):
        raise ValueError(f"group_size {group_size}: the int4 kernel takes a multiple of {CHUNK} "
                         f"dividing K = {k}, or K itself")
    groups = k // group_size
    if tuple(scales.shape) != (groups, n) or not scales.is_floating_point():
        raise ValueError(f"scales must be float [{groups}, {n}], got {tuple(scales.shape)} "
                         f"{scales.dtype}")
    if zeros is not None and (tuple(zeros.shape) != (groups, n) or zeros.dtype != torch.uint8):
        raise ValueError(f"zeros must be uint8 [{groups}, {n}], got {tuple(zeros.shape)} "
                         f"{zeros.dtype}")
    if perm is not None and tuple(perm.shape) != (k,):
        raise ValueError(f"perm must be [{k}], got {tuple(perm.shape)}")
    for name, t in (("scales", scales), ("zeros", zeros), ("perm", perm)):
        if t is not None and t.device != qweight.device:
            raise ValueError(f"{name} is on {t.device}, qweight on {qweight.device}")
    return n, k


def _check_x(x: torch.Tensor, packed: PackedInt4) -> None:
    if x.device.type != "cuda" or x.device != packed.qweight.device:
        raise ValueError(f"x must be on the packed weight's GPU ({packed.qweight.device}), got "
                         f"{x.device}")
    if x.dtype != packed.dtype:
        raise ValueError(f"x is {x.dtype}, the packed weight computes in {packed.dtype}")
    if x.dim() != 2 or x.shape[1] != packed.k:
        raise ValueError(f"x must be [num_tokens, {packed.k}], got {tuple(x.shape)}")


def _check_out(out, num_tokens: int, n: int, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    if (out.shape != (num_tokens, n) or out.dtype != x.dtype or out.device != x.device
            or (n > 1 and out.stride(1) != 1) or out.stride(0) % 2 or out.data_ptr() % 4):
        raise ValueError(f"out must be [{num_tokens}, {n}] {x.dtype} on {x.device} with a "
                         f"contiguous last dim, got {tuple(out.shape)} {out.dtype} strides "
                         f"{out.stride()}")
    return out


def _check_bias(bias: torch.Tensor, n: int, x: torch.Tensor) -> torch.Tensor:
    if bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device:
        raise ValueError(f"bias must be [{n}] {x.dtype} on {x.device}, got {tuple(bias.shape)} "
                         f"{bias.dtype} on {bias.device}")
    return bias if bias.is_contiguous() and bias.data_ptr() % 4 == 0 else bias.contiguous()


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _kernel_rows(kernel: str) -> int:
    """A product kernel's row tile by its name (_kernel_name's _m<rows>)."""
    return int(kernel.rsplit("_m", 1)[1])


def _family(kernel: str) -> str:
    """A product kernel's family by its name: "" (mma.sync), "cl" (the mma.sync candidates
    summing K parts through a cluster), "wgp", "wgt", "wgs", "wgw", "wgm" or "wgq" (wgmma)."""
    return next((f for f in ("cl", "wgp", "wgw", *_PRODUCER_FED) if f"_{f}_" in kernel), "")


def _module(family: str) -> str:
    """The module a product kernel of `family` is built in: the cluster candidates' own, else
    quant."""
    return CLUSTER_MODULE if family == "cl" else "quant"


def _cta_n(family: str) -> int:
    """Output columns a thread block of the family takes."""
    return 2 * CTA_N if family == "wgw" else CTA_N


def _column_blocks(np_: int, family: str) -> int:
    """The grid's column blocks over the padded N (a 256-column tile's last may be half past
    it, and a multicast cluster's last ones wholly: the kernel reads zeros there)."""
    blocks, size = -(-np_ // _cta_n(family)), MULTICAST.get(family, 1)
    return -(-blocks // size) * size


def _threads(kernel: str) -> int:
    family = _family(kernel)
    return _WGT_THREADS if family == "wgw" or family in _PRODUCER_FED else _THREADS


def _smem_bytes(mt: int, family: str = "") -> int:
    """Cfg<MT>::SMEM (WgCfg<MT>::SMEM; WtCfg<16 MT>::SMEM for wgt, wgs, wgm and wgq; for "wgw"
    WtCfg<16 MT, 256>::SMEM) of quant.cu: stages x (weights + activations + scales + zeros),
    with wgmma 1 KiB more to align the swizzled tiles."""
    cta_n = _cta_n(family)  # the packed weights (4 bits), x, and scales + zeros of two k32 chunks
    stage = cta_n * STAGE_K // 2 + 16 * mt * STAGE_K * 2 + 2 * (2 * cta_n * 2)
    if family == "wgw":
        return _STAGES_WGW * stage + 1024
    if family in _PRODUCER_FED:
        return _STAGES_WGT[mt] * stage + 1024
    return _STAGES_WG[mt] * stage + 1024 if family == "wgp" else _STAGES[mt] * stage


def _splits(kernel: str, device: torch.device, m_tiles: int, n_blocks: int, k_stages: int,
            partial_floats: int, tile_rows: int, forced: int | None = None) -> tuple[int, int]:
    """(splits, stages per split) of K by split_k_choice, the resident thread blocks of every
    SM as the slots, the workspace as a bound (tile_rows: the rows a row tile holds); `forced`:
    that many instead, within the same bounds."""
    tiles = m_tiles * n_blocks
    most = min(k_stages // _MIN_SPLIT_STAGES, WORKSPACE_FLOATS // partial_floats)
    if most <= 1 or tiles > MAX_SPLIT_TILES:
        return 1, k_stages
    if forced is not None:
        per = -(-k_stages // max(1, min(forced, most)))
        return -(-k_stages // per), per
    # a block's fp32 partials against the bytes a stage streams (its weights and activations)
    cta_n = _cta_n(_family(kernel))
    partial_stages = tile_rows * cta_n * 4 / (cta_n * STAGE_K // 2 + tile_rows * STAGE_K * 2)
    return split_k_choice(tiles, k_stages, _sm_count(device) * _resident_ctas(kernel, device),
                          most, partial_stages)


@functools.lru_cache(maxsize=4096)  # every product of a step asks: a handful of shapes
def split_k_choice(tiles: int, k_stages: int, slots: int, most: int,
                   partial_stages: float = 0.0) -> tuple[int, int]:
    """(splits, stages per split), splits <= most: the fewest that minimise waves x (stages
    per split + PROLOGUE_STAGES + partial_stages when split), waves = ceil(tiles x splits /
    slots), in stage-times. Each thread block is bound by its own pipeline, so a product takes
    its busiest slot's time: splits that spill a few blocks into another wave (Llama's gate/up
    product at one row tile: 224 column tiles, 2 splits on 396 slots) pay a whole pass more."""
    best = None
    for splits in range(1, max(1, most) + 1):
        per = -(-k_stages // splits)
        actual = -(-k_stages // per)
        extra = PROLOGUE_STAGES + (partial_stages if actual > 1 else 0.0)
        cost = -(-tiles * actual // slots) * (per + extra)
        if best is None or cost < best[0]:
            best = (cost, actual, per)
    return best[1], best[2]


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _resident_ctas(kernel: str, device: torch.device) -> int:
    """Thread blocks of `kernel` one SM holds at once (registers, shared memory, threads)."""
    index = _index(device)
    key = (kernel, index)
    if key not in _resident:
        mt = _kernel_rows(kernel) // 16
        smem, threads = _smem_bytes(mt, _family(kernel)), _threads(kernel)
        fn = _compile.get_function(_module(_family(kernel)), kernel, index, smem)
        props = torch.cuda.get_device_properties(index)
        regs = -(-max(int(getattr(fn, "num_regs", 128)), 1) * 32 // 256) * 256  # per warp
        regs_per_sm = int(getattr(props, "regs_per_multiprocessor", 65536))
        smem_per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))
        by_regs = regs_per_sm // (regs * threads // 32)
        by_smem = smem_per_sm // (smem + 1024)  # 1 KiB reserved per block
        _resident[key] = max(1, min(by_regs, by_smem, 2048 // threads))
    return _resident[key]


def stream_k_ctas(units: int, device: torch.device) -> int:
    """The wgs kernels' grid: one CTA an SM (their shared memory and registers allow no more),
    none without a K stage to share."""
    return max(1, min(units, _sm_count(device)))


def _stream_k_workspace(device: torch.device) -> torch.Tensor:
    """The wgs kernels' parts: two 256 x 128 fp32 tiles a CTA (a share holds at most two tiles
    it does not cover whole), allocated on first use."""
    return _per_device(_stream_k_parts, device, "stream-K workspace",
                       "run the product once before capturing it",
                       lambda dev: torch.empty(2 * _sm_count(dev) * 256 * CTA_N,
                                               dtype=torch.float32, device=dev))


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K partials and per-tile arrival counters (zero between launches)."""
    return _per_device(_workspaces, device, "split-K workspace",
                       "call pagedserve_kernels.quant.prepare(device) first",
                       lambda dev: (torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=dev),
                                    torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=dev)))


def _per_device(cache: dict, device: torch.device, what: str, remedy: str, make):
    """cache[device index], made by make(device) on first use, never while capturing a graph
    (nothing may be allocated then)."""
    index = _index(device)
    found = cache.get(index)
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the int4 {what} is allocated while capturing a CUDA graph; {remedy}")
    with _lock:
        if index not in cache:
            cache[index] = make(torch.device("cuda", index))
        return cache[index]
