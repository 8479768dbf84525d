// Paged attention over the KV cache layout [num_blocks, num_kv_heads, block_size, head_dim]:
//   prefill: FlashAttention-2 style, 128 query rows x 64 keys per step, 4 warps, mma.sync m16n8k16
//            with ldmatrix, K/V pages gathered through the block table with cp.async (K of the next
//            tile loads during softmax and P.V, V of this tile during Q.K^T), base-2 online softmax.
//   prefill_wg (sm_90a, the default on Hopper at hd64 and over an FP8 cache): the same tiles on
//            wgmma, 2 warpgroups x 64 rows, 128 keys per step, K/V double-buffered
//            (prefill_wg_impl).
//   prefill_wgp (sm_90a, the default on Hopper at hd128): FlashAttention-3's schedule on those
//            tiles, a producer warpgroup and two consumers, persistent (prefill_wgp_impl).
//   decode:  flash-decoding; one CTA per (seq, kv head, split) serves all query heads of the group
//            (they are the M rows of the MMA), 3-4 stage cp.async pipeline, partials merged by a
//            log-sum-exp combine kernel when the context is split.
// Every kernel takes a sliding window W (a query at p sees keys p - W < k <= p; W <= 0: causal
// only) and a logit soft-cap c (scores c * tanh(score / c) before the mask; c <= 0: none) as
// runtime arguments: one build serves every layer, and a captured graph keeps its layers' values.
// Candidate kernels that only benchmarks and tests launch are built with -DPS_VARIANTS.
// Over an FP8 (e4m3) cache (C = kv_fp8, entry points in kv_fp8.cu), K/V pages are
// staged as bytes by the same cp.async pipelines, converted in shared memory to the tile of T
// the MMAs read (exactly: every e4m3 value is a bf16/fp16 one), and the layer's k_scale folds
// into the softmax scale, its v_scale into the output's normalisation.
#include "kv_fp8.cuh"

namespace ps {

constexpr int kThreads = 128;  // 4 warps for every attention kernel here
constexpr int kPrefillBM = 128;
constexpr int kPrefillBN = 64;
constexpr int kDecodeBN = 64;  // keys per pipeline stage; each warp owns 16 of them
constexpr float kLog2e = 1.4426950408889634f;

// Whether the query at position qpos sees the key at kpos: causal, and within the window.
__device__ __forceinline__ bool sees(int qpos, int kpos, int window) {
  return kpos <= qpos && (window <= 0 || kpos > qpos - window);
}

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Soft-capping of raw scores (q.k, before the scale): the kernels' softmax multiplies a score
// by scale_log2 = scale * log2(e), so s becomes (c / scale) * tanh(s * scale / c), whose
// product with scale_log2 is log2(e) * c * tanh(s * scale / c): the cap on the natural score.
template <int N>
__device__ __forceinline__ void soft_cap_scores(float (&s)[N], float soft_cap, float scale_log2) {
  const float in = scale_log2 / (soft_cap * kLog2e), out = soft_cap * kLog2e / scale_log2;
#pragma unroll
  for (int i = 0; i < N; ++i) s[i] = out * tanh_approx(s[i] * in);
}

// ---------------------------------------------------------------------------------------------
// Tile list for prefill: for every sequence, its query tiles of `bm` tokens (seq, m_block), last
// tile first (the last tiles see the most keys). Entries past the total are (-1, 0): those CTAs
// exit at once. One CTA of 1024 threads; launched before the attention kernel on the same stream.
__device__ void prefill_tiles_impl(const int* __restrict__ cu_seqlens_q, int num_seqs,
                                   int2* __restrict__ tiles, int num_entries, int bm) {
  __shared__ int scan[1024];  // blockDim.x <= 1024 (a launch of fewer threads for few seqs)
  const int tid = threadIdx.x, width = blockDim.x;
  int base = 0;
  for (int start = 0; start < num_seqs; start += width) {
    const int s = start + tid;
    int nt = 0;
    if (s < num_seqs) nt = (cu_seqlens_q[s + 1] - cu_seqlens_q[s] + bm - 1) / bm;
    scan[tid] = nt;
    __syncthreads();
    for (int off = 1; off < width; off <<= 1) {
      const int v = tid >= off ? scan[tid - off] : 0;
      __syncthreads();
      scan[tid] += v;
      __syncthreads();
    }
    const int first = base + scan[tid] - nt;
    for (int k = 0; k < nt && first + k < num_entries; ++k) tiles[first + k] = make_int2(s, nt - 1 - k);
    base += scan[width - 1];
    __syncthreads();
  }
  for (int i = base + tid; i < num_entries; i += width) tiles[i] = make_int2(-1, 0);
}

// ---------------------------------------------------------------------------------------------
template <typename T, int HD, typename C = T>
__device__ __forceinline__ void prefill_impl(
    const T* __restrict__ q, T* __restrict__ out, const C* __restrict__ k_cache,
    const C* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ seq_lens,
    const int2* __restrict__ tiles, long long q_stride_tok, int q_stride_head,
    long long o_stride_tok, int o_stride_head, int num_heads, int num_kv_heads, int block_size_log2,
    int max_blocks_per_seq, float scale_log2, int window, float soft_cap,
    const float* __restrict__ k_scale = nullptr, const float* __restrict__ v_scale = nullptr) {
  constexpr bool F8 = sizeof(C) == 1;
  constexpr int BM = kPrefillBM, BN = kPrefillBN;
  constexpr int CH = HD / 8;                 // 16-byte chunks per row
  constexpr int ROW_STEP = kThreads / CH;    // rows covered by one pass of the CTA
  constexpr int KV_ROWS = BN / ROW_STEP;     // K (or V) rows each thread loads per tile
  constexpr int Q_ROWS = BM / ROW_STEP;
  constexpr int MT = 2;                      // m16 tiles per warp (32 query rows per warp)
  constexpr int NT = BN / 8;                 // n8 tiles of S
  constexpr int DT = HD / 8;                 // n8 tiles of O
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * HD;
  T* sV = sK + BN * HD;
  kv_fp8* stK = reinterpret_cast<kv_fp8*>(sV + BN * HD);  // F8: K_j, V_j as staged, row-major
  kv_fp8* stV = stK + BN * HD;

  const int2 tile = tiles[blockIdx.y];
  const int seq = tile.x;
  if (seq < 0) return;
  float v_mul = 1.f;
  if constexpr (F8) {
    scale_log2 *= *k_scale;
    v_mul = *v_scale;
  }
  const int m0 = tile.y * BM;
  const int head = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int q_begin = cu_seqlens_q[seq];
  const int q_len = cu_seqlens_q[seq + 1] - q_begin;
  const int ctx0 = seq_lens[seq] - q_len;  // position of this sequence's first new token
  const int kv_head = head / (num_heads / num_kv_heads);
  const int rows_here = min(BM, q_len - m0);
  const int kv_end = ctx0 + m0 + rows_here;  // keys [0, kv_end) are visible to some row here
  const int n_tiles = (kv_end + BN - 1) / BN;
  // With a window, tiles before the first row's window are never read.
  const int j0 = window > 0 ? max(0, ctx0 + m0 - window + 1) / BN : 0;
  const int bs_mask = (1 << block_size_log2) - 1;
  const int* bt = block_tables + (long long)seq * max_blocks_per_seq;
  const long long head_off = (long long)kv_head << (block_size_log2);  // in rows
  const int ld_ch = tid % CH, ld_row = tid / CH;

  // Q tile -> sQ (rows past q_len zero-filled).
#pragma unroll
  for (int i = 0; i < Q_ROWS; ++i) {
    const int r = ld_row + i * ROW_STEP;
    const bool ok = m0 + r < q_len;
    const T* src = ok ? q + (long long)(q_begin + m0 + r) * q_stride_tok +
                            (long long)head * q_stride_head + ld_ch * 8
                      : q;
    cp_async16(smem_addr(sQ + swz<HD>(r, ld_ch)), src, ok ? 16 : 0);
  }

  // Page ids of tiles j (for V_j) and j+1 (for K_{j+1}) live in a double-buffered smem list,
  // so the block-table loads stay off the cp.async issue path and out of registers.
  constexpr int TPG = 8;  // >= pages per tile for every block_size >= BN / 8
  __shared__ int s_tpg[2][TPG];
  const int tile_pages = BN >> block_size_log2 > 0 ? BN >> block_size_log2 : 1;
  auto page_of_tile = [&](int j, int i) -> int {  // the i-th page touched by tile j, or -1
    const int p = ((j * BN) >> block_size_log2) + i;
    return (i < tile_pages && (p << block_size_log2) < kv_end) ? __ldg(bt + p) : -1;
  };
  auto issue = [&](const T* cache, T* dst, int j) {
    const int* tpg = s_tpg[j & 1];
    const int first = (j * BN) >> block_size_log2;
#pragma unroll
    for (int i = 0; i < KV_ROWS; ++i) {
      const int r = ld_row + i * ROW_STEP;
      const int kpos = j * BN + r;
      const bool ok = kpos < kv_end;
      const T* src = cache;
      if (ok)
        src = cache + (((long long)tpg[(kpos >> block_size_log2) - first] * num_kv_heads
                        << block_size_log2) + head_off + (kpos & bs_mask)) * HD + ld_ch * 8;
      cp_async16(smem_addr(dst + swz<HD>(r, ld_ch)), src, ok ? 16 : 0);
    }
  };
  // F8: 16 elements a 16-byte chunk, into the row-major staging tile.
  auto issue8 = [&](const C* cache, kv_fp8* dst, int j) {
    constexpr int CH8 = HD / 16, ROW_STEP8 = kThreads / CH8;
    const int* tpg = s_tpg[j & 1];
    const int first = (j * BN) >> block_size_log2;
    const int c8 = tid % CH8;
#pragma unroll
    for (int i = 0; i < BN / ROW_STEP8; ++i) {
      const int r = tid / CH8 + i * ROW_STEP8;
      const int kpos = j * BN + r;
      const bool ok = kpos < kv_end;
      const C* src = cache;
      if (ok)
        src = cache + (((long long)tpg[(kpos >> block_size_log2) - first] * num_kv_heads
                        << block_size_log2) + head_off + (kpos & bs_mask)) * HD + c8 * 16;
      cp_async16(smem_addr(dst + r * HD + c8 * 16), src, ok ? 16 : 0);
    }
  };

  if (tid < TPG) s_tpg[j0 & 1][tid] = page_of_tile(j0, tid);
  __syncthreads();
  if constexpr (F8) issue8(k_cache, stK, j0);
  else issue(k_cache, sK, j0);
  cp_async_commit();

  float o[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.f;
  }
  const int warp_row0 = warp * 32;
  const int warp_qpos0 = ctx0 + m0 + warp_row0;  // position of the warp's first row
  const bool warp_has_rows = m0 + warp_row0 < q_len;
  // ldmatrix lane roles: Q and V rows (lane & 15 / 8-row pairs), K rows (n-tile pairs).
  const unsigned int q_base = smem_addr(sQ) + warp_row0 * HD * 2, k_base = smem_addr(sK),
                     v_base = smem_addr(sV);
  const unsigned int q_off = ldm_off<HD>(lane & 15, lane >> 4);
  const unsigned int k_off = ldm_off<HD>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  const unsigned int v_off = ldm_off<HD>((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);

  for (int j = j0; j < n_tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // K_j (and Q) landed; every warp is done reading sV
    if constexpr (F8) {
      issue8(v_cache, stV, j);
      cp_async_commit();
      fp8_rows_to_tile<T, HD, BN, kThreads>(stK, sK, 0, tid);
      __syncthreads();  // sK converted
    } else {
      issue(v_cache, sV, j);
      cp_async_commit();
    }
    const int next_page = (tid < TPG && j + 1 < n_tiles) ? page_of_tile(j + 1, tid) : -1;

    // Some key of the tile is at or before the warp's last row and inside its first row's window.
    const bool active = warp_has_rows && j * BN <= warp_qpos0 + 31 &&
                        (window <= 0 || (j + 1) * BN - 1 > warp_qpos0 - window);
    float s[MT][NT][4];
    if (active) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        unsigned int qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldmatrix_x4(qa[mt], q_base + mt * 16 * HD * 2 + (q_off ^ (kk << 5)));
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
          unsigned int kb[4];
          ldmatrix_x4(kb, k_base + np * 16 * HD * 2 + (k_off ^ (kk << 5)));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma16816<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
            mma16816<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
          }
        }
      }
      if (soft_cap > 0.f) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) soft_cap_scores(s[mt][nt], soft_cap, scale_log2);
      }
      // The causal mask or the window's lower edge reaches this warp's rows.
      if ((j + 1) * BN - 1 > warp_qpos0 || (window > 0 && j * BN <= warp_qpos0 + 31 - window)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qpos = warp_qpos0 + mt * 16 + g + ((e >> 1) << 3);
              const int kpos = j * BN + nt * 8 + 2 * t4 + (e & 1);
              if (!sees(qpos, kpos, window)) s[mt][nt][e] = -INFINITY;
            }
      }
    }
    if (tid < TPG) s_tpg[(j + 1) & 1][tid] = next_page;
    cp_async_wait<0>();
    __syncthreads();  // V_j landed; every warp is done reading sK; page list j+1 visible
    if constexpr (F8) {
      if (j + 1 < n_tiles) issue8(k_cache, stK, j + 1);
      cp_async_commit();
      fp8_rows_to_tile<T, HD, BN, kThreads>(stV, sV, 0, tid);
      __syncthreads();  // sV converted
    } else {
      if (j + 1 < n_tiles) issue(k_cache, sK, j + 1);
      cp_async_commit();
    }
    if (!active) continue;

    // Online softmax (base 2), one row per (mt, half); a row's 16 values sit in one lane quad.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mt][h], mx * scale_log2);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float corr = exp2_approx(m_run[mt][h] - m_use);
        m_run[mt][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2_approx(fmaf(s[mt][nt][2 * h + e], scale_log2, -m_use));
            s[mt][nt][2 * h + e] = p;
            sum += p;
          }
        l_run[mt][h] = l_run[mt][h] * corr + sum;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][2 * h] *= corr;
          o[mt][dt][2 * h + 1] *= corr;
        }
      }

    // O += P V: P stays in registers as the A operand.
