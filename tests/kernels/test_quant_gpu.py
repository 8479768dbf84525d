"""The W4A16 kernels (pagedserve_kernels.quant) on the GPU against dequantize-then-matmul in float32
on fresh random inputs: every row-count path (1, 7, 64, 256, 4096 rows: one m16 tile, split-K,
m64 tiles), group sizes 32/64/128 and one per column, symmetric and asymmetric, act-order, bf16 and
fp16, Llama-3-8B's four shapes and small odd ones. The bound: twice cuBLAS's own distance from the
float32 product of the same rounded weight, plus a rounding floor. Outputs start as NaN (an
unwritten element fails). The dequantize kernel gives the reference weight bit for bit, and
products replay from a CUDA graph as they run eagerly, again and again (split-K counters reset).
The candidates summing K parts through a cluster (Hopper) give their global-partials twins' bits,
and those sharing x in clusters of column blocks their wgt twins'.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import reference
from tests.gpu import gpu_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]

ROWS = [1, 7, 64, 256, 4096]
LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
SMALL = [(136, 384, 32), (136, 384, 64), (136, 384, 128), (136, 384, -1), (264, 192, 64),
         (8, 8, -1), (136, 2048, 128), (200, 2048, -1)]  # the last two split K
# (group, asymmetric, act-order, dtype) on the Llama shapes
LLAMA_CASES = [(128, True, False, torch.bfloat16), (128, False, True, torch.float16),
               (-1, False, False, torch.bfloat16), (32, True, True, torch.bfloat16),
               (64, False, False, torch.float16)]
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (asym, act-order)
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.fixture(scope="module")
def quant():
    from pagedserve_kernels import quant

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is float32
    quant.prepare(torch.device("cuda"))
    yield quant
    torch.backends.cuda.matmul.allow_tf32 = tf32


def _int4(n, k, group, asym, act_order, dtype, seed):
    """The loaders' int4 form (reference.dequantize_int4's arguments) with random contents."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    group = k if group == -1 else group
    q = torch.randint(0, 16, (k, n), generator=g, device="cuda")
    scales = (torch.rand(k // group, n, generator=g, device="cuda") * 0.02 + 1e-3).to(dtype)
    zeros = None
    if asym:
        zeros = torch.randint(0, 17, (k // group, n), generator=g, device="cuda").to(torch.uint8)
    perm = torch.randperm(k, generator=g, device="cuda") if act_order else None
    shifts = torch.arange(8, device="cuda").view(1, 8, 1) * 4
    words = (q.view(-1, 8, n) << shifts).sum(1)  # int64, nibble j at bits 4j
    qweight = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return qweight, scales, zeros, group, perm


def _check(quant, m, n, k, group, asym, act_order, dtype, bias=False):
    seed = m * 7 + n * 3 + k + group + 11 * asym + 5 * act_order
    qweight, scales, zeros, group, perm = _int4(n, k, group, asym, act_order, dtype, seed)
    packed = quant.repack(qweight, scales, zeros, group, perm)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    b = torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    quant.int4_linear(x, packed, b, out=out)
    weight = reference.dequantize_int4(qweight, scales, zeros, group)  # [N, K] float32
    xp = x if perm is None else x.index_select(1, perm)
    exact = xp.float() @ weight.t() + (0 if b is None else b.float())
    cublas = F.linear(xp, weight.to(dtype), b).float()
    bound = (2 * float((cublas - exact).abs().max())
             + ROUNDING[dtype] * float(exact.abs().max()) + 1e-3)
    err = float((out.float() - exact).abs().max())
    assert err <= bound, (m, n, k, group, asym, act_order, dtype, err, bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asym,act_order", VARIANTS)
@pytest.mark.parametrize("n,k,group", SMALL)
@pytest.mark.parametrize("m", ROWS)
def test_small_shapes_every_variant(quant, m, n, k, group, asym, act_order, dtype):
    _check(quant, m, n, k, group, asym, act_order, dtype)


@pytest.mark.parametrize("group,asym,act_order,dtype", LLAMA_CASES)
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("m", ROWS)
def test_llama_shapes(quant, m, n, k, group, asym, act_order, dtype):
    _check(quant, m, n, k, group, asym, act_order, dtype)


def _hopper(quant) -> bool:
    from pagedserve_kernels import _compile

    return _compile.arch_used(torch.device("cuda"), "quant") == "-arch=sm_90a"


@pytest.fixture(params=[(128, ""), (64, "wgp"), (128, "wgp"), (64, "wgt"), (128, "wgt"),
                        (256, "wgt"), (64, "wgs"), (128, "wgs"), (256, "wgs"), (64, "wgw"),
                        (128, "wgw"), (128, "wgm"), (256, "wgm"), (128, "wgq"), (256, "wgq")],
                ids=["m128", "wgp64", "wgp128", "wgt64", "wgt128", "wgt256", "wgs64", "wgs128",
                     "wgs256", "wgw64", "wgw128", "wgm128", "wgm256", "wgq128", "wgq256"])
def wide(quant, request, monkeypatch):
    """Each tile but the 64-row mma.sync one from 33 rows, for every shape, as a tuning that
    found it faster at every candidate would choose it (the wgmma ones on Hopper only)."""
    if request.param[1] and not _hopper(quant):
        pytest.skip("the wgmma kernels need the module built for sm_90a")
    tile_for = quant.tile_for
    monkeypatch.setattr(quant, "tile_for", lambda num_tokens, *args: (
        tile_for(num_tokens, *args) if num_tokens <= 32 else request.param))
    device = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16):  # the products launch that tile from 33 rows
        packed = quant.repack(*_int4(128, 256, 128, False, False, dtype, 1))
        assert (quant.launch_shape(33, packed, device, dtype)[0]
                == quant._kernel_name(dtype, *request.param))
        assert quant.launch_shape(32, packed, device, dtype)[0] == quant._kernel_name(dtype, 32, "")
    return quant


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asym,act_order", VARIANTS)
@pytest.mark.parametrize("n,k,group", SMALL)
@pytest.mark.parametrize("m", [33, 130, 256, 4096])
def test_wide_tiles_every_variant(wide, m, n, k, group, asym, act_order, dtype):
    """128 rows a CTA, and the wgmma tiles: partial last tiles (33, 130 rows), split K (the last
    two shapes)."""
    _check(wide, m, n, k, group, asym, act_order, dtype)


@pytest.mark.parametrize("group,asym,act_order,dtype", LLAMA_CASES[:3])
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("m", [200, 4096])
def test_wide_tiles_llama_shapes(wide, m, n, k, group, asym, act_order, dtype):
    _check(wide, m, n, k, group, asym, act_order, dtype)
    if m == 200:
        _check(wide, m, n, k, group, asym, act_order, dtype, bias=True)


@pytest.mark.parametrize("tile,m", [((64, "wgs"), 40), ((256, "wgs"), 200)],
                         ids=["wgs64", "wgs256"])
@pytest.mark.parametrize("tiles", ["two_waves", "a_wave_and_3", "a_wave_and_a_half"])
def test_stream_k_shares_at_tile_counts_around_the_grid(quant, monkeypatch, tile, m, tiles):
    """The stream-K grid (one CTA an SM) at tile counts that give each CTA two whole tiles' K
    stages, just over one tile's, and about one and a half: shares that start on, just past
    and halfway into a tile, one to three CTAs a tile. Each against the reference, and again
    bit for bit (the parts added in one order whoever sums them, the counters reset)."""
    if not _hopper(quant):
        pytest.skip("the wgmma kernels need the module built for sm_90a")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = {"two_waves": 2 * sms, "a_wave_and_3": sms + 3,
              "a_wave_and_a_half": sms + sms // 2 + 5}[tiles]
    monkeypatch.setattr(quant, "tile_for", lambda num_tokens, *args: tile)
    n = 128 * blocks
    _check(quant, m, n, 1024, 128, True, False, torch.bfloat16, bias=True)
    qweight, scales, zeros, group, perm = _int4(n, 1024, 128, False, False, torch.bfloat16, 9)
    packed = quant.repack(qweight, scales, zeros, group, perm)
    x = torch.randn(m, 1024, device="cuda").to(torch.bfloat16)
    first = quant.int4_linear(x, packed).view(torch.int16)
    for _ in range(3):
        assert torch.equal(quant.int4_linear(x, packed).view(torch.int16), first)


@pytest.mark.parametrize("m", [1, 7, 16, 20, 32])
@pytest.mark.parametrize("splits", [2, 5, 8, 16])
def test_small_tiles_sum_their_k_parts_through_shared_memory(quant, monkeypatch, m, splits):
    """The 16- and 32-row tiles at every K part count tuning may pick (and 5: rounds of the
    pipeline buffers that do not divide the count): against the reference, with a bias, and
    again bit for bit."""
    monkeypatch.setattr(quant, "_split_counts", {(0, torch.bfloat16): {(4096, 4096): {
        rows: splits for tile in quant.SMALL_TILES for rows in quant.SMALL_TUNE_ROWS[tile]}}})
    assert quant.launch_shape(m, quant.repack(*_int4(4096, 4096, 128, True, False,
                                                     torch.bfloat16, 2)[:3], 128),
                              torch.device("cuda"), torch.bfloat16)[3] == splits
    _check(quant, m, 4096, 4096, 128, True, False, torch.bfloat16, bias=True)
    qweight, scales, zeros, group, perm = _int4(4096, 4096, 128, True, False, torch.bfloat16, 3)
    packed = quant.repack(qweight, scales, zeros, group, perm)
    x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    first = quant.int4_linear(x, packed).view(torch.int16)
    assert torch.equal(quant.int4_linear(x, packed).view(torch.int16), first)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 16, 20, 32])
@pytest.mark.parametrize("splits", [2, 5, 8])
def test_cluster_tiles_sum_k_parts_as_the_global_partials_do(quant, m, splits, dtype):
    """The candidates summing K parts through a cluster (CLUSTER_TILES, Hopper): the bits of the
    16- or 32-row tile summing through global partials at the same K parts, with a bias and
    zero points, deterministic, and within the reference's bound."""
    if not _hopper(quant):
        pytest.skip("clusters need Hopper")
    rows = 16 if m <= 16 else 32
    qweight, scales, zeros, group, perm = _int4(4096, 4096, 128, True, False, dtype, 5)
    packed = quant.repack(qweight, scales, zeros, group, perm)
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(m, 4096, generator=g, device="cuda").to(dtype)
    bias = torch.randn(4096, generator=g, device="cuda").to(dtype)
    device = torch.device("cuda")
    assert quant.launch_shape(m, packed, device, dtype, (rows, "cl"), splits)[3] == splits
    plain = quant._kernel_product(x, packed, bias, torch.empty(m, 4096, dtype=dtype,
                                                                device="cuda"), (rows, ""), splits)
    clustered = [quant._kernel_product(x, packed, bias, torch.full((m, 4096), float("nan"),
                                                                   dtype=dtype, device="cuda"),
                                       (rows, "cl"), splits) for _ in range(2)]
    assert torch.equal(clustered[0].view(torch.int16), plain.view(torch.int16))
    assert torch.equal(clustered[1].view(torch.int16), plain.view(torch.int16))
    weight = reference.dequantize_int4(qweight, scales, zeros, group)
    exact = x.float() @ weight.t() + bias.float()
    assert float((plain.float() - exact).abs().max()) <= (
        ROUNDING[dtype] * float(exact.abs().max()) + 2 * float(
            (F.linear(x, weight.to(dtype), bias).float() - exact).abs().max()) + 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,splits", [(33, 264, 160, 1), (130, 4096, 4096, 3),
                                          (200, 136, 2048, 2), (300, 6144, 4096, 2),
                                          (512, 28672, 4096, 1)])
@pytest.mark.parametrize("rows,family", [(128, "wgm"), (256, "wgm"), (128, "wgq"),
                                         (256, "wgq")])
def test_multicast_tiles_give_the_wgt_tiles_bits(quant, rows, family, m, n, k, splits, dtype):
    """The tiles sharing x in clusters of column blocks (MULTICAST_TILES, Hopper) run the
    wgt tile's MMAs on the same x tile: its bits at the same K parts, with a bias and zero
    points, where a cluster's last blocks lie past N (264 and 136 columns: 3 and 2 blocks; 8 is
    1), where a row tile's last parts lie past M (33 rows) or partly (130), K ending inside the
    last stage (160), and again (deterministic)."""
    if not _hopper(quant):
        pytest.skip("clusters and the tensor memory accelerator need Hopper")
    packed = quant.repack(*_int4(n, k, 32, True, False, dtype, m + n))
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    bias = torch.randn(n, generator=g, device="cuda").to(dtype)
    device = torch.device("cuda")
    assert quant.launch_shape(m, packed, device, dtype, (rows, family), splits)[3] == splits

    def product(packed, family, bias=None):
        out = torch.full((m, packed.n), float("nan"), dtype=dtype, device="cuda")
        return quant._kernel_product(x, packed, bias, out, (rows, family), splits).view(
            torch.int16)

    plain = product(packed, "wgt", bias)
    for _ in range(2):
        assert torch.equal(product(packed, family, bias), plain)
    if n == 264:  # and a cluster of one block and the others wholly past N
        packed = quant.repack(*_int4(8, k, 32, True, False, dtype, 3))
        assert torch.equal(product(packed, family), product(packed, "wgt"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(512, 28672, 512), (300, 28600, 1024), (256, 33920, 512)])
@pytest.mark.parametrize("family", ["wgt", "wgm", "wgq"])
@pytest.mark.parametrize("form", ["parts", "stream"])
def test_a_split_last_wave_gives_the_whole_launchs_bits_then_the_rests(quant, form, family, m,
                                                                        n, k, dtype):
    """A 256-row tile with its last partial wave split off (_kernel_product's last_wave, each
    form): the whole waves' columns are the whole launch's bits, the rest are the bits of the
    form's tile over a weight of those columns alone (the wgt tile with K in the same parts, or
    the wgs tile on the same stream-K grid), with a bias and zero points; N past the last
    column block's end (28,600), a partial row tile (300 rows), one block left over (265
    blocks), each N trimmed by whole blocks where the device's wave divides its tiles; eagerly
    and replayed from a CUDA graph, twice; the arrival counters zero after."""
    if not _hopper(quant):
        pytest.skip("the wgmma tiles need Hopper")
    device = torch.device("cuda")
    tile = (256, family)
    # The device's wave (its SMs, or the clusters that fit) may divide the case's tiles
    # exactly: N is then trimmed a column block at a time until a partial last wave is left.
    for n in range(n, n - 8 * 128, -128):
        qweight, scales, zeros, group, _ = _int4(n, k, 128, True, False, dtype, m + n + k)
        packed = quant.repack(qweight, scales, zeros, group)
        kernel, _, m_tiles, splits, _ = quant.launch_shape(m, packed, device, dtype, tile)
        split = quant.wave_split(kernel, device, m, m_tiles, packed, form)
        if split is not None:
            break
    # the case has a last wave to split, and a rest with K in parts or shared out
    assert splits == 1 and split is not None, (splits, split)
    assert split[2] > 1 if form == "parts" else split[1].startswith("w4a16_wgs_"), split
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    bias = torch.randn(n, generator=g, device="cuda").to(dtype)
    col = split[0] * 128

    def product(packed, bias, last_wave, tile=tile):
        out = torch.full((m, packed.n), float("nan"), dtype=dtype, device="cuda")
        return quant._kernel_product(x, packed, bias, out, tile, None, last_wave)

    whole = product(packed, bias, False).view(torch.int16)
    rest = quant.repack(qweight[:, col:], scales[:, col:], zeros[:, col:], group)
    tail = product(rest, bias[col:], False, (256, "wgt" if form == "parts" else "wgs"))
    tail = tail.view(torch.int16)
    parted = product(packed, bias, form).view(torch.int16)
    assert torch.equal(parted[:, :col], whole[:, :col])
    assert torch.equal(parted[:, col:], tail)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    quant._kernel_product(x, packed, bias, out, tile, None, form)  # compiled, workspace made
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quant._kernel_product(x, packed, bias, out, tile, None, form)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), parted)
    assert not quant._workspace(device)[1].any()  # every arrival counter reset for the next


