"""pagedserve_kernels.quant on the CPU: `repack` round-trips through `unpack` to the loaders' int4
form, and the packed words decoded as quant.cu decodes them (shift, mask, magic-number or, zero
subtraction, one rounding of the scale multiply) and placed by mma.m16n8k16's B-fragment layout
(PTX ISA: register b_r of lane 4g + t holds rows 2t + 8r + {0, 1} of column g) give
reference.dequantize_int4's weight bit for bit; split-K choices stay within the workspace."""
from __future__ import annotations

import pytest
import torch

from executor_svc.quantization import linears
from pagedserve_kernels import quant, reference

# (N, K, group_size or -1 for one group per column)
SHAPES = [(8, 8, -1), (136, 384, 32), (136, 384, 64), (136, 384, 128), (136, 384, -1),
          (200, 96, 32), (264, 200, -1), (256, 4096, 128)]
BITS_OF_BASE = {torch.bfloat16: 0x4300, torch.float16: 0x6400}  # 128.0 and 1024.0


def _int4(n, k, group, asym, act_order, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 1e-3).to(dtype)
    zeros = torch.randint(0, 17, (k // group, n), generator=g).to(torch.uint8) if asym else None
    perm = torch.randperm(k, generator=g) if act_order else None
    return quant.pack_rows(q), scales, zeros, group, perm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asym,act_order", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_repack_round_trips_to_the_loaders_form(n, k, group, asym, act_order, dtype):
    qweight, scales, zeros, group, perm = _int4(n, k, group, asym, act_order, dtype, n + k)
    packed = quant.repack(qweight, scales, zeros, group, perm)
    assert packed.shape == (n, k) and packed.dtype == dtype
    assert packed.qweight.shape == (-(-n // 128) * 4, -(-k // 64) * 2, 32, 4)
    back_q, back_s, back_z = quant.unpack(packed)
    assert torch.equal(back_q, qweight)
    assert torch.equal(back_s, scales)
    assert (back_z is None) == (zeros is None)
    if zeros is not None:
        assert torch.equal(back_z, zeros)
    assert (packed.perm is None) == (perm is None)
    if perm is not None:
        assert torch.equal(packed.perm, perm)


def test_nibble_helpers_match_the_loaders():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 24), generator=g)
    packed = linears.pack_rows(q)
    assert torch.equal(quant.pack_rows(q), packed)
    assert torch.equal(quant.unpack_rows(packed).long(), linears.unpack_rows(packed).long())


def _kernel_weight(packed: quant.PackedInt4) -> torch.Tensor:
    """[Kp, Np] as quant.cu's product multiplies it, from the packed tensors alone."""
    nb, kc = packed.qweight.shape[:2]
    dtype, group = packed.dtype, packed.group_size
    words = packed.qweight.view(nb, kc, 8, 4, 4)  # [b, c, g, t, j]
    b, c, g, t, j = (torch.arange(s).view([-1 if d == i else 1 for d in range(5)])
                     for i, s in enumerate((nb, kc, 8, 4, 4)))
    # A CTA's shared copy of a chunk's scales: 128 columns, element 32 wn + 4g + j (wn = b % 4).
    grp = (c * 32) // group
    sidx = (b % 4) * 32 + g * 4 + j
    per_cta = lambda t_: t_.reshape(t_.shape[0], nb // 4, 128)[grp, b // 4, sidx]  # noqa: E731
    scale = per_cta(packed.scales)
    zero = (torch.tensor(quant.MAGIC_BASE[dtype] + 8, dtype=dtype) if packed.zeros is None
            else per_cta(packed.zeros))
    weight = torch.full((kc * 32, nb * 32), float("nan"), dtype=dtype)
    for kh in range(2):  # k16 step of the chunk
        for r in range(2):  # b0 / b1
            for h in range(2):  # low / high half of the register
                nibble = (words >> (8 * kh + 4 * r + 16 * h)) & 0xF
                value = (nibble | BITS_OF_BASE[dtype]).to(torch.int16).view(dtype)
                row = c * 32 + kh * 16 + 8 * r + 2 * t + h
                col = b * 32 + j * 8 + g
                weight[row.expand_as(value), col.expand_as(value)] = (value - zero) * scale
    return weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("n,k,group", SHAPES[:-1])
def test_kernel_decode_gives_the_reference_weight(n, k, group, asym, dtype):
    qweight, scales, zeros, group, _ = _int4(n, k, group, asym, False, dtype, 7 * n + k)
    packed = quant.repack(qweight, scales, zeros, group)
    weight = _kernel_weight(packed)
    assert bool(torch.isfinite(weight).all())  # padding multiplies zero-filled activations
    expected = reference.dequantize_int4(qweight, scales, zeros, group).to(dtype)  # [N, K]
    assert torch.equal(weight[:k, :n].t(), expected)


@pytest.mark.parametrize("group,dtype,message", [
    (16, torch.bfloat16, "group_size 16"), (48, torch.bfloat16, "group_size 48"),
    (128, torch.float32, "bfloat16 or float16"),
])
def test_repack_refuses_what_the_kernel_cannot_read(group, dtype, message):
    qweight, scales, zeros, _, _ = _int4(64, 384, 128, True, False, torch.bfloat16, 1)
    if group != 128:
        scales = scales[:1].expand(384 // group, -1).contiguous()
        zeros = zeros[:1].expand(384 // group, -1).contiguous()
    with pytest.raises(ValueError, match=message):
        quant.repack(qweight, scales, zeros, group, dtype=dtype)


def test_repack_names_a_mismatched_tensor():
    qweight, scales, zeros, group, _ = _int4(64, 384, 128, True, False, torch.bfloat16, 2)
    with pytest.raises(ValueError, match="scales"):
        quant.repack(qweight, scales[:, :8], zeros, group)
    with pytest.raises(ValueError, match="zeros"):
        quant.repack(qweight, scales, zeros.int(), group)
    with pytest.raises(ValueError, match="perm"):
        quant.repack(qweight, scales, zeros, group, torch.arange(10))


@pytest.mark.parametrize("m", [1, 7, 16, 33, 64, 256, 4096])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (136, 384)])
def test_split_k_parts_are_nonempty_and_fit_the_workspace(monkeypatch, m, n, k):
    monkeypatch.setattr(quant, "_sm_count", lambda device: 132)
    monkeypatch.setattr(quant, "_resident_ctas", lambda kernel, device: 4)
    mt = 1 if m <= 16 else 2 if m <= 32 else 4
    np_, k_stages = -(-n // 128) * 128, -(-k // 64)
    m_tiles = -(-m // (16 * mt))
    splits, per = quant._splits("w4a16_bf16_m16", None, m_tiles, np_ // 128, k_stages, m * np_,
                                min(m, 16 * mt))
    assert splits >= 1 and (splits - 1) * per < k_stages <= splits * per
    if splits > 1:
        assert splits * m * np_ <= quant.WORKSPACE_FLOATS
        assert m_tiles * np_ // 128 <= quant.MAX_SPLIT_TILES
        assert per >= 4