#pragma unroll
    for (int kb = 0; kb < BN / 16; ++kb) {
      unsigned int pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = Pack<T>::two(s[mt][2 * kb][0], s[mt][2 * kb][1]);
        pa[mt][1] = Pack<T>::two(s[mt][2 * kb][2], s[mt][2 * kb][3]);
        pa[mt][2] = Pack<T>::two(s[mt][2 * kb + 1][0], s[mt][2 * kb + 1][1]);
        pa[mt][3] = Pack<T>::two(s[mt][2 * kb + 1][2], s[mt][2 * kb + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        unsigned int vb[4];
        ldmatrix_x4_trans(vb, v_base + kb * 16 * HD * 2 + (v_off ^ (dp << 5)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
          mma16816<T>(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
  }

  // Epilogue: normalise, stage the warp's own 32 rows in sQ (only this warp ever read them), then
  // 16-byte coalesced stores.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[mt][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      float inv = l > 0.f ? 1.f / l : 0.f;
      if constexpr (F8) inv *= v_mul;
      const int row = warp_row0 + mt * 16 + g + h * 8;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<unsigned int*>(sQ + swz<HD>(row, dt) + 2 * t4) =
            Pack<T>::two(o[mt][dt][2 * h] * inv, o[mt][dt][2 * h + 1] * inv);
    }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 32 * CH / 32; ++i) {
    const int c = lane + i * 32;
    const int row = warp_row0 + c / CH, ch = c % CH;
    if (m0 + row < q_len) {
      const uint4 v = *reinterpret_cast<const uint4*>(sQ + swz<HD>(row, ch));
      *reinterpret_cast<uint4*>(out + (long long)(q_begin + m0 + row) * o_stride_tok +
                                (long long)head * o_stride_head + ch * 8) = v;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill on Hopper tensor cores (wgmma, sm_90a): 2 warpgroups x 64 query rows = 128 rows per CTA,
// 128 keys per step. K and V tiles are gathered page by page with cp.async into double buffers in
// the 128-byte-swizzle layout the wgmma descriptors read; tile j+1 loads during tile j's work, so
// one __syncthreads per tile. S = Q K^T with both operands in smem; P stays in registers as the A
// operand of O += P V (V read N-major through the descriptor, no transpose pass). Element offsets
// of the key rows of the tile after next are computed once per row by 128 threads into a
// double-buffered smem list (the page-table walk is off the copy path). Over an FP8 cache the
// double buffers hold the staged bytes, and each tile is converted into one K/V tile of T (the
// same bytes of shared memory in all: 1 KiB + 1,280 x head_dim).
constexpr int kWgThreads = 256;
constexpr int kWgBN = 128;

// The wg_* pieces below are shared by prefill_wg_impl and the pipelined kernel
// (prefill_wgp_impl): the tile's key range, the page walk, the gathers, the MMAs, masking,
// softmax and the output.

// A CTA's entry of the tile list: sequence `seq`'s 128 query rows from m0, and the key tiles
// [j0, n_tiles) some row of it sees (with a window, tiles before the first row's window are
// never read).
struct WgTile {
  int m0, q_begin, q_len, ctx0, kv_head, kv_end, n_tiles, j0, bs_mask;
  const int* bt;  // the sequence's block table row
};

__device__ __forceinline__ WgTile wg_tile(int2 tile, int head, const int* __restrict__ cu_seqlens_q,
                                          const int* __restrict__ seq_lens,
                                          const int* __restrict__ block_tables, int num_heads,
                                          int num_kv_heads, int block_size_log2,
                                          int max_blocks_per_seq, int window) {
  WgTile w;
  const int seq = tile.x;
  w.m0 = tile.y * kPrefillBM;
  w.q_begin = cu_seqlens_q[seq];
  w.q_len = cu_seqlens_q[seq + 1] - w.q_begin;
  w.ctx0 = seq_lens[seq] - w.q_len;  // position of this sequence's first new token
  w.kv_head = head / (num_heads / num_kv_heads);
  const int rows_here = min(kPrefillBM, w.q_len - w.m0);
  w.kv_end = w.ctx0 + w.m0 + rows_here;  // keys [0, kv_end) are visible to some row here
  w.n_tiles = (w.kv_end + kWgBN - 1) / kWgBN;
  w.j0 = window > 0 ? max(0, w.ctx0 + w.m0 - window + 1) / kWgBN : 0;
  w.bs_mask = (1 << block_size_log2) - 1;
  w.bt = block_tables + (long long)seq * max_blocks_per_seq;
  return w;
}

// Element offset in the cache of the key at position kpos (the page walk).
template <int HD>
__device__ __forceinline__ long long wg_key_off(const WgTile& w, int kpos, int num_kv_heads,
                                                int block_size_log2) {
  const int page = __ldg(w.bt + (kpos >> block_size_log2));
  return ((((long long)page * num_kv_heads + w.kv_head) << block_size_log2) + (kpos & w.bs_mask)) *
         HD;
}

// Element offset in the cache of key row r of key tile j, -1 past kv_end.
template <int HD>
__device__ __forceinline__ long long wg_row_off(const WgTile& w, int j, int r, int num_kv_heads,
                                                int block_size_log2) {
  const int kpos = j * kWgBN + r;
  return kpos >= w.kv_end ? -1 : wg_key_off<HD>(w, kpos, num_kv_heads, block_size_log2);
}

// cp.async of one key tile's rows (offsets rows[r] from wg_row_off; -1 zero-fills) into
// 128-byte-swizzle tiles by NTH threads (tid < NTH): from a_cache into da, and with N == 2 the
// same rows from b_cache into db.
template <int HD, int NTH, int N, typename C>
__device__ __forceinline__ void wg_gather(const C* a_cache, unsigned int da, const C* b_cache,
                                          unsigned int db, const long long* rows, int tid) {
  constexpr int CH = HD / 8, ROW_STEP = NTH / CH;
  const int ld_ch = tid % CH, ld_row = tid / CH;
#pragma unroll
  for (int i = 0; i < kWgBN / ROW_STEP; ++i) {
    const int r = ld_row + i * ROW_STEP;
    const long long off = rows[r];
    const bool ok = off >= 0;
    const unsigned int d = sw128_off(r, ld_ch, kWgBN);
    cp_async16(da + d, ok ? a_cache + off + ld_ch * 8 : a_cache, ok ? 16 : 0);
    if constexpr (N == 2)
      cp_async16(db + d, ok ? b_cache + off + ld_ch * 8 : b_cache, ok ? 16 : 0);
  }
}

// The Q tile (rows past q_len zero-filled) into sQ by NTH threads (tid < NTH), with cp.async.
template <typename T, int HD, int NTH = kWgThreads>
__device__ __forceinline__ void wg_load_q(const T* __restrict__ q, unsigned int sQ, const WgTile& w,
                                          int head, long long q_stride_tok, int q_stride_head,
                                          int tid) {
  constexpr int CH = HD / 8, ROW_STEP = NTH / CH;
  const int ld_ch = tid % CH, ld_row = tid / CH;
#pragma unroll
  for (int i = 0; i < kPrefillBM / ROW_STEP; ++i) {
    const int r = ld_row + i * ROW_STEP;
    const bool ok = w.m0 + r < w.q_len;
    const T* src = ok ? q + (long long)(w.q_begin + w.m0 + r) * q_stride_tok +
                            (long long)head * q_stride_head + ld_ch * 8
                      : q;
    cp_async16(sQ + sw128_off(r, ld_ch, kPrefillBM), src, ok ? 16 : 0);
  }
}

// Warpgroup-uniform: some key of tile j is at or before the warpgroup's last row (its rows start
// at query position qpos0) and inside its first row's window. A macro, so that each use compiles
// as an inline condition (a function returning it schedules prefill_wg's loop differently).
#define PS_WG_SEES_TILE(j, has_rows, qpos0, window) \
  ((has_rows) && (j) * kWgBN <= (qpos0) + 63 &&      \
   ((window) <= 0 || ((j) + 1) * kWgBN - 1 > (qpos0) - (window)))

// Issues S = Q K^T (m64 x kWgBN per warpgroup, HD / 16 wgmma; k_desc: the K tile, K-major,
// wg_desc(sK, 16, 1024)); the caller fences and commits.
template <typename T, int HD>
__device__ __forceinline__ void wg_qk(float (&s)[kWgBN / 2], unsigned long long q_desc,
                                      unsigned long long k_desc) {
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    const unsigned int a_off = (ks >> 2) * (kPrefillBM * 128) + (ks & 3) * 32;
    const unsigned int b_off = (ks >> 2) * (kWgBN * 128) + (ks & 3) * 32;
    if (ks == 0)
      wgmma_ss_m64n128<0>(s, q_desc + (a_off >> 4), k_desc + (b_off >> 4), T());
    else
      wgmma_ss_m64n128<1>(s, q_desc + (a_off >> 4), k_desc + (b_off >> 4), T());
  }
}

// Issues O += P V (kWgBN / 16 wgmma, P in registers; v_desc: the V tile, N-major,
// wg_desc(sV, kWgBN * 128, 1024)); the caller fences and commits.
template <typename T, int HD>
__device__ __forceinline__ void wg_pv(float (&o)[HD / 2], const unsigned int (&pa)[kWgBN / 16][4],
                                      unsigned long long v_desc) {
#pragma unroll
  for (int kb = 0; kb < kWgBN / 16; ++kb) {
    if constexpr (HD == 128)
      wgmma_rs_m64n128_tb(o, pa[kb], v_desc + ((kb * 2048) >> 4), T());
    else
      wgmma_rs_m64n64_tb(o, pa[kb], v_desc + ((kb * 2048) >> 4), T());
  }
}

// Soft-cap, then the causal mask and the window's lower edge on a warp's 16 rows (from query
// position qpos0) of S for key tile j; the mask only where it reaches those rows.
__device__ __forceinline__ void wg_mask_scores(float (&s)[kWgBN / 2], int j, int qpos0, int g,
                                               int t4, int window, float soft_cap,
                                               float scale_log2) {
  if (soft_cap > 0.f) soft_cap_scores(s, soft_cap, scale_log2);
  if ((j + 1) * kWgBN - 1 > qpos0 || (window > 0 && j * kWgBN <= qpos0 + 15 - window)) {
#pragma unroll
    for (int nt = 0; nt < kWgBN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qpos = qpos0 + g + ((e >> 1) << 3);
        const int kpos = j * kWgBN + nt * 8 + 2 * t4 + (e & 1);
        if (!sees(qpos, kpos, window)) s[nt * 4 + e] = -INFINITY;
      }
  }
}

// Base-2 online softmax of a thread's row h (g + 8 h) of S: the scores become P, m_run and l_run
// move on; returns the factor that brings O accumulated so far to the new maximum.
__device__ __forceinline__ float wg_softmax_row(float (&s)[kWgBN / 2], int h, float& m_run,
                                                float& l_run, float scale_log2) {
  constexpr int NT = kWgBN / 8;
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt * 4 + 2 * h], s[nt * 4 + 2 * h + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m_run, mx * scale_log2);
  const float m_use = m_new == -INFINITY ? 0.f : m_new;
  const float corr = exp2_approx(m_run - m_use);
  m_run = m_new;
  float sum = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float p = exp2_approx(fmaf(s[nt * 4 + 2 * h + e], scale_log2, -m_use));
      s[nt * 4 + 2 * h + e] = p;
      sum += p;
    }
  l_run = l_run * corr + sum;
  return corr;
}

template <int N>
__device__ __forceinline__ void wg_scale_o_row(float (&o)[N], int h, float corr) {
#pragma unroll
  for (int dt = 0; dt < N / 4; ++dt) {
    o[dt * 4 + 2 * h] *= corr;
    o[dt * 4 + 2 * h + 1] *= corr;
  }
}

// P (fp32 in the accumulator layout) packed as the A fragments of P V, 16 keys each.
template <typename T>
__device__ __forceinline__ void wg_pack_p(const float (&s)[kWgBN / 2],
                                          unsigned int (&pa)[kWgBN / 16][4]) {
#pragma unroll
  for (int kb = 0; kb < kWgBN / 16; ++kb) {
    pa[kb][0] = Pack<T>::two(s[(2 * kb) * 4 + 0], s[(2 * kb) * 4 + 1]);
    pa[kb][1] = Pack<T>::two(s[(2 * kb) * 4 + 2], s[(2 * kb) * 4 + 3]);
    pa[kb][2] = Pack<T>::two(s[(2 * kb + 1) * 4 + 0], s[(2 * kb + 1) * 4 + 1]);
    pa[kb][3] = Pack<T>::two(s[(2 * kb + 1) * 4 + 2], s[(2 * kb + 1) * 4 + 3]);
  }
}

// Epilogue of warpgroup tid >> 7 (0 or 1): O / l (times out_mul), staged in the warpgroup's own
// 64 rows of the Q tile (no other warpgroup reads them; its own MMAs on them are complete), then
// 16-byte coalesced stores of the rows before q_len.
template <typename T, int HD>
__device__ __forceinline__ void wg_store_out(const float (&o)[HD / 2], const float (&l_run)[2],
                                             float out_mul, unsigned char* sQ_ptr, const WgTile& w,
                                             int head, T* __restrict__ out, long long o_stride_tok,
                                             int o_stride_head, int tid) {
  constexpr int CH = HD / 8, DT = HD / 8;
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int wg_row0 = wg * 64, row0 = wg_row0 + warp * 16;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    float inv = l > 0.f ? 1.f / l : 0.f;
    inv *= out_mul;
    const int row = row0 + g + h * 8;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<unsigned int*>(sQ_ptr + sw128_off(row, dt, kPrefillBM) + 4 * t4) =
          Pack<T>::two(o[dt * 4 + 2 * h] * inv, o[dt * 4 + 2 * h + 1] * inv);
  }
  if (wg == 0)  // this warpgroup only (named barriers 1 and 2)
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
  else
    asm volatile("bar.sync 2, 128;\n" ::: "memory");
  const int wtid = tid & 127;
#pragma unroll
  for (int i = 0; i < 64 * CH / 128; ++i) {
    const int c = wtid + i * 128;
    const int row = wg_row0 + c / CH, ch = c % CH;
    if (w.m0 + row < w.q_len) {
      const uint4 v = *reinterpret_cast<const uint4*>(sQ_ptr + sw128_off(row, ch, kPrefillBM));
      *reinterpret_cast<uint4*>(out + (long long)(w.q_begin + w.m0 + row) * o_stride_tok +
                                (long long)head * o_stride_head + ch * 8) = v;
    }
  }
}

template <typename T, int HD, typename C = T>
__device__ __forceinline__ void prefill_wg_impl(
    const T* __restrict__ q, T* __restrict__ out, const C* __restrict__ k_cache,
    const C* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ seq_lens,
    const int2* __restrict__ tiles, long long q_stride_tok, int q_stride_head,
    long long o_stride_tok, int o_stride_head, int num_heads, int num_kv_heads, int block_size_log2,
    int max_blocks_per_seq, float scale_log2, int window, float soft_cap,
    const float* __restrict__ k_scale = nullptr, const float* __restrict__ v_scale = nullptr) {
#if PS_HAS_WGMMA
  constexpr bool F8 = sizeof(C) == 1;
  constexpr int BN = kWgBN, NTH = kWgThreads;
  constexpr int DT = HD / 8;
  constexpr unsigned int Q_BYTES = kPrefillBM * HD * 2, KV_BYTES = BN * HD * 2, KV8_BYTES = BN * HD;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ long long s_row[2][BN];  // element offset of each key row of a tile; -1: past the end

  const int2 tile = tiles[blockIdx.y];
  if (tile.x < 0) return;
  const unsigned int raw_addr = smem_addr(smem_raw);
  const unsigned int sQ = (raw_addr + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
  unsigned char* const sQ_ptr = smem_raw + (sQ - raw_addr);
  const unsigned int sKV = sQ + Q_BYTES;  // buffer b: K at sKV + b * 2 * KV_BYTES, V after it
  // F8: the converted K and V tiles at sKV; staged buffer b at sST + b * 2 * KV8_BYTES (K, V).
  const unsigned int sST = sKV + 2 * KV_BYTES;
  float v_mul = 1.f;
  if constexpr (F8) {
    scale_log2 *= *k_scale;
    v_mul = *v_scale;
  }

  const int head = blockIdx.x;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const WgTile w = wg_tile(tile, head, cu_seqlens_q, seq_lens, block_tables, num_heads,
                           num_kv_heads, block_size_log2, max_blocks_per_seq, window);
  const int n_tiles = w.n_tiles, j0 = w.j0;

  auto row_off = [&](int j, int r) {
    return wg_row_off<HD>(w, j, r, num_kv_heads, block_size_log2);
  };
  auto issue = [&](int j) {
    const unsigned int dk = sKV + (j & 1) * 2 * KV_BYTES, dv = dk + KV_BYTES;
    wg_gather<HD, NTH, 2>(k_cache, dk, v_cache, dv, s_row[j & 1], tid);
  };
  // F8: 16 elements a 16-byte chunk, into the row-major staging buffer (j & 1).
  auto issue8 = [&](int j) {
    constexpr int CH8 = HD / 16, ROW_STEP8 = NTH / CH8;
    const long long* rows = s_row[j & 1];
    const unsigned int dk = sST + (j & 1) * 2 * KV8_BYTES, dv = dk + KV8_BYTES;
    const int c8 = tid % CH8;
#pragma unroll
    for (int i = 0; i < BN / ROW_STEP8; ++i) {
      const int r = tid / CH8 + i * ROW_STEP8;
      const long long off = rows[r];
      const bool ok = off >= 0;
      const unsigned int d = r * HD + c8 * 16;
      cp_async16(dk + d, ok ? k_cache + off + c8 * 16 : k_cache, ok ? 16 : 0);
      cp_async16(dv + d, ok ? v_cache + off + c8 * 16 : v_cache, ok ? 16 : 0);
    }
  };
  // F8: staged buffer (j & 1) -> the K and V tiles of T in the 128-byte-swizzle layout, by all
  // threads; visible to the tensor cores after the barrier that follows.
  auto convert = [&](int j) {
    constexpr int CH = HD / 8;
    const unsigned char* st = smem_raw + (sST - raw_addr) + (j & 1) * 2 * KV8_BYTES;
    unsigned char* kv = smem_raw + (sKV - raw_addr);
#pragma unroll 2  // fully unrolled, hd64's loads in flight spill its accumulators
    for (int i = 0; i < 2 * BN * CH / NTH; ++i) {
      const int u = tid + i * NTH;
      const int m = u / (BN * CH), r = (u / CH) % BN, ch = u % CH;
      const uint2 raw = *reinterpret_cast<const uint2*>(st + m * KV8_BYTES + r * HD + ch * 8);
      *reinterpret_cast<uint4*>(kv + m * KV_BYTES + sw128_off(r, ch, BN)) =
          FromE4m3<T>::eight(raw);
    }
    fence_proxy_async();
  };

  // Q tile, row offsets of tile j0, then K/V of tile j0.
  wg_load_q<T, HD>(q, sQ, w, head, q_stride_tok, q_stride_head, tid);
  if (tid < BN) s_row[j0 & 1][tid] = row_off(j0, tid);
  __syncthreads();
  if constexpr (F8) issue8(j0);
  else issue(j0);
  cp_async_commit();
  if (tid < BN) s_row[(j0 + 1) & 1][tid] = row_off(j0 + 1, tid);

  float o[DT * 4];
#pragma unroll
  for (int i = 0; i < DT * 4; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int wg_row0 = wg * 64;                       // first row of this warpgroup in the tile
  const int row0 = wg_row0 + warp * 16;              // first row of this warp
  const int wg_qpos0 = w.ctx0 + w.m0 + wg_row0;
  const int warp_qpos0 = w.ctx0 + w.m0 + row0;
  const bool wg_has_rows = w.m0 + wg_row0 < w.q_len;
  const unsigned long long q_desc = wg_desc(sQ + wg_row0 * 128, 16, 1024);

  for (int j = j0; j < n_tiles; ++j) {
    cp_async_wait<0>();
    fence_proxy_async();  // cp.async writes -> visible to the tensor cores' (async) proxy
    __syncthreads();      // tile j (and Q) landed for all; buffer (j+1)&1 and s_row[(j+1)&1] free
    if constexpr (F8) {
      if (j + 1 < n_tiles) issue8(j + 1);
    } else {
      if (j + 1 < n_tiles) issue(j + 1);
    }
    cp_async_commit();
    if (tid < BN && j + 2 < n_tiles) s_row[j & 1][tid] = row_off(j + 2, tid);
    if constexpr (F8) {
      convert(j);
      __syncthreads();  // the K/V tiles of T are whole (the last tile's MMAs waited for)
    }

    if (!PS_WG_SEES_TILE(j, wg_has_rows, wg_qpos0, window)) continue;
    const unsigned int sK = F8 ? sKV : sKV + (j & 1) * 2 * KV_BYTES, sV = sK + KV_BYTES;
    const unsigned long long k_desc = wg_desc(sK, 16, 1024);
    float s[BN / 2];
    fence_regs(o);
    wgmma_fence();
    wg_qk<T, HD>(s, q_desc, k_desc);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);

    wg_mask_scores(s, j, warp_qpos0, g, t4, window, soft_cap, scale_log2);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wg_scale_o_row(o, h, wg_softmax_row(s, h, m_run[h], l_run[h], scale_log2));
    unsigned int pa[BN / 16][4];
    wg_pack_p<T>(s, pa);
    // V tile as B, N-major: hd blocks of 64 are BN * 128 bytes apart (LBO), 8-key groups 1024.
    const unsigned long long v_desc = wg_desc(sV, BN * 128, 1024);
    fence_regs(o);
    wgmma_fence();
    wg_pv<T, HD>(o, pa, v_desc);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
  }
  wg_store_out<T, HD>(o, l_run, v_mul, sQ_ptr, w, head, out, o_stride_tok, o_stride_head, tid);
#else
  __trap();  // built without sm_90a: the launcher never picks this kernel then
#endif
}

// ---------------------------------------------------------------------------------------------
// Prefill on Hopper with FlashAttention-3's schedule (the pipelined kernel, prefill_wgp):
// prefill_wg's tiles, smem layout and arithmetic (the wg_* pieces), on 3 warpgroups.
// - Warpgroup 2 produces: each of its threads walks the block table for one key row of a tile,
//   and its warps gather K_t, then V_{t-1}, with cp.async into two stages (wgp_gather); each
//   thread's copies arrive on the stage's `full` mbarrier when they land
//   (cp.async.mbarrier.arrive.noinc), and it waits on the stage's `empty` mbarrier before
//   refilling it. It keeps 56 registers, so the consumers get 224 (setmaxnreg).
// - Warpgroups 0 and 1 consume, 64 query rows each. Step j issues S_{j+1} = Q K_{j+1}^T,
//   rescales O, issues O += P_j V_j, waits for S_{j+1} only (wgmma.wait_group 1) and runs its
//   softmax while P_j V_j is on the tensor cores. The two take turns to issue (named barriers),
//   so one's softmax overlaps the other's MMAs; nothing after the start is CTA-wide.
// Every consumer waits for every stage's `full` and arrives on its `empty` (also for tiles its
// rows skip), so each mbarrier phase counts exactly one use of its stage (NOTES.md).
constexpr int kWgpThreads = 384;
static_assert(kWgpThreads == kWgThreads + 128, "2 consumer warpgroups, then the producer");

#if PS_HAS_WGMMA
// Named barriers: 0 is __syncthreads, 1 and 2 wg_store_out's, 3 the Q tile landed (consumers,
// prefill_wgp_impl); kWgpBarTurn + wg: consumer warpgroup wg may issue its MMAs.
enum WgpBarrier : int { kWgpBarTurn = 5 };

// What a consumer step reads besides its accumulators; base: the K (and V) fills of the CTA's
// earlier work items.
struct WgpStep {
  const WgTile& w;
  unsigned int bars, sKV;
  unsigned long long q_desc;
  int base, wg, warp_qpos0, g, t4, window;
  float soft_cap, scale_log2;
};

// Consumer step j: S_{j+1} (S) and P_j V_j (PV); K_{j+1} and V_j are the CTA's K and V fills
// uk = base + j + 1 - j0 and uv = base + j - j0 (stage u & 1, parity (u >> 1) & 1). Every step
// waits for the stages of K_{j+1} and V_j and releases them, used or not. The MMAs are issued and
// waited for within one step, outside any runtime branch (ptxas serialises wgmma it cannot pair
// with its wait).
template <bool S, bool PV, typename T, int HD>
__device__ __forceinline__ void wgp_step(const WgpStep& c, int j, float (&o)[HD / 2],
                                         float (&s)[kWgBN / 2], unsigned int (&pa)[kWgBN / 16][4],
                                         float (&m_run)[2], float (&l_run)[2], float (&corr)[2]) {
  constexpr unsigned int KV_BYTES = kWgBN * HD * 2;
  const WgTile& w = c.w;
  const int uk = c.base + j + 1 - w.j0, uv = c.base + j - w.j0;
  const bool has_k = j + 1 < w.n_tiles, has_v = j >= w.j0;
  if (has_k) {
    mbar_wait(c.bars + 8 * (uk & 1), (uk >> 1) & 1);  // K_{j+1} landed
    fence_proxy_async();
  }
  bar_sync(kWgpBarTurn + c.wg, 2 * 128);  // the other warpgroup has issued its step
  if constexpr (S) {
    fence_regs(s);
    wgmma_fence();
    wg_qk<T, HD>(s, c.q_desc, wg_desc(c.sKV + (uk & 1) * 2 * KV_BYTES, 16, 1024));
    wgmma_commit();
  }
  if (has_v) {
    mbar_wait(c.bars + 32 + 8 * (uv & 1), (uv >> 1) & 1);  // V_j landed
    fence_proxy_async();
  }
  if constexpr (PV) {
    // O to the maximum P_j was taken against (corr: the softmax of S_j, one step back).
#pragma unroll
    for (int h = 0; h < 2; ++h) wg_scale_o_row(o, h, corr[h]);
    fence_regs(o);
    wgmma_fence();
    wg_pv<T, HD>(o, pa, wg_desc(c.sKV + (uv & 1) * 2 * KV_BYTES + KV_BYTES, kWgBN * 128, 1024));
    wgmma_commit();
  }
  bar_arrive(kWgpBarTurn + (c.wg ^ 1), 2 * 128);  // the other warpgroup's turn
  if constexpr (S) {
    wgmma_wait<PV ? 1 : 0>();  // S_{j+1}, committed first, is complete; P_j V_j may run on
    fence_regs(s);
  }
  if (has_k) mbar_arrive(c.bars + 16 + 8 * (uk & 1));  // this thread is done with K_{j+1}
  if constexpr (S) {
    wg_mask_scores(s, j + 1, c.warp_qpos0, c.g, c.t4, c.window, c.soft_cap, c.scale_log2);
#pragma unroll
    for (int h = 0; h < 2; ++h) corr[h] = wg_softmax_row(s, h, m_run[h], l_run[h], c.scale_log2);
  }
  if constexpr (PV) {
    wgmma_wait<0>();  // P_j V_j complete: O is whole, pa and V_j are free
    fence_regs(o);
  }
  if (has_v) mbar_arrive(c.bars + 48 + 8 * (uv & 1));  // this thread is done with V_j
  if constexpr (S) wg_pack_p<T>(s, pa);
}

// Byte offset in the cache of key row r of key tile t, for the producer. A row past kv_end (the
// last tile's tail) reads row kv_end - 1 instead of zeros: every query row that is stored lies
// before kv_end, so the causal mask gives those keys P = 0, and a finite row times 0 adds 0.
template <int HD>
__device__ __forceinline__ long long wgp_row_bytes(const WgTile& w, int t, int r, int num_kv_heads,
                                                   int block_size_log2) {
  return wg_key_off<HD>(w, min(t * kWgBN + r, w.kv_end - 1), num_kv_heads, block_size_log2) * 2;
}

// One key tile (128 rows of hd128, 2-byte elements) from the cache into a 128-byte-swizzle tile
// at dst, by the 128 producer threads; `row` is the global address of key row ptid. Warp w copies
// rows 32w .. 32w + 31: in step i its 8-lane group q takes row 32w + 8q + i (its address by
// shuffle within the group), lane c of the group that row's chunks c ^ i and (c ^ i) + 8. As
// (32w + 8q + i) & 7 == i, chunk c ^ i lands in column c of the swizzle, so the destinations are
// one per-thread address plus constants; the 8 lanes read the row's 256 contiguous bytes.
__device__ __forceinline__ void wgp_gather(unsigned int dst, unsigned long long row, int ptid) {
  const int lane = ptid & 31, c = lane & 7;
  const unsigned int lo = (unsigned int)row, hi = (unsigned int)(row >> 32);
  const unsigned int d = dst + (unsigned int)(((ptid >> 5) * 32 + (lane >> 3) * 8) * 128 + c * 16);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const unsigned long long src =
        (((unsigned long long)__shfl_sync(0xffffffffu, hi, i, 8) << 32) |
         __shfl_sync(0xffffffffu, lo, i, 8)) +
        (unsigned int)((c ^ i) << 4);
    // the second half of the row (chunks 8..15): 128 bytes on in the cache, kWgBN * 128 in smem
    asm volatile(
        "cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n"
        "cp.async.cg.shared.global.L2::128B [%2], [%1+128], 16;\n" ::"r"(d + i * 128),
        "l"(src), "r"(d + i * 128 + kWgBN * 128)
        : "memory");
  }
}

// The CTA's work items: item it is entry it / num_heads of the tile list, head it % num_heads;
// CTA b takes items b, b + gridDim.x, ... below num_items, up to the first padding entry (all
// after it are padding too). Producer and consumers walk the same items in the same order.
struct WgpItem {
  int it, head;
  int2 tile;
};
__device__ __forceinline__ bool wgp_item(WgpItem& item, const int2* __restrict__ tiles,
                                         int num_heads, int num_items) {
  if (item.it >= num_items) return false;
  const int entry = item.it / num_heads;
  item.tile = tiles[entry];
  item.head = item.it - entry * num_heads;
  return item.tile.x >= 0;
}

// The producer warpgroup (ptid 0..127), per work item n of the CTA: its Q tile into Q buffer
// n & 1 (once item n - 2's epilogue, which stages its output there, released it), then step
// t = j0 .. n_tiles: K_t (t < n_tiles), then V_{t-1} (t > j0). Tile t is the CTA's K and V fill
// u = base + t - j0 of stage u & 1; a fill waits for the release of the stage's previous one
// (parity ((u >> 1) & 1) ^ 1; a fresh mbarrier passes parity 1 at once). Each thread reads the
// block table for its row of the next tile before it waits, so the read is off the copy path.
// Running ahead into the next item, it loads that item's Q and first keys while the consumers
// finish this one.
template <typename T, int HD>
__device__ __forceinline__ void wgp_produce(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ cu_seqlens_q,
    const int* __restrict__ seq_lens, const int2* __restrict__ tiles, long long q_stride_tok,
    int q_stride_head, int num_heads, int num_kv_heads, int block_size_log2,
    int max_blocks_per_seq, int window, int num_items, unsigned int sQ0, unsigned int sKV,
    unsigned int bars, int ptid) {
  static_assert(HD == 128, "wgp_gather copies 256-byte rows");
  constexpr unsigned int Q_BYTES = kPrefillBM * HD * 2, KV_BYTES = kWgBN * HD * 2;
  const unsigned long long kb = reinterpret_cast<unsigned long long>(k_cache);
  const unsigned long long vb = reinterpret_cast<unsigned long long>(v_cache);
  int base = 0, n = 0;
  WgpItem item{static_cast<int>(blockIdx.x), 0, {0, 0}};
  for (; wgp_item(item, tiles, num_heads, num_items); item.it += gridDim.x, ++n) {
    const WgTile w = wg_tile(item.tile, item.head, cu_seqlens_q, seq_lens, block_tables,
                             num_heads, num_kv_heads, block_size_log2, max_blocks_per_seq, window);
    long long off = wgp_row_bytes<HD>(w, w.j0, ptid, num_kv_heads, block_size_log2), off_prev = 0;
    mbar_wait(bars + 64 + 8 * (n & 1), ((n >> 1) & 1) ^ 1);  // empty Q: item n - 2 stored
    wg_load_q<T, HD, 128>(q, sQ0 + (n & 1) * Q_BYTES, w, item.head, q_stride_tok, q_stride_head,
                          ptid);
    cp_async_mbar_arrive(bars + 80 + 8 * (n & 1));  // full Q
    for (int t = w.j0; t <= w.n_tiles; ++t) {
      const long long off_next =
          t + 1 < w.n_tiles ? wgp_row_bytes<HD>(w, t + 1, ptid, num_kv_heads, block_size_log2)
                            : 0;
      if (t < w.n_tiles) {
        const int u = base + t - w.j0, b = u & 1;
        mbar_wait(bars + 16 + 8 * b, ((u >> 1) & 1) ^ 1);  // empty K: S_{t-2} done in both
        wgp_gather(sKV + b * 2 * KV_BYTES, kb + off, ptid);
        cp_async_mbar_arrive(bars + 8 * b);  // full K
      }
      if (t > w.j0) {
        const int u = base + t - 1 - w.j0, b = u & 1;
        mbar_wait(bars + 48 + 8 * b, ((u >> 1) & 1) ^ 1);  // empty V: P_{t-3} V_{t-3} done
        wgp_gather(sKV + b * 2 * KV_BYTES + KV_BYTES, vb + off_prev, ptid);
        cp_async_mbar_arrive(bars + 32 + 8 * b);  // full V
      }
      off_prev = off;
      off = off_next;
    }
    base += w.n_tiles - w.j0;
  }
  // wait_group covers only committed groups, and the gathers were never committed.
  cp_async_commit();
  cp_async_wait<0>();  // leaves only once its copies, and so their arrivals, are complete
}
#endif

// Persistent: gridDim.x CTAs (at most one per SM) walk the work items (wgp_item). Two Q buffers,
// so the producer loads the next item's Q while the consumers finish this one and stage its
// output in their own.
template <typename T, int HD>
__device__ __forceinline__ void prefill_wgp_impl(
    const T* __restrict__ q, T* __restrict__ out, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ seq_lens,
    const int2* __restrict__ tiles, long long q_stride_tok, int q_stride_head,
    long long o_stride_tok, int o_stride_head, int num_heads, int num_kv_heads, int block_size_log2,
    int max_blocks_per_seq, float scale_log2, int window, float soft_cap, int num_items) {
#if PS_HAS_WGMMA
  constexpr int BN = kWgBN, NC = kWgThreads;  // NC consumer threads
  // Launched with 168 registers a thread (384 threads, 1 CTA per SM); the producer gives back
  // 128 x (168 - 56), which is what the consumers take: 256 x (224 - 168).
  constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
  constexpr unsigned int Q_BYTES = kPrefillBM * HD * 2;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // Per stage b (bars + 8 b): full K, then at +16 empty K, +32 full V, +48 empty V; per Q
  // buffer b: empty Q at +64 + 8 b, full Q at +80 + 8 b.
  __shared__ __align__(8) unsigned long long s_bar[12];

  const unsigned int raw_addr = smem_addr(smem_raw);
  const unsigned int sQ0 = (raw_addr + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
  const unsigned int sKV = sQ0 + 2 * Q_BYTES;  // stage b: K, then V, at sKV + b * 2 * KV tile bytes
  const unsigned int bars = smem_addr(s_bar);
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      mbar_init(bars + 8 * b, 128);        // full K: one arrival per producer thread
      mbar_init(bars + 16 + 8 * b, NC);    // empty K: one per consumer thread
      mbar_init(bars + 32 + 8 * b, 128);   // full V
      mbar_init(bars + 48 + 8 * b, NC);    // empty V
      mbar_init(bars + 64 + 8 * b, NC);    // empty Q
      mbar_init(bars + 80 + 8 * b, 128);   // full Q
    }
  }
  __syncthreads();  // the mbarriers are initialised before anyone waits on or arrives at them
  if (tid >= NC) {
    setmaxnreg_dec<PRODUCER_REGS>();
    wgp_produce<T, HD>(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, tiles,
                       q_stride_tok, q_stride_head, num_heads, num_kv_heads, block_size_log2,
                       max_blocks_per_seq, window, num_items, sQ0, sKV, bars, tid - NC);
    return;
  }
  setmaxnreg_inc<CONSUMER_REGS>();

  // wg by shuffle from lane 0: the compiler then knows it is warp-uniform and keeps the wgmma
  // descriptors built from it in uniform registers (no per-MMA register-to-uniform moves).
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int wg_row0 = wg * 64;                       // first row of this warpgroup in the tile
  const int row0 = wg_row0 + warp * 16;              // first row of this warp
  int base = 0, n = 0;
  WgpItem item{static_cast<int>(blockIdx.x), 0, {0, 0}};
  for (; wgp_item(item, tiles, num_heads, num_items); item.it += gridDim.x, ++n) {
    const WgTile w = wg_tile(item.tile, item.head, cu_seqlens_q, seq_lens, block_tables,
                             num_heads, num_kv_heads, block_size_log2, max_blocks_per_seq, window);
    const int wg_qpos0 = w.ctx0 + w.m0 + wg_row0;
    const int warp_qpos0 = w.ctx0 + w.m0 + row0;
    const bool wg_has_rows = w.m0 + wg_row0 < w.q_len;
    const unsigned int sQ = sQ0 + (n & 1) * Q_BYTES;
    const unsigned long long q_desc = wg_desc(sQ + wg_row0 * 128, 16, 1024);
    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, corr[2] = {1.f, 1.f};
    float s[BN / 2];
    unsigned int pa[BN / 16][4];

    // This warpgroup's key tiles [jf, jl] (none without rows): those PS_WG_SEES_TILE admits (the
    // causal bound is monotone down in j, the window's up; jf starts at the CTA's window edge).
    const int jl = wg_has_rows ? min(w.n_tiles - 1, (wg_qpos0 + 63) / BN) : w.j0 - 1;
    int jf = w.j0;
    while (jf <= jl && !PS_WG_SEES_TILE(jf, wg_has_rows, wg_qpos0, window)) ++jf;

    mbar_wait(bars + 80 + 8 * (n & 1), (n >> 1) & 1);  // the Q tile landed
    fence_proxy_async();  // ... and is visible to the tensor cores
    if (wg == 0) bar_arrive(kWgpBarTurn, 2 * 128);  // warpgroup 0 issues first
    const WgpStep c{w, bars, sKV, q_desc, base, wg, warp_qpos0, g, t4, window, soft_cap,
                    scale_log2};
    int j = w.j0 - 1;
    for (; j < jf - 1; ++j) wgp_step<false, false, T, HD>(c, j, o, s, pa, m_run, l_run, corr);
    if (jf <= jl) {
      wgp_step<true, false, T, HD>(c, j++, o, s, pa, m_run, l_run, corr);  // S_jf
      for (; j < jl; ++j) wgp_step<true, true, T, HD>(c, j, o, s, pa, m_run, l_run, corr);
      wgp_step<false, true, T, HD>(c, j++, o, s, pa, m_run, l_run, corr);  // P_jl V_jl
    }
    for (; j < w.n_tiles; ++j) wgp_step<false, false, T, HD>(c, j, o, s, pa, m_run, l_run, corr);
    if (wg == 0) bar_sync(kWgpBarTurn, 2 * 128);  // takes warpgroup 1's last hand-over
    wg_store_out<T, HD>(o, l_run, 1.f, smem_raw + (sQ - raw_addr), w, item.head, out,
                        o_stride_tok, o_stride_head, tid);
    mbar_arrive(bars + 64 + 8 * (n & 1));  // this thread has read its staged output: empty Q
    base += w.n_tiles - w.j0;
  }
#else
  __trap();  // built without sm_90a: the launcher never picks this kernel then
#endif
}