@pytest.mark.parametrize("m", [1, 40, 300])
def test_bias_is_added_before_the_one_rounding(quant, m):
    _check(quant, m, 4096, 4096, 128, True, False, torch.bfloat16, bias=True)
    _check(quant, m, 136, 384, 32, False, True, torch.float16, bias=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,asym", [(4096, 14336, 128, True), (6144, 4096, -1, False),
                                            (136, 384, 32, True), (264, 192, 64, False),
                                            (8, 8, -1, True)])
def test_dequantize_kernel_is_the_reference_weight(quant, n, k, group, asym, dtype):
    qweight, scales, zeros, group, _ = _int4(n, k, group, asym, False, dtype, n + k)
    packed = quant.repack(qweight, scales, zeros, group)
    weight = quant.dequantize(packed)
    assert torch.equal(weight, reference.dequantize_int4(qweight, scales, zeros, group).to(dtype))


def test_strided_and_misaligned_inputs(quant):
    qweight, scales, zeros, group, perm = _int4(4096, 4096, 128, True, False, torch.bfloat16, 3)
    packed = quant.repack(qweight, scales, zeros, group, perm)
    g = torch.Generator(device="cuda").manual_seed(4)
    wide = torch.randn(9, 4096 + 16, generator=g, device="cuda").to(torch.bfloat16)
    for x in (wide[:, :4096], wide[:, 1:4097], wide[::2, 8:4104]):  # aligned rows, odd start, gaps
        expected = quant.int4_linear(x.contiguous(), packed)
        assert torch.equal(quant.int4_linear(x, packed), expected)


