"""The wgmma W4A16 kernels' index arithmetic (quant.cu, w4a16_wg), emulated in numpy on the CPU
against dequantize-then-matmul: the A fragments each lane builds from quant.repack's packed words
(words 2h / 2h + 1, shifts 8 kh and 8 kh + 4) placed by PTX's register layout for wgmma
m64nNk16, the activation tile as StageCopier writes it read through a K-major 128-byte-swizzle
descriptor (SBO 1024, start + 64 wk + 32 kh bytes), the accumulators mapped back by the
epilogue's (n, m) rule, scales and zero points as StageCopier / read_stage take them. Rows past M
hold NaN, as stale shared memory may: none reaches a stored output. What the GPU tests check by
running the kernels, this checks in their absence (CI has no GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve_kernels import quant, reference

CTA_N, STAGE_K = 128, 64


def _swizzled(lin: int) -> int:
    """Byte address of linear offset lin in the 128-byte swizzle (bits 4-6 ^= bits 7-9)."""
    return (lin & ~0x70) | ((((lin >> 4) & 7) ^ ((lin >> 7) & 7)) << 4)


def _emulate(m_rows, n, k, group, asym, rows, dtype, seed) -> tuple[np.ndarray, np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 1e-3).to(dtype)
    zeros = torch.randint(0, 17, (k // group, n), generator=gen).to(torch.uint8) if asym else None
    words = (q.view(-1, 8, n) << (torch.arange(8).view(1, 8, 1) * 4)).sum(1)
    qweight = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    packed = quant.repack(qweight, scales, zeros, group, None)
    weight = reference.dequantize_int4(qweight, scales, zeros, group).double().numpy()
    x = torch.randn(m_rows, k, generator=gen).to(dtype).double().numpy()
    qw = packed.qweight.numpy().view(np.uint32)  # [NB, KC, 32 lanes, 4 words]
    nbs = qw.shape[0]
    kp, np_ = qw.shape[1] * 32, nbs * 32
    sc = packed.scales.double().numpy().reshape(-1)
    zr = None if packed.zeros is None else packed.zeros.double().numpy().reshape(-1)
    base = quant.MAGIC_BASE[dtype]
    cpg = group >> 5
    gshift = int(np.log2(cpg)) if group % 32 == 0 and cpg & (cpg - 1) == 0 else -1
    y = np.full((m_rows, n), np.nan)
    for ncta in range(np_ // CTA_N):
        for m0 in range(0, m_rows, rows):
            acc = np.zeros((2, 2, 64, rows))  # [wk][h]: D, m64 x rows
            for s in range(kp // STAGE_K):
                xs = np.full(rows * 64, np.nan)  # the x tile, by element (2 bytes)
                for c in range(rows * 8):
                    row, ch = c >> 3, c & 7
                    kk, m = s * STAGE_K + ch * 8, m0 + row
                    if m < m_rows:
                        at = (row * 128 + ((ch ^ (row & 7)) << 4)) // 2
                        xs[at:at + 8] = x[m, kk:kk + 8] if kk < k else 0.0
                ssm, zsm = np.zeros((2, CTA_N)), np.zeros((2, CTA_N))
                for tid in range(64):
                    src_arr = sc if tid < 32 else zr
                    if src_arr is None:
                        continue
                    half, part = (tid & 31) >> 4, tid & 15
                    grp = ((2 * s + half) >> gshift if gshift >= 0
                           else (s * STAGE_K + half * 32) // group)
                    src = (grp * nbs + ncta * 4) * 32 + part * 8
                    (ssm if tid < 32 else zsm)[half, part * 8:part * 8 + 8] = src_arr[src:src + 8]
                for wk in range(2):
                    a_tile = np.full((2, 2, 64, 16), np.nan)  # [kh][h][row][k]
                    for wn in range(4):
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            qv = [int(v) for v in qw[ncta * 4 + wn, 2 * s + wk, lane]]
                            col = wn * 32 + g * 4
                            s2 = ssm[wk, col:col + 4]
                            z2 = zsm[wk, col:col + 4] - base if zr is not None else [8.0] * 4

                            def pair(v, j):  # Int4::pair: nibbles at bits 0 and 16
                                return (((v & 15) - z2[j]) * s2[j],
                                        (((v >> 16) & 15) - z2[j]) * s2[j])
                            for kh in range(2):
                                for h in range(2):
                                    regs = [pair(qv[2 * h] >> 8 * kh, 2 * h),
                                            pair(qv[2 * h + 1] >> 8 * kh, 2 * h + 1),
                                            pair(qv[2 * h] >> (8 * kh + 4), 2 * h),
                                            pair(qv[2 * h + 1] >> (8 * kh + 4), 2 * h + 1)]
                                    places = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                              (g + 8, 2 * t + 8)]
                                    for (r, c), (lo, hi) in zip(places, regs):
                                        a_tile[kh, h, 16 * wn + r, c:c + 2] = lo, hi
                    for kh in range(2):
                        start = wk * 64 + kh * 32
                        b_tile = np.array([[xs[_swizzled((r // 8) * 1024 + (r % 8) * 128 + start
                                                         + 2 * c) // 2] for r in range(rows)]
                                           for c in range(16)])
                        with np.errstate(invalid="ignore"):
                            for h in range(2):
                                acc[wk, h] += a_tile[kh, h] @ b_tile
            out = np.zeros((rows, CTA_N))
            for wk in range(2):
                for h in range(2):
                    for wn in range(4):
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            for r in range(rows // 2):
                                drow = 16 * wn + g + 8 * ((r >> 1) & 1)
                                dcol = 8 * (r >> 2) + 2 * t + (r & 1)
                                out[dcol, wn * 32 + h * 16 + g + 8 * ((r >> 1) & 1)] += \
                                    acc[wk, h, drow, dcol]
            for ml in range(min(rows, m_rows - m0)):
                cols = min(CTA_N, n - ncta * CTA_N)
                y[m0 + ml, ncta * CTA_N:ncta * CTA_N + cols] = out[ml, :cols]
    return y, x @ weight.T


@pytest.mark.parametrize("m_rows,n,k,group,asym,rows,dtype", [
    (70, 136, 384, 32, True, 64, torch.bfloat16),    # partial row and column tiles
    (130, 136, 200, -1, False, 128, torch.float16),  # K past the last stage, per-column scales
    (33, 264, 192, 64, True, 64, torch.bfloat16),
])
def test_wgmma_fragments_and_epilogue_compute_the_product(m_rows, n, k, group, asym, rows, dtype):
    y, expected = _emulate(m_rows, n, k, group, asym, rows, dtype, seed=m_rows + n)
    assert not np.isnan(y).any()
    assert np.abs(y - expected).max() <= 1e-9 * np.abs(expected).max()