// ---------------------------------------------------------------------------------------------
// MQ (few query tokens per sequence, e.g. a cached prefix's new tokens): blockIdx.z is an entry
// of a tile list of `tpc` = 64 / group tokens (prefill_tiles_impl with bm = tpc); its query rows
// are (token r / group, head r % group), 16 of them per warp (the MMA's rows), and every warp
// walks all keys of a stage for its own rows, so the tile's tokens share one read of the context
// and no merge across warps is needed; each row is masked at its own token's position (causal).
// Partials and outputs are indexed by token as the one-token kernel indexes them by sequence:
// the combine is the same. Without MQ the code is the one-token kernel's, unchanged (its warps
// split each stage's keys and merge at the end). KS (a candidate, decode_mqks_*): an entry of at
// most 16 rows (a one-token seq, a chunk's last few tokens) is served as the one-token kernel
// serves a seq, its warps splitting the keys, rather than by one warp with three idle.
// F8 (C = kv_fp8): the stages hold bytes; each stage is converted into one K/V tile of T, a
// warp's own 16 keys when the warps split the keys (no barrier), else all of them. The one-token
// kernel (!MQ) converts a warp's K into its rows of a K-sized tile and, once its scores are
// computed, V into the same rows: the smaller footprint lets more CTAs onto an SM.
template <typename T, int HD, int STAGES, bool MQ = false, bool KS = false, typename C = T>
__device__ __forceinline__ void decode_impl(
    const T* __restrict__ q, T* __restrict__ out, float* __restrict__ part_o,
    float* __restrict__ part_lse, const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, long long q_stride_tok,
    int q_stride_head, long long o_stride_tok, int o_stride_head, int num_heads, int num_kv_heads,
    int block_size_log2, int max_blocks_per_seq, int chunk_pages, int num_splits,
    float scale_log2, int window, float soft_cap, const int* __restrict__ cu_seqlens_q = nullptr,
    const int2* __restrict__ tiles = nullptr, int tpc = 1,
    const float* __restrict__ k_scale = nullptr, const float* __restrict__ v_scale = nullptr) {
  constexpr bool F8 = sizeof(C) == 1;
  constexpr bool REUSE = F8 && !MQ;  // one converted tile, K then V (the one-token kernel)
  constexpr int BN = kDecodeBN;
  constexpr int CH = HD / 8;
  constexpr int ROW_STEP = kThreads / CH;
  constexpr int KV_ROWS = BN / ROW_STEP;
  constexpr int DT = HD / 8;
  constexpr int STAGE_ELEMS = 2 * BN * HD;  // K then V
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* stages = reinterpret_cast<T*>(smem_raw);
  kv_fp8* stages8 = reinterpret_cast<kv_fp8*>(smem_raw);  // F8: the stages, row-major bytes
  T* conv = reinterpret_cast<T*>(smem_raw + (size_t)STAGES * STAGE_ELEMS * sizeof(C));  // F8
  int* s_pages = reinterpret_cast<int*>(smem_raw + (size_t)STAGES * STAGE_ELEMS * sizeof(C) +
                                        (F8 ? (size_t)(REUSE ? BN * HD : STAGE_ELEMS) * sizeof(T)
                                            : 0));
  float v_mul = 1.f;
  if constexpr (F8) {
    scale_log2 *= *k_scale;
    v_mul = *v_scale;
  }

  const int split = blockIdx.x, kv_head = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int group = num_heads / num_kv_heads;
  const int head0 = kv_head * group;
  int seq = blockIdx.z;
  int seq_len, tok0 = 0, rows = group, first_lim = 0;
  if constexpr (MQ) {
    const int2 tile = tiles[blockIdx.z];
    if (tile.x < 0) return;  // past the list's end
    seq = tile.x;
    const int q_len = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq];
    tok0 = cu_seqlens_q[seq] + tile.y * tpc;
    const int count = min(tpc, q_len - tile.y * tpc);
    rows = count * group;
    first_lim = seq_lens[seq] - q_len + tile.y * tpc + 1;  // keys the tile's first token sees
    seq_len = first_lim + count - 1;                        // and its last
  } else {
    seq_len = seq_lens[seq];
  }
  const bool ks = !MQ || (KS && rows <= 16);  // warps split the keys (one 16-row MMA tile)
  const int row0 = ks ? 0 : warp * 16;       // this warp's first query row
  // With a window, keys before the first token's window are never read: the splits start at the
  // page of its first key (the launcher sizes them for the window's pages).
  const int lo = window > 0 ? max(0, (MQ ? first_lim : seq_len) - window) : 0;
  const int begin = ((lo >> block_size_log2) + split * chunk_pages) << block_size_log2;
  const int end = min(seq_len, begin + (chunk_pages << block_size_log2));
  const long long row_base = (long long)seq * num_heads + head0;  // partial index of (seq, head0)
  // Row r's partial index and output offset: (seq, head0 + r), or MQ's (token, head).
  auto prow = [&](int r) -> long long {
    if constexpr (MQ) return (long long)(tok0 + r / group) * num_heads + head0 + r % group;
    else return row_base + r;
  };
  auto orow = [&](int r) -> long long {
    if constexpr (MQ)
      return (long long)(tok0 + r / group) * o_stride_tok + (long long)(head0 + r % group) * o_stride_head;
    else return (long long)seq * o_stride_tok + (long long)(head0 + r) * o_stride_head;
  };

  if (begin >= end) {  // nothing to attend to in this split
    if (num_splits > 1) {
      for (int h = tid; h < rows; h += kThreads) part_lse[prow(h) * num_splits + split] = -INFINITY;
    } else {
      for (int i = tid; i < rows * HD; i += kThreads) out[orow(i / HD) + i % HD] = T(0.f);
    }
    return;
  }
  const int page0 = begin >> block_size_log2;
  const int n_pages = ((end - begin) + (1 << block_size_log2) - 1) >> block_size_log2;
  const int* bt = block_tables + (long long)seq * max_blocks_per_seq + page0;
  for (int i = tid; i < n_pages; i += kThreads) s_pages[i] = bt[i];

  __syncthreads();  // s_pages visible

  const int bs_mask = (1 << block_size_log2) - 1;
  const long long head_off = (long long)kv_head << block_size_log2;
  const int ld_ch = tid % CH, ld_row = tid / CH;
  const int n_stages = (end - begin + BN - 1) / BN;
  const unsigned int stage_base = smem_addr(stages);
  const unsigned int k_off = ldm_off<HD>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  const unsigned int v_off = ldm_off<HD>((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
  auto issue = [&](int st) {
    T* sK = stages + (st % STAGES) * STAGE_ELEMS;
    T* sV = sK + BN * HD;
#pragma unroll
    for (int i = 0; i < KV_ROWS; ++i) {
      const int r = ld_row + i * ROW_STEP;
      const int kpos = begin + st * BN + r;
      const bool ok = kpos < end;
      long long off = 0;
      if (ok) {
        const int pg = s_pages[(kpos >> block_size_log2) - page0];
        off = (((long long)pg * num_kv_heads << block_size_log2) + head_off + (kpos & bs_mask)) * HD +
              ld_ch * 8;
      }
      const unsigned int d = swz<HD>(r, ld_ch);
      cp_async16(smem_addr(sK + d), k_cache + off, ok ? 16 : 0);
      cp_async16(smem_addr(sV + d), v_cache + off, ok ? 16 : 0);
    }
  };
  // F8: 16 elements a 16-byte chunk, rows of HD bytes.
  auto issue8 = [&](int st) {
    constexpr int CH8 = HD / 16, ROW_STEP8 = kThreads / CH8;
    kv_fp8* sK = stages8 + (st % STAGES) * STAGE_ELEMS;
    kv_fp8* sV = sK + BN * HD;
    const int c8 = tid % CH8;
#pragma unroll
    for (int i = 0; i < BN / ROW_STEP8; ++i) {
      const int r = tid / CH8 + i * ROW_STEP8;
      const int kpos = begin + st * BN + r;
      const bool ok = kpos < end;
      long long off = 0;
      if (ok) {
        const int pg = s_pages[(kpos >> block_size_log2) - page0];
        off = (((long long)pg * num_kv_heads << block_size_log2) + head_off + (kpos & bs_mask)) * HD +
              c8 * 16;
      }
      cp_async16(smem_addr(sK + r * HD + c8 * 16), k_cache + off, ok ? 16 : 0);
      cp_async16(smem_addr(sV + r * HD + c8 * 16), v_cache + off, ok ? 16 : 0);
    }
  };

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if constexpr (F8) {
      if (st < n_stages) issue8(st);
    } else {
      if (st < n_stages) issue(st);
    }
    cp_async_commit();
  }

  // Q of the group as the A operand: row r = head0 + r for r < group (rows past it are zero);
  // MQ: this warp's row r (warp * 16 + MMA row) = token tok0 + r / group, head head0 + r % group,
  // for r < rows.
  // Loaded after the first stages are issued, so its latency hides behind theirs.
  unsigned int qa[HD / 16][4];
  {
    const T* qs = q + (long long)seq * q_stride_tok;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = row0 + g + (e & 1) * 8, col = kk * 16 + (e >> 1) * 8 + 2 * t4;
        if constexpr (MQ) {
          qa[kk][e] = r < rows ? *reinterpret_cast<const unsigned int*>(
                                     q + (long long)(tok0 + r / group) * q_stride_tok +
                                     (long long)(head0 + r % group) * q_stride_head + col)
                               : 0u;
        } else {
          qa[kk][e] = r < group ? *reinterpret_cast<const unsigned int*>(
                                      qs + (long long)(head0 + r) * q_stride_head + col)
                                : 0u;
        }
      }
    }
  }
  // MQ: the keys [from, lim) each of this thread's two rows (g, g + 8) sees; one-token: [lo, end).
  int lim[2] = {end, end}, from[2] = {lo, lo};
  if constexpr (MQ) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + g + h * 8;
      if (r < rows) {
        lim[h] = min(end, first_lim + r / group);
        if (window > 0) from[h] = first_lim + r / group - window;
      }
    }
  }
  const int lim_min = min(lim[0], lim[1]), from_max = max(from[0], from[1]);

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (int st = 0; st < n_stages; ++st) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage st landed; every warp is done with the buffer refilled next
    if constexpr (F8) {
      if (st + STAGES - 1 < n_stages) issue8(st + STAGES - 1);
      cp_async_commit();
      const kv_fp8* sk8 = stages8 + (st % STAGES) * STAGE_ELEMS;
      if (REUSE) {  // this warp's own 16 keys of K; V after its scores (below)
        fp8_rows_to_tile<T, HD, 16, 32>(sk8, conv, warp * 16, lane);
        __syncwarp();
      } else if (ks) {  // this warp reads only its own 16 keys
        fp8_rows_to_tile<T, HD, 16, 32>(sk8, conv, warp * 16, lane);
        fp8_rows_to_tile<T, HD, 16, 32>(sk8 + BN * HD, conv + BN * HD, warp * 16, lane);
        __syncwarp();
      } else {
        fp8_rows_to_tile<T, HD, BN, kThreads>(sk8, conv, 0, tid);
        fp8_rows_to_tile<T, HD, BN, kThreads>(sk8 + BN * HD, conv + BN * HD, 0, tid);
        __syncthreads();
      }
    } else {
      if (st + STAGES - 1 < n_stages) issue(st + STAGES - 1);
      cp_async_commit();
    }

    // One-token: this warp's 16 keys of the stage. MQ: all four 16-key blocks, for its own rows
    // (a warp with none left idles).
    const int kb_first = ks ? warp : 0, kb_last = ks ? warp + 1 : (row0 < rows ? BN / 16 : 0);
    for (int kb = kb_first; kb < kb_last; ++kb) {
    const int kbase = begin + st * BN + kb * 16;
    if (kbase >= end) break;
    unsigned int k_base;
    if constexpr (F8) k_base = smem_addr(conv) + kb * 16 * HD * 2;
    else k_base = stage_base + (st % STAGES) * STAGE_ELEMS * 2 + kb * 16 * HD * 2;
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      unsigned int kb[4];
      ldmatrix_x4(kb, k_base + (k_off ^ (kk << 5)));
      mma16816<T>(s[0], qa[kk], kb[0], kb[1]);
      mma16816<T>(s[1], qa[kk], kb[2], kb[3]);
    }
    if (soft_cap > 0.f) {
      soft_cap_scores(s[0], soft_cap, scale_log2);
      soft_cap_scores(s[1], soft_cap, scale_log2);
    }
    if constexpr (MQ) {
      if (kbase + 16 > lim_min || kbase < from_max) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int k = kbase + nt * 8 + 2 * t4 + (e & 1);
            if (k >= lim[e >> 1] || k < from[e >> 1]) s[nt][e] = -INFINITY;
          }
      }
    } else if (kbase + 16 > end || kbase < lo) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int k = kbase + nt * 8 + 2 * t4 + (e & 1);
          if (k >= end || k < lo) s[nt][e] = -INFINITY;
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[h], mx * scale_log2);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float corr = exp2_approx(m_run[h] - m_use);
      m_run[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2_approx(fmaf(s[nt][2 * h + e], scale_log2, -m_use));
          s[nt][2 * h + e] = p;
          sum += p;
        }
      l_run[h] = l_run[h] * corr + sum;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[dt][2 * h] *= corr;
        o[dt][2 * h + 1] *= corr;
      }
    }
    unsigned int v_base = k_base + BN * HD * 2;
    if constexpr (REUSE) {  // V's 16 keys over K's, once every lane has read K
      __syncwarp();
      fp8_rows_to_tile<T, HD, 16, 32>(stages8 + (st % STAGES) * STAGE_ELEMS + BN * HD, conv,
                                      warp * 16, lane);
      __syncwarp();
      v_base = k_base;
    }
    unsigned int pa[4];
    pa[0] = Pack<T>::two(s[0][0], s[0][1]);
    pa[1] = Pack<T>::two(s[0][2], s[0][3]);
    pa[2] = Pack<T>::two(s[1][0], s[1][1]);
    pa[3] = Pack<T>::two(s[1][2], s[1][3]);