def test_graph_replays_match_eager_again_and_again(quant):
    _graph_replays_match_eager(quant)


def test_wide_tiles_add_the_bias_with_split_k_and_partial_tiles(wide):
    _check(wide, 130, 136, 2048, 128, True, False, torch.bfloat16, bias=True)
    _check(wide, 70, 200, 2048, -1, False, True, torch.float16, bias=True)


def test_wide_tiles_replay_from_graphs_as_they_run_eagerly(wide):
    """Each tuned tile, split K and partial tiles included: deterministic, and counters reset."""
    _graph_replays_match_eager(wide)


def _graph_replays_match_eager(quant):
    qweight, scales, zeros, group, perm = _int4(4096, 4096, 128, True, True, torch.bfloat16, 5)
    packed = quant.repack(qweight, scales, zeros, group, perm)
    g = torch.Generator(device="cuda").manual_seed(6)
    for m in (1, 64, 300):  # split K over one m16 tile, one m64 tile, five m64 tiles
        inputs = [torch.randn(m, 4096, generator=g, device="cuda").to(torch.bfloat16)
                  for _ in range(3)]
        eager = [quant.int4_linear(x, packed) for x in inputs]
        assert torch.equal(quant.int4_linear(inputs[0], packed), eager[0])  # deterministic
        static_x = inputs[0].clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = quant.int4_linear(static_x, packed)
        for _ in range(2):
            for x, expected in zip(inputs, eager):
                static_x.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(static_out, expected), m