#pragma unroll
    for (int dp = 0; dp < HD / 16; ++dp) {
      unsigned int vb[4];
      ldmatrix_x4_trans(vb, v_base + (v_off ^ (dp << 5)));
      mma16816<T>(o[2 * dp], pa, vb[0], vb[1]);
      mma16816<T>(o[2 * dp + 1], pa, vb[2], vb[3]);
    }
    }  // kb
  }
  cp_async_wait<0>();
  if (!ks) {  // MQ: each warp's rows are whole: normalise and store them
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = row0 + g + h * 8;
      if (row >= rows) continue;
      float inv = l > 0.f ? 1.f / l : 0.f;
      if constexpr (F8) inv *= v_mul;
      if (num_splits == 1) {
        T* dst = out + orow(row);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
          *reinterpret_cast<unsigned int*>(dst + dt * 8 + 2 * t4) =
              Pack<T>::two(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
      } else {
        const long long pidx = prow(row) * num_splits + split;
        float* dst = part_o + pidx * HD;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
          *reinterpret_cast<float2*>(dst + dt * 8 + 2 * t4) =
              make_float2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
        if (t4 == 0) part_lse[pidx] = l > 0.f ? m_run[h] + __log2f(l) : -INFINITY;
      }
    }
    return;
  }
  __syncthreads();  // pipeline buffers are free: reuse them to merge the 4 warps

  float* sm_o = reinterpret_cast<float*>(smem_raw);  // [4][16][HD]
  float* sm_m = sm_o + 4 * 16 * HD;                  // [4][16]
  float* sm_l = sm_m + 4 * 16;                       // [4][16]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = g + h * 8;
    if (t4 == 0) {
      sm_m[warp * 16 + row] = m_run[h];
      sm_l[warp * 16 + row] = l;
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<float2*>(sm_o + (warp * 16 + row) * HD + dt * 8 + 2 * t4) =
          make_float2(o[dt][2 * h], o[dt][2 * h + 1]);
  }
  __syncthreads();
  for (int i = tid; i < rows * HD; i += kThreads) {
    const int row = i / HD, d = i % HD;
    float mw[4], mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      mw[w] = sm_m[w * 16 + row];
      mx = fmaxf(mx, mw[w]);
    }
    float l = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float wt = mw[w] == -INFINITY ? 0.f : exp2_approx(mw[w] - mx);
      l += wt * sm_l[w * 16 + row];
      acc += wt * sm_o[(w * 16 + row) * HD + d];
    }
    float val = l > 0.f ? acc / l : 0.f;
    if constexpr (F8) val *= v_mul;
    if (num_splits == 1) {
      out[orow(row) + d] = T(val);
    } else {
      const long long pidx = prow(row) * num_splits + split;
      part_o[pidx * HD + d] = val;
      if (d == 0) part_lse[pidx] = l > 0.f ? mx + __log2f(l) : -INFINITY;
    }
  }
}