@pytest.mark.parametrize("m,tile", [(1, None), (16, (16, "")), (20, (32, "")), (64, (64, "")),
                                    (64, (64, "wgt")), (200, (128, "wgs")), (256, (256, "wgt")),
                                    (200, (128, "wgw")), (200, (128, "wgm")),
                                    (256, (256, "wgm")), (256, (256, "wgq"))])
def test_programmatic_launches_give_the_plain_launches_bits(quant, monkeypatch, m, tile):
    """A decode layer's order of kernels, each reading what the one before wrote: an rms_norm
    (which lets the next grid start early), a product, silu_and_mul, a product, again; the
    products launched programmatically give the plain launches' bits, eagerly and replayed
    from a CUDA graph (split K's counters shared by consecutive products). The 16-row tile too,
    which the launcher launches plainly (PROGRAMMATIC_MIN_ROWS) but bench_programmatic times both
    ways."""
    from pagedserve_kernels import ops

    monkeypatch.setattr(quant, "PROGRAMMATIC_MIN_ROWS", 1)

    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    if tile is not None and tile[1] and not hopper:
        pytest.skip("wgmma tiles need sm_90a")
    qweight, scales, zeros, group, perm = _int4(4096, 2048, 128, True, False, torch.bfloat16, 8)
    up = quant.repack(qweight, scales, zeros, group, perm)  # 2048 -> 4096 (gate | up)
    qweight, scales, zeros, group, perm = _int4(2048, 2048, 64, False, False, torch.bfloat16, 9)
    down = quant.repack(qweight, scales, zeros, group, perm)
    g = torch.Generator(device="cuda").manual_seed(10)
    x = torch.randn(m, 2048, generator=g, device="cuda").to(torch.bfloat16)
    norm_w = (torch.rand(2048, generator=g, device="cuda") + 0.5).to(torch.bfloat16)

    def layers(x):
        h = x
        for _ in range(3):
            h = ops.rms_norm(h, norm_w, 1e-6)
            h = quant._kernel_product(h, up, None, torch.empty(m, 4096, dtype=h.dtype,
                                                               device=dev), tile)
            h = ops.silu_and_mul(h)
            h = quant._kernel_product(h, down, None, torch.empty(m, 2048, dtype=h.dtype,
                                                                 device=dev), tile)
        return h

    results, before = {}, quant.launches_programmatically(dev)
    try:
        for on in (False, True):
            assert quant.set_programmatic(dev, on) == (on and hopper)
            eager = layers(x)
            static_x = x.clone()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = layers(static_x)
            replays = []
            for _ in range(3):
                graph.replay()
                replays.append(static_out.clone())
            torch.cuda.synchronize()
            assert torch.isfinite(eager.float()).all()
            results[on] = (eager, replays)
    finally:
        quant.set_programmatic(dev, before)
    assert torch.equal(results[True][0], results[False][0])
    for replay in results[True][1] + results[False][1]:
        assert torch.equal(replay, results[False][0])