// Merge the splits of one (seq, head): weights 2^(lse_s - max lse); empty splits carry -inf.
template <typename T>
__device__ __forceinline__ void decode_combine_impl(const float* __restrict__ part_o,
                                                    const float* __restrict__ part_lse,
                                                    T* __restrict__ out, long long o_stride_tok,
                                                    int o_stride_head, int num_heads,
                                                    int num_splits, int head_dim) {
  const int seq = blockIdx.x, head = blockIdx.y;
  const long long base = ((long long)seq * num_heads + head) * num_splits;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, part_lse[base + s]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f, wsum = 0.f;
    if (mx != -INFINITY) {
      for (int s = 0; s < num_splits; ++s) {
        const float lse = part_lse[base + s];
        if (lse == -INFINITY) continue;
        const float w = exp2_approx(lse - mx);
        acc += w * part_o[(base + s) * head_dim + d];
        wsum += w;
      }
    }
    out[(long long)seq * o_stride_tok + (long long)head * o_stride_head + d] =
        T(wsum > 0.f ? acc / wsum : 0.f);
  }
}

}  // namespace ps

// ---------------------------------------------------------------------------------------------
// Entry points (extern "C": plain names for cupy.RawModule.get_function); kv_fp8.cu defines
// PS_KV_FP8 and its own (the kernels over an FP8 cache).
#ifndef PS_KV_FP8
extern "C" __global__ void __launch_bounds__(1024)
    prefill_tiles(const int* cu_seqlens_q, int num_seqs, int2* tiles, int num_entries) {
  ps::prefill_tiles_impl(cu_seqlens_q, num_seqs, tiles, num_entries, ps::kPrefillBM);
}

// The same list in tiles of `tile` tokens (the multi-query decode kernel's).
extern "C" __global__ void __launch_bounds__(1024)
    query_tiles(const int* cu_seqlens_q, int num_seqs, int2* tiles, int num_entries, int tile) {
  ps::prefill_tiles_impl(cu_seqlens_q, num_seqs, tiles, num_entries, tile);
}

// Both prefill kernel families take the same arguments; IMPL and THREADS name the family.
#define PS_PREFILL_ENTRY(NAME, IMPL, THREADS, T, HD, MIN_CTAS)                                    \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)                                 \
      NAME(const T* q, T* out, const T* k_cache, const T* v_cache, const int* block_tables,       \
           const int* cu_seqlens_q, const int* seq_lens, const int2* tiles,                       \
           long long q_stride_tok, int q_stride_head, long long o_stride_tok, int o_stride_head,  \
           int num_heads, int num_kv_heads, int block_size_log2, int max_blocks_per_seq,          \
           float scale_log2, int window, float soft_cap) {                                        \
    ps::IMPL<T, HD>(q, out, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, tiles,        \
                    q_stride_tok, q_stride_head, o_stride_tok, o_stride_head, num_heads,          \
                    num_kv_heads, block_size_log2, max_blocks_per_seq, scale_log2, window,        \
                    soft_cap);                                                                    \
  }