def test_refuses_inputs_it_cannot_multiply(quant):
    qweight, scales, zeros, group, _ = _int4(256, 512, 128, True, False, torch.bfloat16, 8)
    packed = quant.repack(qweight, scales, zeros, group)
    x = torch.randn(4, 512, device="cuda")
    with pytest.raises(ValueError, match="packed weight computes in"):
        quant.int4_linear(x, packed)
    with pytest.raises(ValueError, match=r"\[num_tokens, 512\]"):
        quant.int4_linear(x[:, :256].to(torch.bfloat16), packed)
    with pytest.raises(ValueError, match="bias"):
        quant.int4_linear(x.to(torch.bfloat16), packed, torch.zeros(3, device="cuda"))
    assert quant.int4_linear(x[:0].to(torch.bfloat16), packed).shape == (0, 256)


@pytest.fixture
def scratch(quant):
    """The executor's arrangement: prepare() given the largest weight, both dtypes; dropped after
    the test so that the others keep running the kernel at every row count."""
    largest = max(n * k for n, k in LLAMA)
    for dtype in (torch.bfloat16, torch.float16):
        quant.prepare(torch.device("cuda"), largest, dtype)
    for held in quant._scratch.values():
        held.fill_(float("nan"))  # a product that used it leaves its weight there
    yield quant
    quant._scratch.clear()
    quant._dequant_rows.clear()
    quant._tiles.clear()  # tuning sets them too, and the K parts and last-wave forms
    quant._split_counts.clear()
    quant._last_waves.clear()