#define PS_PREFILL(NAME, T, HD, MIN_CTAS) \
  PS_PREFILL_ENTRY(NAME, prefill_impl, ps::kThreads, T, HD, MIN_CTAS)
// hd64 runs 3 CTAs per SM (168 registers, a few spills: more resident warps hide the barriers
// better than the spills cost); hd128 needs 2 (its O accumulator alone is 128 registers). NOTES.md.
PS_PREFILL(prefill_bf16_hd64, __nv_bfloat16, 64, 3)
PS_PREFILL(prefill_bf16_hd128, __nv_bfloat16, 128, 2)
PS_PREFILL(prefill_fp16_hd64, __half, 64, 3)
PS_PREFILL(prefill_fp16_hd128, __half, 128, 2)

#define PS_PREFILL_WG(NAME, T, HD, MIN_CTAS) \
  PS_PREFILL_ENTRY(NAME, prefill_wg_impl, ps::kWgThreads, T, HD, MIN_CTAS)
// hd64: 2 CTAs per SM (128 registers, 28 B of spills, 82 KB smem each): a second CTA keeps the
// tensor cores busy through softmax; hd128 fits 1 (209 registers, 163 KB smem). NOTES.md.
PS_PREFILL_WG(prefill_wg_bf16_hd64, __nv_bfloat16, 64, 2)
PS_PREFILL_WG(prefill_wg_bf16_hd128, __nv_bfloat16, 128, 1)
PS_PREFILL_WG(prefill_wg_fp16_hd64, __half, 64, 2)
PS_PREFILL_WG(prefill_wg_fp16_hd128, __half, 128, 1)
#ifdef PS_VARIANTS
PS_PREFILL_WG(prefill_wg1_bf16_hd64, __nv_bfloat16, 64, 1)  // benchmark comparison only
#endif
// The pipelined kernel (FlashAttention-3's schedule), hd128: 3 warpgroups, 1 CTA per SM.
// Persistent: the prefill arguments, then the number of (tile, head) items of the list.
#define PS_PREFILL_WGP(NAME, T, HD)                                                              \
  extern "C" __global__ void __launch_bounds__(ps::kWgpThreads, 1)                              \
      NAME(const T* q, T* out, const T* k_cache, const T* v_cache, const int* block_tables,     \
           const int* cu_seqlens_q, const int* seq_lens, const int2* tiles,                     \
           long long q_stride_tok, int q_stride_head, long long o_stride_tok, int o_stride_head, \
           int num_heads, int num_kv_heads, int block_size_log2, int max_blocks_per_seq,        \
           float scale_log2, int window, float soft_cap, int num_items) {                       \
    ps::prefill_wgp_impl<T, HD>(q, out, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, \
                                tiles, q_stride_tok, q_stride_head, o_stride_tok, o_stride_head, \
                                num_heads, num_kv_heads, block_size_log2, max_blocks_per_seq,   \
                                scale_log2, window, soft_cap, num_items);                       \
  }
PS_PREFILL_WGP(prefill_wgp_bf16_hd128, __nv_bfloat16, 128)
PS_PREFILL_WGP(prefill_wgp_fp16_hd128, __half, 128)

// Decode attention and its combine come before the output projection: they let a W4A16 product
// launched programmatically start as soon as they all run (ps::launch_dependents).
#define PS_DECODE(NAME, T, HD, STAGES, MIN_CTAS)                                                 \
  extern "C" __global__ void __launch_bounds__(ps::kThreads, MIN_CTAS)                           \
      NAME(const T* q, T* out, float* part_o, float* part_lse, const T* k_cache,                 \
           const T* v_cache, const int* block_tables, const int* seq_lens,                       \
           long long q_stride_tok, int q_stride_head, long long o_stride_tok, int o_stride_head, \
           int num_heads, int num_kv_heads, int block_size_log2, int max_blocks_per_seq,         \
           int chunk_pages, int num_splits, float scale_log2, int window, float soft_cap) {      \
    ps::launch_dependents();                                                                     \
    ps::decode_impl<T, HD, STAGES>(q, out, part_o, part_lse, k_cache, v_cache, block_tables,     \
                                   seq_lens, q_stride_tok, q_stride_head, o_stride_tok,          \
                                   o_stride_head, num_heads, num_kv_heads, block_size_log2,      \
                                   max_blocks_per_seq, chunk_pages, num_splits, scale_log2,      \
                                   window, soft_cap);                                            \
  }
// hd128: 3 stages of 32 KB, 2 CTAs/SM; hd64: 4 stages of 16 KB. The _s2 kernel (2 stages, 3 CTAs
// per SM) is a candidate the benchmark times beside the default (NOTES.md).
PS_DECODE(decode_bf16_hd64, __nv_bfloat16, 64, 4, 1)
PS_DECODE(decode_bf16_hd128, __nv_bfloat16, 128, 3, 2)
PS_DECODE(decode_fp16_hd64, __half, 64, 4, 1)
PS_DECODE(decode_fp16_hd128, __half, 128, 3, 2)
#ifdef PS_VARIANTS
PS_DECODE(decode_s2_bf16_hd128, __nv_bfloat16, 128, 2, 3)
#endif

#define PS_DECODE_MQ(NAME, T, HD, STAGES, MIN_CTAS, KS)                                          \
  extern "C" __global__ void __launch_bounds__(ps::kThreads, MIN_CTAS)                           \
      NAME(const T* q, T* out, float* part_o, float* part_lse, const T* k_cache,                 \
           const T* v_cache, const int* block_tables, const int* cu_seqlens_q,                   \
           const int* seq_lens, const int2* tiles, int tpc, long long q_stride_tok,              \
           int q_stride_head, long long o_stride_tok, int o_stride_head, int num_heads,          \
           int num_kv_heads, int block_size_log2, int max_blocks_per_seq, int chunk_pages,       \
           int num_splits, float scale_log2, int window, float soft_cap) {                       \
    ps::launch_dependents();                                                                     \
    ps::decode_impl<T, HD, STAGES, true, KS>(q, out, part_o, part_lse, k_cache, v_cache,         \
                                             block_tables, seq_lens, q_stride_tok,               \
                                             q_stride_head, o_stride_tok, o_stride_head,         \
                                             num_heads, num_kv_heads, block_size_log2,           \
                                             max_blocks_per_seq, chunk_pages, num_splits,        \
                                             scale_log2, window, soft_cap, cu_seqlens_q, tiles,  \
                                             tpc);                                               \
  }
// Few query tokens per sequence over its context (paged_few_query_attention); the _mqks_
// candidates split the keys of entries of at most 16 rows (the launcher's key_split, off: timed
// once, pagedserve_kernels/NOTES.md).
PS_DECODE_MQ(decode_mq_bf16_hd64, __nv_bfloat16, 64, 4, 1, false)
PS_DECODE_MQ(decode_mq_bf16_hd128, __nv_bfloat16, 128, 3, 2, false)
PS_DECODE_MQ(decode_mq_fp16_hd64, __half, 64, 4, 1, false)
PS_DECODE_MQ(decode_mq_fp16_hd128, __half, 128, 3, 2, false)
#ifdef PS_VARIANTS
PS_DECODE_MQ(decode_mqks_bf16_hd64, __nv_bfloat16, 64, 4, 1, true)
PS_DECODE_MQ(decode_mqks_bf16_hd128, __nv_bfloat16, 128, 3, 2, true)
PS_DECODE_MQ(decode_mqks_fp16_hd64, __half, 64, 4, 1, true)
PS_DECODE_MQ(decode_mqks_fp16_hd128, __half, 128, 3, 2, true)
#endif

#define PS_COMBINE(NAME, T)                                                                      \
  extern "C" __global__ void NAME(const float* part_o, const float* part_lse, T* out,            \
                                  long long o_stride_tok, int o_stride_head, int num_heads,      \
                                  int num_splits, int head_dim) {                                \
    ps::launch_dependents();                                                                     \
    ps::decode_combine_impl<T>(part_o, part_lse, out, o_stride_tok, o_stride_head, num_heads,    \
                               num_splits, head_dim);                                            \
  }
PS_COMBINE(decode_combine_bf16, __nv_bfloat16)
PS_COMBINE(decode_combine_fp16, __half)

#endif  // PS_KV_FP8