@pytest.mark.parametrize("m", [383, 384, 4096])
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("group,asym,act_order,dtype", LLAMA_CASES[:2])
@pytest.mark.parametrize("bias", [False, True])
def test_large_row_counts_dequantize_then_multiply(scratch, m, n, k, group, asym, act_order,
                                                   dtype, bias):
    """From DEQUANT_ROWS rows the product is cuBLAS's on the dequantized weight (within the same
    bound as the kernel), which the scratch then holds; below it the kernel runs."""
    assert scratch.DEQUANT_ROWS == 384
    _check(scratch, m, n, k, group, asym, act_order, dtype, bias)
    seed = m * 7 + n * 3 + k + group + 11 * asym + 5 * act_order
    qweight, scales, zeros, group, perm = _int4(n, k, group, asym, act_order, dtype, seed)
    weight = scratch.dequantize(scratch.repack(qweight, scales, zeros, group, perm))
    held = scratch._scratch[(torch.cuda.current_device(), dtype)][:n * k].view(n, k)
    assert torch.equal(held, weight) == (m >= 384)


@pytest.mark.parametrize("forms", [("parts",), ("parts", "stream")])
def test_tuning_sets_the_threshold_the_products_follow(scratch, monkeypatch, forms):
    """tune_dequant_rows times each of Llama-3-8B's four product shapes (two weights of each, in
    one graph) in every tile at every candidate row count and both ways from
    DEQUANT_CANDIDATES, takes each shape's fastest tile at each row count (every tile the device
    runs agrees with the 64-row kernel: none was dropped), a last-wave form of `forms` or none,
    and sets each shape's threshold to dequant_threshold of its times; a product at its
    threshold then runs dequantized (the scratch holds its weight), one below it the kernel.
    ("stream" is the candidate form TUNED_WAVE_FORMS takes once measured faster.)"""
    monkeypatch.setattr(scratch, "TUNED_WAVE_FORMS", forms)
    tried = []  # (form, whether the chosen tile has that split, its µs: None if it disagreed)
    last_wave_us = scratch._last_wave_us

    def recording(x, group, out, tile, dev, form):
        us = last_wave_us(x, group, out, tile, dev, form)
        split = scratch.has_wave_split(x.shape[0], group[0], dev, x.dtype, tile, form)
        tried.append((form, split, us))
        return us

    monkeypatch.setattr(scratch, "_last_wave_us", recording)
    packed = [scratch.repack(*_int4(n, k, 128, True, False, torch.bfloat16, n + k + copy))
              for copy in range(2) for n, k in LLAMA]
    device, index = torch.device("cuda"), torch.cuda.current_device()
    offered = scratch.TUNED_TILES
    runs = [t for t in offered if _hopper(scratch) or not t[1]]
    assert scratch._agreeing_tiles(packed[:len(LLAMA)], device, offered) == runs
    tuned = scratch.tune_dequant_rows(packed, tiles=offered)
    table = scratch._tiles[(index, torch.bfloat16)]
    print(scratch.tile_choice(), {shape: {rows: (round(k), round(d))
                                          for rows, (k, d) in times.items()}
                                  for shape, (_, times) in tuned.items()})
    assert sorted(tuned) == sorted(table) == sorted(LLAMA)
    # every split tried agreed with the whole launch, and on Hopper each offered form had a
    # last partial wave to split somewhere (so "stream" was timed, not skipped)
    assert all(us is not None for _, split, us in tried if split), tried
    if _hopper(scratch):
        assert {form for form, split, _ in tried if split} == set(forms), tried
    for shape, (threshold, times) in tuned.items():
        chosen = table[shape]
        assert sorted(chosen) == list(scratch.TILE_CANDIDATES)
        assert set(chosen.values()) <= set(runs)
        for rows, tile in chosen.items():
            assert scratch.tile_for(rows, shape=shape) == tile
            assert scratch.tile_for(rows + 1, shape=shape) == tile
        assert scratch.tile_for(33, shape=shape) == chosen[64]
        assert scratch.tile_for(32, shape=shape) == (32, "")
        assert sorted(times) == list(scratch.DEQUANT_CANDIDATES)
        assert all(k > 0 and d > 0 for k, d in times.values())
        assert threshold == scratch._dequant_rows[(index, *shape)]
        assert threshold == scratch.dequant_threshold(times)
        waves = scratch._last_waves[(index, torch.bfloat16)][shape]
        assert set(waves.values()) <= {None, *forms}, waves
    held = scratch._scratch[(index, torch.bfloat16)]
    for w in packed[:len(LLAMA)]:
        threshold = tuned[(w.n, w.k)][0]
        if threshold == scratch.NEVER:
            continue
        for rows, dequantized in ((threshold - 1, False), (threshold, True)):
            held.fill_(float("nan"))
            x = torch.randn(rows, w.k, device="cuda").to(torch.bfloat16)
            scratch.int4_linear(x, w)
            weight = held[:w.n * w.k].view(w.n, w.k)
            assert torch.equal(weight, scratch.dequantize(w)) == dequantized, (w.n, w.k, rows)
