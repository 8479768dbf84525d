// W4A16 products: y[M, N] = x[M, K] . W[K, N] with W = (q - zero) * scale per group of input rows,
// q 4-bit. Weights come repacked by pagedserve_kernels/quant.py (`repack`) so that one 16-byte load
// gives a lane the B fragments of mma.m16n8k16 for a 32-row chunk of four n8 tiles; nibbles turn
// into bf16/fp16 in registers by the magic-number trick (or-ing a nibble into the mantissa of 128
// or 1024), so (q - zero) is exact and one multiply rounds W as dequantize-then-cast does.
#include "common.cuh"

namespace ps_quant {

constexpr int THREADS = 256;  // 8 warps: 4 along N (32 columns each) x 2 along K
constexpr int CTA_N = 128;
constexpr int STAGE_K = 64;   // one k32 chunk per K warp

#ifdef PS_QUANT_TRACE
// Diagnostics only (module "quant_trace", benchmarks/trace_quant.py): for each CTA and run of K
// stages of the wgt and wgs kernels and of the mma.sync tiles, (consumer) thread 0 records the
// SM, the stages, how the output left (TRACE_*), clock64 and globaltimer at the run's start,
// clock64 when its MMAs retired, clock64 and globaltimer when its output was out and, in the
// mma.sync tiles, the cycles it spent at the stage barriers (waiting for copies and warps).
constexpr int TRACE_RUNS = 8, TRACE_FIELDS = 7;
enum { TRACE_STORED = 1, TRACE_PART = 2, TRACE_HEAD_SUM = 3, TRACE_LAST_SUM = 4 };
// C linkage: trace_quant.py finds it by this name (get_global), not a namespace-mangled one.
extern "C" {
__device__ unsigned long long ps_quant_trace[4096 * TRACE_RUNS * TRACE_FIELDS];
}
__device__ __forceinline__ unsigned long long trace_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
struct TraceRun {
  unsigned long long* slot;
  unsigned long long start, start_ns, mma, waited, wait_from;
  __device__ __forceinline__ TraceRun(int cta, int run) {
    slot = run < TRACE_RUNS && cta < 4096 && threadIdx.x == 0
               ? ps_quant_trace + ((size_t)cta * TRACE_RUNS + run) * TRACE_FIELDS
               : nullptr;
    start_ns = trace_globaltimer();
    start = clock64();
    mma = waited = 0;
  }
  __device__ __forceinline__ void retired() { mma = clock64(); }
  __device__ __forceinline__ void wait_begin() { wait_from = clock64(); }
  __device__ __forceinline__ void wait_end() { waited += clock64() - wait_from; }
  __device__ __forceinline__ void out(int stages, int how) const {
    if (slot == nullptr) return;
    const unsigned long long end = clock64(), end_ns = trace_globaltimer();
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    slot[0] = sm | (unsigned long long)stages << 16 | (unsigned long long)how << 48;
    slot[1] = start;
    slot[2] = mma;
    slot[3] = end;
    slot[4] = start_ns;
    slot[5] = end_ns;
    slot[6] = waited;
  }
};
#define PS_TRACE_RUN(cta, run) TraceRun trace_run(cta, run)
#define PS_TRACE_RETIRED() trace_run.retired()
#define PS_TRACE_OUT(stages, how) trace_run.out(stages, how)
#define PS_TRACE_WAIT_BEGIN() trace_run.wait_begin()
#define PS_TRACE_WAIT_END() trace_run.wait_end()
#else
#define PS_TRACE_RUN(cta, run)
#define PS_TRACE_RETIRED()
#define PS_TRACE_OUT(stages, how)
#define PS_TRACE_WAIT_BEGIN()
#define PS_TRACE_WAIT_END()
#endif

// (q & mask) | base in one instruction, where the compiler emits an AND and an OR: it runs for
// every pair of weights, and at small row counts the loop is mostly such instructions.
template <unsigned int BASE>
__device__ __forceinline__ unsigned int nibbles_into(unsigned int q) {
  unsigned int r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(q), "n"(0x000f000fu), "n"(BASE));
  return r;
}

// Packed weight tile (n32 block b, k32 chunk c): 32 lanes x uint4, at ((b * KC + c) * 32 + lane).
// Word j of lane (g = lane / 4, t = lane % 4) holds column 32b + 8j + g; its nibble p (bits 4p..)
// holds pair i = p % 4, element p / 4 of that pair, pair i being rows 32c + 16(i / 2) + 8(i % 2)
// + 2t + {0, 1}: the B fragment registers (b0, b1) of the chunk's two k16 steps, in order.
template <typename T> struct Int4;
template <> struct Int4<__nv_bfloat16> {
  static constexpr unsigned int BASE = 0x43004300u;       // 128.0 twice: 128 + n is exact
  static constexpr unsigned int SYM_ZERO = 0x43084308u;   // 136.0 = 128 + 8
  static __device__ __forceinline__ unsigned int pair(unsigned int q, unsigned int z2,
                                                      unsigned int s2) {
    unsigned int v = nibbles_into<BASE>(q);
    __nv_bfloat162 d = __hmul2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&v),
                                       *reinterpret_cast<__nv_bfloat162*>(&z2)),
                               *reinterpret_cast<__nv_bfloat162*>(&s2));
    return *reinterpret_cast<unsigned int*>(&d);
  }
};
template <> struct Int4<__half> {
  static constexpr unsigned int BASE = 0x64006400u;       // 1024.0 twice: 1024 + n is exact
  static constexpr unsigned int SYM_ZERO = 0x64086408u;   // 1032.0 = 1024 + 8
  static __device__ __forceinline__ unsigned int pair(unsigned int q, unsigned int z2,
                                                      unsigned int s2) {
    unsigned int v = nibbles_into<BASE>(q);
    __half2 d = __hmul2(__hsub2(*reinterpret_cast<__half2*>(&v), *reinterpret_cast<__half2*>(&z2)),
                        *reinterpret_cast<__half2*>(&s2));
    return *reinterpret_cast<unsigned int*>(&d);
  }
};

__device__ __forceinline__ unsigned int dup_lo(unsigned int u) { return __byte_perm(u, 0, 0x1010); }
__device__ __forceinline__ unsigned int dup_hi(unsigned int u) { return __byte_perm(u, 0, 0x3232); }

// Two floats another thread block wrote, read from L2 (never a stale L1 line).
__device__ __forceinline__ float2 ld_l2(const float* p) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}

// A pipeline stage in shared memory, both kernel families: [weights][x][scales][zeros].
template <int ROWS_>
struct Stage {
  static constexpr int ROWS = ROWS_;
  static constexpr int W_BYTES = THREADS * 16;         // one uint4 per thread
  static constexpr int X_BYTES = ROWS * STAGE_K * 2;   // [ROWS][64] swizzled 16-byte chunks
  static constexpr int S_BYTES = 2 * CTA_N * 2;        // scales of the stage's two k32 chunks
  static constexpr int STAGE_BYTES = W_BYTES + X_BYTES + 2 * S_BYTES;  // + zeros, as scales
};

template <int MT>
struct Cfg : Stage<16 * MT> {
  using Stage<16 * MT>::STAGE_BYTES;
  static constexpr int STAGES = MT == 1 ? 6 : (MT == 2 ? 5 : 4);
  static constexpr int SMEM = STAGES * STAGE_BYTES;    // quant.py's _smem_bytes mirrors this
  static_assert(4 * MT * 16 * 32 * 4 <= SMEM, "the K-warp reduction reuses the pipeline");
  static_assert(MT > 2 || 4 * MT * 16 * 32 * 4 + 16 * MT * CTA_N * 4 <= SMEM,
                "and the 16- and 32-row tiles' partials in a cluster (w4a16_cl_*) after it");
};

// Epilogue: two adjacent columns n, n + 1 of row m, plus bias, rounded once.
template <typename T>
__device__ __forceinline__ void store2(T* y, long long y_stride, int m, int n, float v0, float v1,
                                      const T* bias) {
  if (bias != nullptr) {
    const float2 b = ps::Pack<T>::unpack(*reinterpret_cast<const unsigned int*>(bias + n));
    v0 += b.x;
    v1 += b.y;
  }
  *reinterpret_cast<unsigned int*>(y + m * y_stride + n) = ps::Pack<T>::two(v0, v1);
}

// Where a product's thread block reads: its column block, split and row tile, and the constants
// of every stage (both kernel families; ROWS: the row tile).
struct Tile {
  int tid, wn, wk, g, ncta, m0, s0, nst, NB, gshift;
  const uint4* wsrc;  // this thread's packed weights of stage 0 (+ 64 per stage)
};

template <int ROWS>
__device__ __forceinline__ Tile tile_of(const uint4* qw, int Kp, int Np, int group,
                                        int split_stages) {
  Tile q;
  q.tid = threadIdx.x;
  const int lane = q.tid & 31, warp = q.tid >> 5;
  q.wn = warp & 3;
  q.wk = warp >> 2;
  q.g = lane >> 2;
  q.ncta = blockIdx.x;
  q.m0 = blockIdx.z * ROWS;
  q.s0 = blockIdx.y * split_stages;
  q.nst = min(Kp / STAGE_K - q.s0, split_stages);
  q.NB = Np >> 5;
  q.wsrc = qw + ((size_t)(q.ncta * 4 + q.wn) * (Kp >> 5) + q.wk) * 32 + lane;
  // A power-of-two number of k32 chunks per group (32, 64, 128): the group by a shift, not a
  // division (some twenty instructions) in every stage.
  const int cpg = group >> 5;
  q.gshift = (group & 31) == 0 && (cpg & (cpg - 1)) == 0 ? __ffs(cpg) - 1 : -1;
  return q;
}

// A stage in shared memory at st, laid out [weights: one uint4 a thread][x: ROWS x 64, 16-byte
// chunks XOR-swizzled by row (the 128-byte swizzle wgmma reads)][scales: the stage's two k32
// chunks x 128 columns][zeros: as scales], copied by a StageCopier: `weights` what the model holds
// (weights, scales, zero points), `activations` what the kernel before this one writes (see
// grid_dependency_wait), each call the stage after its previous one. Each thread's sources and
// destinations are worked out once and advanced a stage at a time, so the loop does no 64-bit
// multiply or division for them. Threads 0-31 copy the scales, 32-63 the zero points and, in the
// 16-row tile, threads 128-255 the activations: the copy work of a stage spread over the warps
// that all wait at its barrier.
template <typename T, int ROWS>
struct StageCopier {
  static constexpr int X_ROUNDS = (ROWS * 8 + THREADS - 1) / THREADS;  // 16-byte chunks a thread
  const uint4* w;      // this thread's weights of the next stage
  const T* sz;         // this thread's 16 bytes of group 0's scales (threads 0-31) or zero
                       // points (32-63); null: none
  int sz_row;          // elements from one group's scales to the next's
  int sz_chunk;        // the k32 chunk of the next stage this thread's scales are for
  int gshift, group;
  unsigned int sz_dst;
  const T* x[X_ROUNDS];  // the activation row of this thread's chunk; null: nothing to copy
  int xk[X_ROUNDS];      // the chunk's first input row at the next stage
  unsigned int x_dst[X_ROUNDS];

  __device__ __forceinline__ StageCopier(const Tile& q, const T* xs, long long x_stride,
                                         const T* scales, const T* zeros, int M, int group_) {
    using L = Stage<ROWS>;
    const int tid = q.tid;
    w = q.wsrc + (size_t)q.s0 * 64;
    gshift = q.gshift;
    group = group_;
    const int c = tid & 31, half = c >> 4, part = c & 15;
    const T* base = tid < 32 ? scales : zeros;
    sz = tid < 64 && base != nullptr ? base + ((size_t)q.ncta * 4) * 32 + part * 8 : nullptr;
    sz_row = q.NB * 32;
    sz_chunk = 2 * q.s0 + half;
    sz_dst = L::W_BYTES + L::X_BYTES + (tid < 32 ? 0 : L::S_BYTES) + half * 256 + part * 16;
#pragma unroll
    for (int r = 0; r < X_ROUNDS; ++r) {
      const int cx = (tid ^ 128) + r * THREADS;  // the 16-row tile's 128 chunks: threads 128..
      const int row = cx >> 3, ch = cx & 7, m = q.m0 + row;
      // Rows past M are not loaded: their stale shared memory reaches only their own output
      // rows (a product's rows are independent), which are never stored.
      const bool live = (ROWS * 8 % THREADS == 0 || cx < ROWS * 8) && m < M;
      x[r] = live ? xs + (long long)m * x_stride : nullptr;
      xk[r] = q.s0 * STAGE_K + ch * 8;
      x_dst[r] = L::W_BYTES + row * 128 + ((ch ^ (row & 7)) << 4);
    }
  }

  // Weights, scales and zero points of the next stage into the buffer at st.
  __device__ __forceinline__ void weights(unsigned int st) {
    ps::cp_async16(st + threadIdx.x * 16, w, 16);
    w += 64;
    if (sz != nullptr) {
      const int grp = gshift >= 0 ? sz_chunk >> gshift : sz_chunk * 32 / group;
      ps::cp_async16(st + sz_dst, sz + grp * sz_row, 16);
    }
    sz_chunk += 2;
  }

  // Activations of the next stage into the buffer at st (past K: zeros).
  __device__ __forceinline__ void activations(unsigned int st, int K) {
#pragma unroll
    for (int r = 0; r < X_ROUNDS; ++r) {
      if (x[r] != nullptr) {
        const bool ok = xk[r] < K;
        ps::cp_async16(st + x_dst[r], ok ? x[r] + xk[r] : x[r], ok ? 16 : 0);
      }
      xk[r] += STAGE_K;
    }
  }
};

// This thread's packed weights of a landed stage (at st) and the scales and zero points (bf16x2 /
// fp16x2, both halves alike) of its four columns 32 nb + 8 j + g.
template <typename T, int ROWS>
__device__ __forceinline__ void read_stage(const Tile& q, const unsigned char* st, bool has_zeros,
                                           unsigned int (&qv)[4], unsigned int (&s2)[4],
                                           unsigned int (&z2)[4]) {
  using L = Stage<ROWS>;
  constexpr int W_BYTES = L::W_BYTES, X_BYTES = L::X_BYTES, S_BYTES = L::S_BYTES;
  const uint4 wq = *reinterpret_cast<const uint4*>(st + q.tid * 16);
  qv[0] = wq.x;
  qv[1] = wq.y;
  qv[2] = wq.z;
  qv[3] = wq.w;
  const int sidx = W_BYTES + X_BYTES + q.wk * 256 + (q.wn * 32 + q.g * 4) * 2;  // 4 columns
  const uint2 sraw = *reinterpret_cast<const uint2*>(st + sidx);
  s2[0] = dup_lo(sraw.x);
  s2[1] = dup_hi(sraw.x);
  s2[2] = dup_lo(sraw.y);
  s2[3] = dup_hi(sraw.y);
  if (has_zeros) {
    const uint2 zraw = *reinterpret_cast<const uint2*>(st + sidx + S_BYTES);
    z2[0] = dup_lo(zraw.x);
    z2[1] = dup_hi(zraw.x);
    z2[2] = dup_lo(zraw.y);
    z2[3] = dup_hi(zraw.y);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) z2[j] = Int4<T>::SYM_ZERO;
  }
}

// Split K, after each CTA wrote its fp32 partials of its (row tile, column block) to
// ws[split][M][gridDim.x x CN] (rows as wide as the launch's columns, so that a launch over some
// of a product's column blocks needs only their share of the workspace): the last CTA of the
// tile to arrive (counters[tile], reset by it) sums them in split order and stores y:
// deterministic, capturable, no host sync. Returns whether this CTA was that last one.
// THREADS threads sync: the whole block, or (CONSUMERS) threads 0..THREADS-1 of a block whose
// producer warpgroup may have exited (named barrier 1).
template <bool CONSUMERS>
__device__ __forceinline__ void sync_threads() {
  if constexpr (CONSUMERS)
    asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
  else
    __syncthreads();
}

// The split-K partials' row width: the launch's columns (their writers and finish_splits agree).
template <int CN>
__device__ __forceinline__ int partials_width() {
  return gridDim.x * CN;
}

template <typename T, int ROWS, bool CONSUMERS = false, int CN = CTA_N>
__device__ __forceinline__ bool finish_splits(T* y, long long y_stride, const T* bias,
                                              const float* ws, int* counters, int M, int N,
                                              int m0) {
  static_assert(CN == CTA_N || ROWS > 32, "the small tiles' sums assume CTA_N columns");
  const int wn = partials_width<CN>();
  __shared__ int s_last;
  const int tid = threadIdx.x, ncta = blockIdx.x;
  __threadfence();  // partials visible device-wide before this CTA counts itself in
  sync_threads<CONSUMERS>();
  if (tid == 0) {
    const int tile = blockIdx.z * gridDim.x + ncta;
    s_last = atomicAdd(counters + tile, 1) == (int)gridDim.y - 1;
    if (s_last) counters[tile] = 0;  // every other split has counted: ready for the next launch
  }
  sync_threads<CONSUMERS>();
  if (!s_last) return false;
  __threadfence();
  const int total = min(ROWS, M - m0) * (CN / 2), splits = gridDim.y;
  if constexpr (ROWS <= 32) {
    // The splits' partials of the tile's rows come into the (idle) pipeline buffers by cp.async,
    // as many splits a round as they hold, then each thread adds its entries (at most 4 float2
    // for 16 rows, 8 for 32) split by split from 0 in its registers: one L2 round trip a round
    // on the kernel's critical path, not one an entry, and no registers held for the loads.
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int PER = ROWS * (CTA_N / 2) / THREADS;  // entries a thread
    const int rows = min(ROWS, M - m0);
    const int split_bytes = rows * CTA_N * 4;
    const int per_round = Cfg<ROWS / 16>::SMEM / split_bytes;
    const unsigned int base = ps::smem_addr(smem);
    float2 sum[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) sum[u] = make_float2(0.f, 0.f);
    for (int s0 = 0; s0 < splits; s0 += per_round) {
      const int round = min(per_round, splits - s0);
      for (int c = tid; c < round * rows * (CTA_N / 4); c += THREADS) {  // 16-byte chunks
        const int r = c / (rows * (CTA_N / 4)), rest = c % (rows * (CTA_N / 4));
        const int m = m0 + rest / (CTA_N / 4), n = ncta * CTA_N + (rest % (CTA_N / 4)) * 4;
        ps::cp_async16(base + c * 16, ws + ((size_t)(s0 + r) * M + m) * wn + n, 16);
      }
      ps::cp_async_commit();
      ps::cp_async_wait<0>();
      __syncthreads();
      const float* part = reinterpret_cast<const float*>(smem);
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const int e = tid + u * THREADS;
        if (e >= total) break;
        for (int r = 0; r < round; ++r) {
          const float2 v = *reinterpret_cast<const float2*>(part + r * rows * CTA_N + e * 2);
          sum[u].x += v.x;
          sum[u].y += v.y;
        }
      }
      __syncthreads();  // the buffers are read before the next round overwrites them
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int e = tid + u * THREADS;
      if (e >= total) break;
      const int m = m0 + e / (CTA_N / 2), n = ncta * CTA_N + (e % (CTA_N / 2)) * 2;
      if (n < N) store2(y, y_stride, m, n, sum[u].x, sum[u].y, bias);
    }
    return true;
  }
  // PER entries a thread, BATCH splits of each loaded before any is added: entry by entry, a
  // 256-row tile's thread would wait on L2 64 times in a row whatever the split count.
  // Each entry still adds its splits in split order, from 0, so the sums are the same bits as
  // above. These sizes keep the 64-row kernel at 128 registers (2 CTAs an SM).
  constexpr int PER = ROWS >= 128 ? 8 : 2, BATCH = ROWS >= 128 ? 2 : 4;
  const size_t plane = (size_t)M * wn;  // one split's partials
  for (int e0 = tid; e0 < total; e0 += PER * THREADS) {
    int m[PER], n[PER];
    bool ok[PER];
    float2 sum[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int e = e0 + u * THREADS;
      m[u] = m0 + e / (CN / 2);
      n[u] = ncta * CN + (e % (CN / 2)) * 2;
      ok[u] = e < total && n[u] < N;
      sum[u] = make_float2(0.f, 0.f);
    }
    for (int sp = 0; sp < splits; sp += BATCH) {
      float2 v[BATCH][PER];
#pragma unroll
      for (int j = 0; j < BATCH; ++j)
#pragma unroll
        for (int u = 0; u < PER; ++u)
          if (ok[u] && sp + j < splits)
            v[j][u] = ld_l2(ws + (sp + j) * plane + (size_t)m[u] * wn + n[u]);
#pragma unroll
      for (int j = 0; j < BATCH; ++j)
#pragma unroll
        for (int u = 0; u < PER; ++u)
          if (ok[u] && sp + j < splits) {
            sum[u].x += v[j][u].x;
            sum[u].y += v[j][u].y;
          }
    }
#pragma unroll
    for (int u = 0; u < PER; ++u)
      if (ok[u]) store2(y, y_stride, m[u], n[u], sum[u].x, sum[u].y, bias);
  }
  return true;
}

// The fp32 output tile [ROWS][CN] (rows OUT_STRIDE floats apart) out by rows, THREADS
// threads (CONSUMERS: see sync_threads): a warp stores 64 adjacent columns of a row, plus bias,
// into y; with split K this split's partials, then finish_splits.
template <typename T, int ROWS, int OUT_STRIDE, bool CONSUMERS, int CN = CTA_N>
__device__ __forceinline__ void store_tile(const float* out, T* y, long long y_stride,
                                           const T* bias, float* ws, int* counters, int M, int N,
                                           int m0, int tid, int ncta, int split) {
  const int wn = partials_width<CN>();
  const int rows = min(ROWS, M - m0);
  for (int e = tid; e < rows * (CN / 2); e += THREADS) {
    const int ml = e / (CN / 2), nl = (e % (CN / 2)) * 2;
    const int m = m0 + ml, n = ncta * CN + nl;
    if (n >= N) continue;
    const float2 v = *reinterpret_cast<const float2*>(out + ml * OUT_STRIDE + nl);
    if (gridDim.y == 1)
      store2(y, y_stride, m, n, v.x, v.y, bias);
    else
      *reinterpret_cast<float2*>(ws + ((size_t)split * M + m) * wn + n) = v;
  }
  if (gridDim.y == 1) return;
  finish_splits<T, ROWS, CONSUMERS, CN>(y, y_stride, bias, ws, counters, M, N, m0);
}

// Thread block clusters (sm_90): a barrier over the cluster's threads (release / acquire, so
// shared-memory writes before it are seen by every CTA of the cluster after it) or its arrival
// alone, this CTA's rank, a CTA's shared address in CTA `rank`'s shared memory, a load from
// there (distributed shared memory), and mbarriers across the cluster.
// Not .aligned: a thread may reach them from a loop whose trip count differs across its warp.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cluster_arrive();
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ unsigned int cluster_rank() {
  unsigned int r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
// Makes this thread's mbarrier initialisations visible to the cluster's other CTAs.
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival on the mbarrier at shared::cluster address `bar` (this CTA's or another's), with
// the default CTA-scope release: what it releases is a stage buffer whose readers, the
// warpgroup's MMAs, wgmma.wait has already retired; a cluster-scope release would stall every
// releasing warp on a memory fence each stage.
__device__ __forceinline__ void mbar_arrive_cluster(unsigned int bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ unsigned int cluster_address(unsigned int local, unsigned int rank) {
  unsigned int r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(local), "r"(rank));
#endif
  return r;
}
__device__ __forceinline__ float2 ld_cluster_f2(unsigned int address) {
  float2 v = make_float2(0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n"
               : "=f"(v.x), "=f"(v.y) : "r"(address) : "memory");
#endif
  return v;
}

// Split K through a cluster (CLUSTER, the candidate tiles w4a16_cl_*, launched as clusters of
// (1, splits, 1)): each CTA's fp32 partials of its (row tile, column block) stay in its own
// shared memory at `part` ([ROWS][CTA_N]); after a cluster barrier each CTA sums a slice of the
// tile across the cluster's CTAs in split order from 0 (finish_splits' bits) and stores it, and
// a second barrier keeps every CTA's partials alive until all have read them: no partials in
// global memory, no fence, no arrival counter.
template <typename T, int ROWS>
__device__ __forceinline__ void cluster_splits(T* y, long long y_stride, const T* bias,
                                               const float* part, int M, int N, int m0) {
  cluster_sync();  // every CTA's partials are in its shared memory
  const int splits = gridDim.y, rank = blockIdx.y;  // cluster (1, splits, 1): rank = split
  const int total = min(ROWS, M - m0) * (CTA_N / 2);  // float2 entries of the tile's rows
  const int from = rank * total / splits, to = (rank + 1) * total / splits;
  const unsigned int local = ps::smem_addr(part);
  for (int e = from + (int)threadIdx.x; e < to; e += THREADS) {
    float2 sum = make_float2(0.f, 0.f);
    for (int sp = 0; sp < splits; ++sp) {
      const float2 v = ld_cluster_f2(cluster_address(local + e * 8, sp));
      sum.x += v.x;
      sum.y += v.y;
    }
    const int m = m0 + e / (CTA_N / 2), n = blockIdx.x * CTA_N + (e % (CTA_N / 2)) * 2;
    if (n < N) store2(y, y_stride, m, n, sum.x, sum.y, bias);
  }
  cluster_sync();  // no CTA leaves while another may still read its partials
}

// Grid (Np / 128, splits, ceil(M / ROWS)); 256 threads. Split s covers K stages
// [s * split_stages, ...). splits == 1: the CTA writes y. Else each CTA writes fp32 partials to
// ws[split][M][gridDim.x x CTA_N] and the last CTA of a tile (counters[tile], reset by it) sums
// them in split order: deterministic, capturable, no host sync.
template <typename T, int MT, bool CLUSTER = false>
__device__ __forceinline__ void w4a16(T* __restrict__ y, long long y_stride,
                                      const T* __restrict__ x, long long x_stride,
                                      const uint4* __restrict__ qw, const T* __restrict__ scales,
                                      const T* __restrict__ zeros, const T* __restrict__ bias,
                                      float* __restrict__ ws, int* __restrict__ counters, int M,
                                      int N, int K, int Kp, int Np, int group, int split_stages) {
  using C = Cfg<MT>;
  extern __shared__ __align__(128) unsigned char smem[];
  const Tile q = tile_of<C::ROWS>(qw, Kp, Np, group, split_stages);
  const int tid = q.tid, lane = tid & 31, wn = q.wn, wk = q.wk, g = q.g, t = lane & 3;
  const int ncta = q.ncta, split = blockIdx.y, m0 = q.m0, nst = q.nst;
  const int nb = ncta * 4 + wn;
  const unsigned int smem0 = ps::smem_addr(smem);
  PS_TRACE_RUN(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), 0);
  StageCopier<T, C::ROWS> copy(q, x, x_stride, scales, zeros, M, group);
  constexpr unsigned int RING = C::STAGES * C::STAGE_BYTES;

  float acc[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][j][r] = 0.f;

  // The first stages' weights load before waiting for the kernel before this one (which writes
  // x, the workspace or y's memory): launched programmatically, this grid's start and those
  // loads overlap that kernel's end. They join stage 0's copy group.
#pragma unroll
  for (int i = 0; i < C::STAGES - 1; ++i)
    if (i < nst) copy.weights(smem0 + i * C::STAGE_BYTES);
  ps::grid_dependency_wait();
  ps::launch_dependents();
#pragma unroll
  for (int i = 0; i < C::STAGES - 1; ++i) {
    if (i < nst) copy.activations(smem0 + i * C::STAGE_BYTES, K);
    ps::cp_async_commit();
  }
  unsigned int rd = 0, wr = (C::STAGES - 1) * C::STAGE_BYTES;  // buffer offsets: read, refill
  for (int i = 0; i < nst; ++i) {
    PS_TRACE_WAIT_BEGIN();
    ps::cp_async_wait<C::STAGES - 2>();  // stage i has landed (own copies), then everyone's
    __syncthreads();                     // ... and the buffer refilled below is read by no one
    PS_TRACE_WAIT_END();
    if (i + C::STAGES - 1 < nst) {
      copy.weights(smem0 + wr);
      copy.activations(smem0 + wr, K);
    }
    ps::cp_async_commit();
    wr = wr + C::STAGE_BYTES == RING ? 0 : wr + C::STAGE_BYTES;

    unsigned int qv[4], s2[4], z2[4];
    read_stage<T, C::ROWS>(q, smem + rd, zeros != nullptr, qv, s2, z2);
    const unsigned int xs = smem0 + rd + C::W_BYTES;
    rd = rd + C::STAGE_BYTES == RING ? 0 : rd + C::STAGE_BYTES;
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
      unsigned int a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {  // A fragment of rows 16mt.., k 32wk + 16kh..
        const int row = mt * 16 + (lane & 15), chunk = wk * 4 + kh * 2 + (lane >> 4);
        ps::ldmatrix_x4(a[mt], xs + row * 128 + ((chunk ^ (row & 7)) << 4));
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned int b0 = Int4<T>::pair(qv[j] >> (8 * kh), z2[j], s2[j]);
        const unsigned int b1 = Int4<T>::pair(qv[j] >> (8 * kh + 4), z2[j], s2[j]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ps::mma16816<T>(acc[mt][j], a[mt], b0, b1);
      }
    }
  }
  PS_TRACE_RETIRED();
  ps::cp_async_wait<0>();
  __syncthreads();

  // The two K warps of each column block add up (fixed order); K warp 0 holds the sum.
  float* red = reinterpret_cast<float*>(smem);
  if (wk == 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          red[(((wn * MT + mt) * 4 + j) * 4 + r) * 32 + lane] = acc[mt][j][r];
  }
  __syncthreads();
  if (wk == 0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          acc[mt][j][r] += red[(((wn * MT + mt) * 4 + j) * 4 + r) * 32 + lane];
  }

  if constexpr (CLUSTER) {
    if (gridDim.y > 1) {
      float* part = red + 4 * MT * 16 * 32;  // past the K warps' sums: [ROWS][CTA_N]
      if (wk == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int n = wn * 32 + j * 8 + 2 * t, m = mt * 16 + g;
            *reinterpret_cast<float2*>(part + m * CTA_N + n) =
                make_float2(acc[mt][j][0], acc[mt][j][1]);
            *reinterpret_cast<float2*>(part + (m + 8) * CTA_N + n) =
                make_float2(acc[mt][j][2], acc[mt][j][3]);
          }
      }
      cluster_splits<T, C::ROWS>(y, y_stride, bias, part, M, N, m0);
      return;
    }
  }

  if (gridDim.y == 1) {
    if (wk == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int n = nb * 32 + j * 8 + 2 * t, m = m0 + mt * 16 + g;
          if (n >= N) continue;
          if (m < M) store2(y, y_stride, m, n, acc[mt][j][0], acc[mt][j][1], bias);
          if (m + 8 < M) store2(y, y_stride, m + 8, n, acc[mt][j][2], acc[mt][j][3], bias);
        }
    }
    PS_TRACE_OUT(nst, TRACE_STORED);
    return;
  }

  if (wk == 0) {
    const int wn = partials_width<CTA_N>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = nb * 32 + j * 8 + 2 * t, m = m0 + mt * 16 + g;
        float* part = ws + (size_t)split * M * wn + n;
        if (m < M)
          *reinterpret_cast<float2*>(part + (size_t)m * wn) =
              make_float2(acc[mt][j][0], acc[mt][j][1]);
        if (m + 8 < M)
          *reinterpret_cast<float2*>(part + (size_t)(m + 8) * wn) =
              make_float2(acc[mt][j][2], acc[mt][j][3]);
      }
  }
  [[maybe_unused]] const bool summed =
      finish_splits<T, C::ROWS>(y, y_stride, bias, ws, counters, M, N, m0);
  PS_TRACE_OUT(nst, summed ? TRACE_LAST_SUM : TRACE_PART);
}

// ---------------------------------------------------------------------------------------------
// The same product on Hopper tensor cores (wgmma, sm_90a), for row tiles of 64 or 128: y^T = W .
// x^T, so the weights are the MMA's A operand, dequantized in registers exactly as above (the
// packed layout gives a lane its A fragments: word 2h / 2h + 1 hold rows g / g + 8 of the m16 tile
// h of its n32 block), and the activation tile is B, read by the tensor cores from shared memory
// in the 128-byte-swizzle layout StageCopier already writes. Warpgroup wk takes the stage's k32
// chunk wk (the two add up in shared memory at the end); each of its warps a n32 block, two m64
// wgmma a k16 step (rows 16 w + r of MMA h: column 32 nb + 16 h + r). Same packed weights, grid,
// split K and epilogue as w4a16; the activation tile's rows are the MMA's N (64 or 128). A
// warpgroup dequantizes stage i while its MMAs of stage i - 1 run ("wgp": two groups in flight),
// where waiting for each stage's MMAs first would leave its tensor cores idle meanwhile.
template <int MT>
struct WgCfg : Stage<16 * MT> {
  using Stage<16 * MT>::ROWS;
  using Stage<16 * MT>::STAGE_BYTES;
  static constexpr int STAGES = MT == 4 ? 6 : 4;
  static constexpr int OUT_STRIDE = CTA_N + 4;  // fp32 tile rows: the accumulators' stores hit
                                                // distinct banks
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024;  // + the 1024-byte alignment
  static_assert(STAGE_BYTES % 1024 == 0, "swizzle atoms need 1024-byte aligned stages");
  static_assert(ROWS * OUT_STRIDE * 4 <= STAGES * STAGE_BYTES, "the output tile reuses them");
};

// One m64nNk16 wgmma of both wgmma families: A (weights) from registers, B (rows of x) K-major
// in shared memory, N = 64, 128 or 256 rows of x.
template <typename T, int N>
__device__ __forceinline__ void wg_mma(float (&d)[N / 2], const unsigned int (&a)[4],
                                       unsigned long long db) {
  if constexpr (N == 64)
    ps::wgmma_rs_m64n64_kb(d, a, db, T());
  else if constexpr (N == 128)
    ps::wgmma_rs_m64n128_kb(d, a, db, T());
  else
    ps::wgmma_rs_m64n256_kb(d, a, db, T());
}

template <typename T, int MT>
__device__ __forceinline__ void w4a16_wg(T* __restrict__ y, long long y_stride,
                                         const T* __restrict__ x, long long x_stride,
                                         const uint4* __restrict__ qw, const T* __restrict__ scales,
                                         const T* __restrict__ zeros, const T* __restrict__ bias,
                                         float* __restrict__ ws, int* __restrict__ counters,
                                         int M, int N, int K, int Kp, int Np, int group,
                                         int split_stages) {
#if PS_HAS_WGMMA
  static_assert(MT == 4 || MT == 8, "wgmma tiles of 64 or 128 rows");
  using C = WgCfg<MT>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned int dyn_smem;  // quant.py's _smem_bytes mirrors WgCfg::SMEM: a launch with less traps
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < (unsigned int)C::SMEM) __trap();
  const unsigned int raw_addr = ps::smem_addr(smem_raw);
  const unsigned int smem0 = (raw_addr + 1023u) & ~1023u;  // swizzle atoms: 1024-byte aligned
  unsigned char* const smem = smem_raw + (smem0 - raw_addr);
  const Tile q = tile_of<C::ROWS>(qw, Kp, Np, group, split_stages);
  const int tid = q.tid, wn = q.wn, wk = q.wk, g = q.g, t = tid & 3;
  const int ncta = q.ncta, split = blockIdx.y, m0 = q.m0, nst = q.nst;
  StageCopier<T, C::ROWS> copy(q, x, x_stride, scales, zeros, M, group);
  auto load = [&](int i) {
    const unsigned int st = smem0 + (i % C::STAGES) * C::STAGE_BYTES;
    copy.weights(st);
    copy.activations(st, K);
  };

  float acc[2][8 * MT];  // MMA h: m64 (columns) x ROWS (rows of x)
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int r = 0; r < 8 * MT; ++r) acc[h][r] = 0.f;

  // Two MMA groups in flight (the A fragments double-buffered), so stages are loaded one fewer
  // ahead than the buffers allow: the buffer refilled at step i was read by the MMAs of stage
  // i - 2, which every warpgroup waited for before the step's barrier.
  constexpr int AHEAD = C::STAGES - 2;
  // The first stages' weights before waiting for the kernel before this one, as in w4a16.
#pragma unroll
  for (int i = 0; i < AHEAD; ++i)
    if (i < nst) copy.weights(smem0 + i * C::STAGE_BYTES);
  ps::grid_dependency_wait();
  ps::launch_dependents();
#pragma unroll
  for (int i = 0; i < AHEAD; ++i) {
    if (i < nst) copy.activations(smem0 + i * C::STAGE_BYTES, K);
    ps::cp_async_commit();
  }
  auto step = [&](int i, unsigned int (&a)[2][2][4]) {
    ps::cp_async_wait<AHEAD - 1>();
    ps::fence_proxy_async();  // cp.async writes -> visible to the tensor cores' (async) proxy
    __syncthreads();          // stage i landed for all; the buffer refilled below is free
    if (i + AHEAD < nst) load(i + AHEAD);
    ps::cp_async_commit();

    const int b = i % C::STAGES;
    unsigned int qv[4], s2[4], z2[4];
    read_stage<T, C::ROWS>(q, smem + b * C::STAGE_BYTES, zeros != nullptr, qv, s2, z2);
    // A fragments of k16 step kh, MMA h: (row g, k 2t..) (row g + 8, k 2t..) (row g, k 2t + 8..)
    // (row g + 8, k 2t + 8..): pairs 2 kh and 2 kh + 1 of words 2h and 2h + 1.
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        a[kh][h][0] = Int4<T>::pair(qv[2 * h] >> (8 * kh), z2[2 * h], s2[2 * h]);
        a[kh][h][1] = Int4<T>::pair(qv[2 * h + 1] >> (8 * kh), z2[2 * h + 1], s2[2 * h + 1]);
        a[kh][h][2] = Int4<T>::pair(qv[2 * h] >> (8 * kh + 4), z2[2 * h], s2[2 * h]);
        a[kh][h][3] = Int4<T>::pair(qv[2 * h + 1] >> (8 * kh + 4), z2[2 * h + 1], s2[2 * h + 1]);
      }
    // x tile as B, K-major; this warpgroup's k32 chunk starts 64 bytes into each row.
    const unsigned long long x_desc =
        ps::wg_desc(smem0 + b * C::STAGE_BYTES + C::W_BYTES, 16, 1024);
    ps::fence_regs(acc[0]);
    ps::fence_regs(acc[1]);
    ps::wgmma_fence();
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        wg_mma<T, 16 * MT>(acc[h], a[kh][h], x_desc + ((wk * 64 + kh * 32) >> 4));
    ps::wgmma_commit();
    ps::wgmma_wait<1>();
    ps::fence_regs(acc[0]);
    ps::fence_regs(acc[1]);
  };
  unsigned int a0[2][2][4], a1[2][2][4];  // stage i's fragments live until its MMAs retire
  int i = 0;
  for (; i + 1 < nst; i += 2) {
    step(i, a0);
    step(i + 1, a1);
  }
  if (i < nst) step(i, a0);
  ps::wgmma_wait<0>();
  ps::fence_regs(acc[0]);
  ps::fence_regs(acc[1]);
  ps::cp_async_wait<0>();
  __syncthreads();

  // Both warpgroups' sums into one fp32 tile [ROWS][CTA_N] (warpgroup 0 writes, 1 adds: a fixed
  // order), then out by rows: a warp stores 64 adjacent columns of a row.
  float* out = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    if (wk == pass) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 8 * MT; ++r) {
          const int n = wn * 32 + h * 16 + g + 8 * ((r >> 1) & 1);
          const int m = 8 * (r >> 2) + 2 * t + (r & 1);
          float* dst = out + m * C::OUT_STRIDE + n;
          *dst = pass == 0 ? acc[h][r] : *dst + acc[h][r];
        }
    }
    __syncthreads();
  }
  store_tile<T, C::ROWS, C::OUT_STRIDE, false>(out, y, y_stride, bias, ws, counters, M, N, m0,
                                               tid, ncta, split);
#else
  __trap();  // built without sm_90a: the launcher never picks this kernel then
#endif
}

// W[N, K] (row-major, F.linear's layout) from the packed form, exactly the values the product
// multiplies. A CTA of 256 threads takes one n32 block x DQ_CHUNKS k32 chunks: each thread
// dequantizes one packed uint4 (32 weights, as the product's lanes hold them) into a shared
// tile, then the tile's rows go out as 16-byte vectors, whole rows of the tile per warp (K is a
// multiple of 8: eight nibbles a word along K).
constexpr int DQ_CHUNKS = 8;
constexpr int DQ_STRIDE = DQ_CHUNKS * 32 + 8;  // a tile row, padded: its 8 rows' stores hit
                                               // distinct banks
template <typename T>
__device__ __forceinline__ void dequant(T* __restrict__ w, const uint4* __restrict__ qw,
                                        const T* __restrict__ scales, const T* __restrict__ zeros,
                                        int N, int K, int Kp, int Np, int group) {
  __shared__ __align__(16) T tile[32 * DQ_STRIDE];
  const int KC = Kp >> 5, NB = Np >> 5;
  const int kblocks = (KC + DQ_CHUNKS - 1) / DQ_CHUNKS;
  const int nb = blockIdx.x / kblocks, kc0 = (blockIdx.x - nb * kblocks) * DQ_CHUNKS;
  const int c = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int kc = kc0 + c;
  if (kc < KC) {
    const uint4 wq = qw[((size_t)nb * KC + kc) * 32 + lane];
    const unsigned int qv[4] = {wq.x, wq.y, wq.z, wq.w};
    const size_t sbase = ((size_t)(kc * 32 / group) * NB + nb) * 32 + g * 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned short sv = *reinterpret_cast<const unsigned short*>(scales + sbase + j);
      const unsigned int s2 = (unsigned int)sv * 0x10001u;
      unsigned int z2 = Int4<T>::SYM_ZERO;
      if (zeros != nullptr)
        z2 = (unsigned int)(*reinterpret_cast<const unsigned short*>(zeros + sbase + j)) * 0x10001u;
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int col = c * 32 + (p >> 1) * 16 + (p & 1) * 8 + 2 * t;
        *reinterpret_cast<unsigned int*>(&tile[(8 * j + g) * DQ_STRIDE + col]) =
            Int4<T>::pair(qv[j] >> (4 * p), z2, s2);
      }
    }
  }
  __syncthreads();
  constexpr int VECS = DQ_CHUNKS * 4;  // 16-byte vectors of a tile row
  for (int v = threadIdx.x; v < 32 * VECS; v += blockDim.x) {
    const int row = v / VECS, col = (v - row * VECS) * 8;
    const int n = nb * 32 + row, k = kc0 * 32 + col;
    if (n < N && k < K)  // past N or K: the padding's columns and rows, not stored
      *reinterpret_cast<uint4*>(w + (size_t)n * K + k) =
          *reinterpret_cast<const uint4*>(&tile[row * DQ_STRIDE + col]);
  }
}


// ---------------------------------------------------------------------------------------------
// Row tiles on Hopper with a producer warpgroup (wgmma, sm_90a), "wgt": TOK = 64, 128 or 256
// rows of x a CTA; at 256 a weight tile is read and dequantized once for up to 256 rows (the
// other tiles redo both for every row tile). 3 warpgroups: warpgroup 2 produces (cp.async of a
// stage's packed weights, x tile, scales and zero points into STAGES buffers under full/empty
// mbarriers, then exits), 0 and 1 consume: y^T = W . x^T with W the A operand, dequantized in
// registers as in w4a16_wg, x the B operand (TOK x 64 a stage, K-major, 128-byte swizzle).
// Warpgroup c multiplies columns 64c .. 64c + 63 of the CTA's 128 by all TOK rows, one m64nTOK
// wgmma a k16 step: its warp w dequantizes half w & 1 (words 2h, 2h + 1) of n32 block
// 2c + (w >> 1), columns 64c + 16w + r.
// It dequantizes stage i while its MMAs of stage i - 1 run, and releases a stage once the MMAs
// that read it retire. Same packed weights, grid (column blocks, splits, row tiles), split K and
// epilogue as w4a16.
// A stage holds what Stage<TOK> holds (CN = CTA_N; for CN = 256, the "wgw" tile below, twice the
// weights, scales and zero points), laid out [x][weights][scales][zeros]: x, which the tensor
// cores read, at the stage's 1024-byte-aligned start.
template <int TOK, int CN = CTA_N>
struct WtCfg {
  static constexpr int X_BYTES = TOK * STAGE_K * 2;  // [TOK][64], 128-byte swizzle
  static constexpr int W_BYTES = CN * STAGE_K / 2;   // packed weights: CN / 32 x 32 lanes x 16 B
  static constexpr int S_BYTES = 2 * CN * 2;         // scales of the stage's two k32 chunks
  static constexpr int STAGE_BYTES = X_BYTES + W_BYTES + 2 * S_BYTES;  // + zeros, as scales
  static constexpr int STAGES =  // quant.py mirrors
      CN > CTA_N ? 8 : (TOK == 256 ? 4 : (TOK == 128 ? 6 : 8));
  static constexpr int BLOCK = THREADS + 128;  // 2 consumer warpgroups, then the producer
  static constexpr int OUT_STRIDE = CN + 4;  // fp32 tile rows: distinct banks
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024;  // + the 1024-byte alignment
  static_assert(CN == CTA_N || CN == 2 * CTA_N, "128 or 256 columns a CTA");
  static_assert(STAGE_BYTES % 1024 == 0, "swizzle atoms need 1024-byte aligned stages");
  static_assert(TOK * OUT_STRIDE * 4 <= STAGES * STAGE_BYTES, "the output tile reuses them");
};

// The producer: stage s of the split into buffer `st` (128 threads, p = 0..127), in two parts:
// what the model holds (packed weights, scales, zero points), which a grid launched
// programmatically loads for its first stages before the kernel before it has ended, and x.
// The CTA's CN / 32 n32 blocks from ncta * CN / 32; with CN = 256, blocks past the padded N (NB
// blocks: a multiple of 4) read zeros.
template <typename T, int TOK, int CN = CTA_N, int CS = 1>
__device__ __forceinline__ void wgt_load_weights(unsigned int st, int s, int p, int ncta,
                                                 const uint4* __restrict__ qw,
                                                 const T* __restrict__ scales,
                                                 const T* __restrict__ zeros, int KC, int NB,
                                                 int group, int gshift) {
  using C = WtCfg<TOK, CN>;
  constexpr int BLOCKS = CN / 32, PARTS = CN / 8;  // n32 blocks; 16-byte parts of a scale chunk
  // blocks inside the padded N: a 256-column tile's last CTA, or the last CTAs of a multicast
  // cluster where the column blocks are not a multiple of its size, may lie (partly) past it
  constexpr bool CHECK = CN > CTA_N || CS > 1;
  const int valid = CHECK ? NB - ncta * BLOCKS : BLOCKS;
#pragma unroll
  for (int r = 0; r < CN / 64; ++r) {  // weights: entry e = n32 block e >> 6, k32 chunk, lane
    const int e = p + r * 128;
    const bool ok = !CHECK || (e >> 6) < valid;
    ps::cp_async16(st + C::X_BYTES + e * 16,
                   ok ? qw + ((size_t)(ncta * BLOCKS + (e >> 6)) * KC + 2 * s + ((e >> 5) & 1)) *
                                 32 +
                            (e & 31)
                      : qw,
                   ok ? 16 : 0);
  }
  // PARTS x 2 threads copy the scales, as many the zero points: 2 chunks x 2 CN bytes each
  if (p < 4 * PARTS) {
    const T* base = p < 2 * PARTS ? scales : zeros;
    if (base != nullptr) {
      const int c = p & (2 * PARTS - 1), half = c / PARTS, part = c & (PARTS - 1);
      const bool ok = !CHECK || (part >> 2) < valid;
      const int grp = gshift >= 0 ? (2 * s + half) >> gshift : (s * STAGE_K + half * 32) / group;
      const T* src = base + ((size_t)grp * NB + ncta * BLOCKS) * 32 + part * 8;
      ps::cp_async16(st + C::X_BYTES + C::W_BYTES + (p < 2 * PARTS ? 0 : C::S_BYTES) +
                         half * (2 * CN) + part * 16,
                     ok ? src : base, ok ? 16 : 0);
    }
  }
}

template <typename T, int TOK>
__device__ __forceinline__ void wgt_load_x(unsigned int st, int s, int p, int m0,
                                           const T* __restrict__ x, long long x_stride, int M,
                                           int K) {
  // x: TOK rows of 8 16-byte chunks; this thread takes chunk p & 7 of rows p / 8 + 16 r, whose
  // swizzled column is the same for every r (16 r leaves row & 7 alone): one destination plus
  // constants, one source pointer stepped by 16 rows.
  const int row0 = p >> 3, ch = p & 7, k = s * STAGE_K + ch * 8;
  const bool k_ok = k < K;  // past K: zeros
  const unsigned int d0 = st + row0 * 128 + ((ch ^ (row0 & 7)) << 4);
  const T* src = x + (long long)(m0 + row0) * x_stride + k;
#pragma unroll
  for (int r = 0; r < TOK / 16; ++r) {
    // Rows past M are not loaded: their stale shared memory reaches only their own output
    // rows, which are never stored.
    if (m0 + row0 + 16 * r < M) ps::cp_async16(d0 + r * 2048, k_ok ? src : x, k_ok ? 16 : 0);
    src += 16 * x_stride;
  }
}

// The producer-fed kernels' start (w4a16_wgt, w4a16_wgs). The stage buffers' base, 1024-byte
// aligned for the swizzle atoms, after checking the launch gave WtCfg::SMEM bytes (quant.py's
// _smem_bytes mirrors it: a launch with less traps).
template <int TOK, int CN = CTA_N>
__device__ __forceinline__ unsigned int wgt_smem0(const unsigned char* smem_raw) {
  unsigned int dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < (unsigned int)WtCfg<TOK, CN>::SMEM) __trap();
  return (ps::smem_addr(smem_raw) + 1023u) & ~1023u;
}

// cuda.h's CUtensorMap as a kernel argument (the "wgm" and "wgq" tiles below).
struct alignas(64) TmaMap {
  unsigned long long words[16];
};

// The mbarriers, initialised before anyone waits on or arrives at them: full[b], then empty[b].
// In a multicast cluster of CS CTAs, full also counts its producer's expected x bytes, and
// empty one arrival a consumer warp of every CTA (every CTA's x lands in every buffer); they are
// initialised before another CTA can signal them.
template <int TOK, int CN = CTA_N, int CS = 1>
__device__ __forceinline__ void wgt_init_bars(unsigned int bars) {
  using C = WtCfg<TOK, CN>;
  if (threadIdx.x == 0) {
    for (int b = 0; b < C::STAGES; ++b) {
      ps::mbar_init(bars + 8 * b, CS > 1 ? 129 : 128);  // full: one arrival a producer thread
      ps::mbar_init(bars + 8 * (C::STAGES + b),        // empty: one a consumer thread
                    CS > 1 ? CS * THREADS / 32 : THREADS);
    }
  }
  if constexpr (CS > 1) {
    mbar_init_fence();
    cluster_sync();
  } else {
    __syncthreads();
  }
}

// x through the tensor memory accelerator, multicast (the "wgm" and "wgq" tiles, sm_90a): a
// cluster of CS CTAs of one row tile and neighbouring column blocks shares each stage's x tile,
// CTA `rank` loading rows m0 + rank TOK / CS .. into every CTA's buffer at st, in the layout
// wgt_load_x writes (the map's 128-byte swizzle; zeros past K), completing on every CTA's full
// barrier at `full`: the cluster reads x from L2 once where CS CTAs read it CS times. The map
// (_compile.tensor_map_2d) is x as [M][K] in boxes of TOK / CS rows by 64. Parts wholly past M
// are not loaded, as wgt_load_x leaves such rows.
template <int TOK, int CS>
__device__ __forceinline__ void wgt_load_x_mc(unsigned int st, unsigned int full, int s, int m0,
                                              int M, const TmaMap* map) {
#if PS_HAS_WGMMA
  constexpr int PART = TOK / CS;
  const unsigned int rank = cluster_rank();
  const int parts = min(CS, (M - m0 + PART - 1) / PART);  // the parts loaded, by every CTA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(full),
               "r"((unsigned int)(parts * PART * 128)) : "memory");
  const int row = m0 + (int)rank * PART;
  if (row < M)
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(st + rank * PART * 128),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(s * STAGE_K), "r"(row), "r"(full),
        "h"((unsigned short)((1u << CS) - 1))
        : "memory");
#endif
}

// wgt_load_weights' group shift: log2 of the k32 chunks a scale group spans, -1 if not a power of two.
__device__ __forceinline__ int wgt_gshift(int group) {
  const int cpg = group >> 5;
  return (group & 31) == 0 && (cpg & (cpg - 1)) == 0 ? __ffs(cpg) - 1 : -1;
}

// The producer's stage i (w4a16_wgt, w4a16_wgs): stage s of tile (ncta, m0) into buffer
// i % STAGES, once the consumers released that buffer's previous fill (thread p of 128); its
// weights only where `prefetched` does not say they are in already (wgt_prefetch).
template <typename T, int TOK, int CN = CTA_N, int CS = 1>
__device__ __forceinline__ void wgt_produce(int i, int s, int p, int ncta, int m0,
                                            unsigned int smem0, unsigned int bars,
                                            const T* __restrict__ x, long long x_stride,
                                            const uint4* __restrict__ qw,
                                            const T* __restrict__ scales,
                                            const T* __restrict__ zeros, int M, int K, int Kp,
                                            int Np, int group, int gshift, bool prefetched,
                                            const TmaMap* x_map = nullptr) {
  using C = WtCfg<TOK, CN>;
  const int b = i % C::STAGES;
  const unsigned int st = smem0 + b * C::STAGE_BYTES;
  ps::mbar_wait(bars + 8 * (C::STAGES + b), ((i / C::STAGES) & 1) ^ 1);
  if (!prefetched)
    wgt_load_weights<T, TOK, CN, CS>(st, s, p, ncta, qw, scales, zeros, Kp >> 5, Np >> 5, group,
                                     gshift);
  if constexpr (CS > 1) {
    if (p == 0) wgt_load_x_mc<TOK, CS>(st, bars + 8 * b, s, m0, M, x_map);
  } else {
    wgt_load_x<T, TOK>(st, s, p, m0, x, x_stride, M, K);
  }
  ps::cp_async_mbar_arrive(bars + 8 * b);
}

// This warp's A fragments (n32 block nbl of the CTA's, half h of it) for the four k16 steps of
// the landed stage at st.
template <typename T, int TOK, int CN = CTA_N>
__device__ __forceinline__ void wgt_dequant(const unsigned char* st, int nbl, int h, int lane,
                                            int g, bool has_zeros, unsigned int (&a)[4][4]) {
  using C = WtCfg<TOK, CN>;
#pragma unroll
  for (int kc = 0; kc < 2; ++kc) {  // k32 chunk kc: words 2h, 2h + 1 of this lane's uint4
    const uint4 wq = *reinterpret_cast<const uint4*>(st + C::X_BYTES +
                                                     ((nbl * 2 + kc) * 32 + lane) * 16);
    const unsigned int q0 = h ? wq.z : wq.x, q1 = h ? wq.w : wq.y;
    const int sidx = C::X_BYTES + C::W_BYTES + kc * (2 * CN) + (nbl * 32 + g * 4 + 2 * h) * 2;
    const unsigned int sraw = *reinterpret_cast<const unsigned int*>(st + sidx);
    const unsigned int s0w = dup_lo(sraw), s1w = dup_hi(sraw);
    unsigned int z0w = Int4<T>::SYM_ZERO, z1w = Int4<T>::SYM_ZERO;
    if (has_zeros) {
      const unsigned int zraw = *reinterpret_cast<const unsigned int*>(st + sidx + C::S_BYTES);
      z0w = dup_lo(zraw);
      z1w = dup_hi(zraw);
    }
    // A fragments of k16 step kh: (row g, k 2t..) (row g + 8, k 2t..) (row g, k 2t + 8..)
    // (row g + 8, k 2t + 8..): pairs 2 kh and 2 kh + 1 of words 2h and 2h + 1.
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
      a[2 * kc + kh][0] = Int4<T>::pair(q0 >> (8 * kh), z0w, s0w);
      a[2 * kc + kh][1] = Int4<T>::pair(q1 >> (8 * kh), z1w, s1w);
      a[2 * kc + kh][2] = Int4<T>::pair(q0 >> (8 * kh + 4), z0w, s0w);
      a[2 * kc + kh][3] = Int4<T>::pair(q1 >> (8 * kh + 4), z1w, s1w);
    }
  }
}

// One wgmma group over a stage: acc (m64 x TOK) += a (this warp's fragments, 4 k16 steps) . x
// tile as B, K-major (k16 step ks starts 32 ks bytes into each 128-byte row), committed.
template <typename T, int TOK>
__device__ __forceinline__ void wgt_group(float (&acc)[TOK / 2], const unsigned int (&a)[4][4],
                                          unsigned long long x_desc) {
  ps::fence_regs(acc);
  ps::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wg_mma<T, TOK>(acc, a[ks], x_desc + ((ks * 32) >> 4));
  ps::wgmma_commit();
}

// One stage of the consumers' loop (w4a16_wgt, w4a16_wgs): wait for stage i, dequantize this
// warp's A fragments from it, issue the warpgroup's MMAs, retire stage i - 1's MMAs and, when
// `release`, give stage i - 1's buffer back to the producer.
template <typename T, int TOK, int CS = 1>
__device__ __forceinline__ void wgt_step(int i, bool release, unsigned int (&a)[4][4],
                                         float (&acc)[TOK / 2], unsigned int bars,
                                         unsigned int smem0, const unsigned char* smem, int nbl,
                                         int h, int lane, int g, bool has_zeros) {
  using C = WtCfg<TOK>;
  const int b = i % C::STAGES;
  ps::mbar_wait(bars + 8 * b, (i / C::STAGES) & 1);  // stage i landed
  ps::fence_proxy_async();  // cp.async writes -> visible to the tensor cores' (async) proxy
  const unsigned char* st = smem + b * C::STAGE_BYTES;
  wgt_dequant<T, TOK>(st, nbl, h, lane, g, has_zeros, a);
  const unsigned long long x_desc = ps::wg_desc(smem0 + b * C::STAGE_BYTES, 16, 1024);
  wgt_group<T, TOK>(acc, a, x_desc);
  ps::wgmma_wait<1>();  // stage i - 1's MMAs retired: its buffer and A fragments are free
  ps::fence_regs(acc);
  if (!release) return;
  const unsigned int empty = bars + 8 * (C::STAGES + (i - 1) % C::STAGES);
  if constexpr (CS > 1) {  // every CTA's producer writes this buffer: a warp tells each of them
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < CS; ++r) mbar_arrive_cluster(cluster_address(empty, r));
    }
  } else {
    ps::mbar_arrive(empty);
  }
}

// The producer warpgroup of a wgt / wgw CTA (thread THREADS + p): the split's nst stages from s0
// of tile (ncta, m0) into the buffers; fill u of buffer b waits for release u - 1 (parity).
// Leaves only once its copies, and so their arrivals, are complete.
template <typename T, int TOK, int CN = CTA_N, int CS = 1>
__device__ __forceinline__ void wgt_producer(int p, int ncta, int m0, int s0, int nst,
                                             unsigned int smem0, unsigned int bars,
                                             const T* __restrict__ x, long long x_stride,
                                             const uint4* __restrict__ qw,
                                             const T* __restrict__ scales,
                                             const T* __restrict__ zeros, int M, int K, int Kp,
                                             int Np, int group,
                                             const TmaMap* x_map = nullptr) {
  using C = WtCfg<TOK, CN>;
  const int gshift = wgt_gshift(group);
  // Launched programmatically, this grid starts while the kernel before it ends: the first
  // fill's weights (its buffers are free) load before waiting for that kernel, whose writes
  // (x, the workspace, y's memory) nothing here touches before the wait.
  const int pre = min(nst, C::STAGES);
  for (int i = 0; i < pre; ++i)
    wgt_load_weights<T, TOK, CN, CS>(smem0 + i * C::STAGE_BYTES, s0 + i, p, ncta, qw, scales,
                                     zeros, Kp >> 5, Np >> 5, group, gshift);
  ps::grid_dependency_wait();
  ps::launch_dependents();
  for (int i = 0; i < nst; ++i)
    wgt_produce<T, TOK, CN, CS>(i, s0 + i, p, ncta, m0, smem0, bars, x, x_stride, qw, scales,
                                zeros, M, K, Kp, Np, group, gshift, i < pre, x_map);
  // wait_group covers only committed groups, and the copies were never committed.
  ps::cp_async_commit();
  ps::cp_async_wait<0>();
}

// CS > 1: the "wgm" (2) and "wgq" (4) tiles, launched as clusters of (CS, 1, 1) with x's map
// (wgt_load_x_mc).
template <typename T, int TOK, int CS = 1>
__device__ __forceinline__ void w4a16_wgt(T* __restrict__ y, long long y_stride,
                                          const T* __restrict__ x, long long x_stride,
                                          const uint4* __restrict__ qw,
                                          const T* __restrict__ scales,
                                          const T* __restrict__ zeros, const T* __restrict__ bias,
                                          float* __restrict__ ws, int* __restrict__ counters,
                                          int M, int N, int K, int Kp, int Np, int group,
                                          int split_stages, const TmaMap* x_map = nullptr) {
#if PS_HAS_WGMMA
  static_assert(TOK == 64 || TOK == 128 || TOK == 256, "one m64nTOK wgmma a k16 step");
  using C = WtCfg<TOK>;
  // Launched with 168 registers a thread (384 threads, 1 CTA per SM); the producer gives back
  // 128 x (168 - 56), which is what the consumers take: 256 x (224 - 168).
  constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long s_bar[2 * C::STAGES];  // full[b], then empty[b]
  const unsigned int smem0 = wgt_smem0<TOK>(smem_raw);
  unsigned char* const smem = smem_raw + (smem0 - ps::smem_addr(smem_raw));
  const unsigned int bars = ps::smem_addr(s_bar);
  const int tid = threadIdx.x, ncta = blockIdx.x, m0 = blockIdx.z * TOK;
  const int s0 = blockIdx.y * split_stages, nst = min(Kp / STAGE_K - s0, split_stages);
  wgt_init_bars<TOK, CTA_N, CS>(bars);

  if (tid >= THREADS) {
    ps::setmaxnreg_dec<PRODUCER_REGS>();
    wgt_producer<T, TOK, CTA_N, CS>(tid - THREADS, ncta, m0, s0, nst, smem0, bars, x, x_stride,
                                    qw, scales, zeros, M, K, Kp, Np, group, x_map);
    // the cluster's closing barrier (the consumers') counts the producers in before they leave
    if constexpr (CS > 1) cluster_arrive();
    return;
  }
  ps::grid_dependency_wait();  // the consumers write y and the workspace: after that kernel
  ps::launch_dependents();
  ps::setmaxnreg_inc<CONSUMER_REGS>();
  PS_TRACE_RUN(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), 0);

  // c by shuffle: provably warp-uniform, so the descriptors stay in uniform registers
  const int c = __shfl_sync(0xffffffffu, tid >> 7, 0), w = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3, nbl = 2 * c + (w >> 1), h = w & 1;
  const bool has_zeros = zeros != nullptr;
  float acc[TOK / 2];
#pragma unroll
  for (int r = 0; r < TOK / 2; ++r) acc[r] = 0.f;

  auto step = [&](int i, unsigned int (&a)[4][4]) {
    wgt_step<T, TOK, CS>(i, i > 0, a, acc, bars, smem0, smem, nbl, h, lane, g, has_zeros);
  };
  unsigned int a0[4][4], a1[4][4];  // stage i's fragments live until its MMAs retire
  int i = 0;
  for (; i + 1 < nst; i += 2) {
    step(i, a0);
    step(i + 1, a1);
  }
  if (i < nst) step(i, a0);
  ps::wgmma_wait<0>();
  ps::fence_regs(acc);
  PS_TRACE_RETIRED();
  sync_threads<true>();  // both warpgroups' MMAs retired: the stage buffers hold the output

  // The fp32 tile [TOK][CTA_N], then out by rows (store_tile).
  float* out = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < TOK / 2; ++r) {
    const int n = 64 * c + 16 * w + g + 8 * ((r >> 1) & 1);
    const int m = 8 * (r >> 2) + 2 * t + (r & 1);
    out[m * C::OUT_STRIDE + n] = acc[r];
  }
  sync_threads<true>();
  store_tile<T, TOK, C::OUT_STRIDE, true>(out, y, y_stride, bias, ws, counters, M, N, m0, tid,
                                          ncta, blockIdx.y);
  PS_TRACE_OUT(nst, TRACE_STORED);
  // No CTA of a cluster leaves while another may still arrive at its empty barriers.
  if constexpr (CS > 1) cluster_sync();
#else
  __trap();  // built without sm_90a: the launcher never picks this kernel then
#endif
}

// ---------------------------------------------------------------------------------------------
// Wide producer-fed tiles ("wgw", sm_90a): the wgt tile over 256 columns a CTA, TOK = 64 or 128
// rows. A product streams its x tile from L2 once for every column block: 256 columns a CTA read
// x half as often for the same MMAs (each weight is read and dequantized once a row tile, as in
// the 128-row wgt tile); tuning takes it for the shapes and row counts where it times fastest.
// Consumer warpgroup c takes columns 128c ..
// 128c + 127 as two m64 halves u, each one m64nTOK wgmma group a stage: its warp w dequantizes
// half w & 1 of n32 block 4c + 2u + (w >> 1). Half 1's fragments are dequantized while half 0's
// MMAs run and half 0's (of the next stage) while half 1's do; a stage's buffer goes back to the
// producer once its second group retires. The producer is wgt's (WtCfg<TOK, 256>); same packed
// weights, split K (grid: column blocks of 256, splits, row tiles) and epilogue as w4a16_wgt.
constexpr int WIDE_N = 2 * CTA_N;

template <typename T, int TOK>
__device__ __forceinline__ void w4a16_wgw(T* __restrict__ y, long long y_stride,
                                          const T* __restrict__ x, long long x_stride,
                                          const uint4* __restrict__ qw,
                                          const T* __restrict__ scales,
                                          const T* __restrict__ zeros, const T* __restrict__ bias,
                                          float* __restrict__ ws, int* __restrict__ counters,
                                          int M, int N, int K, int Kp, int Np, int group,
                                          int split_stages) {
#if PS_HAS_WGMMA
  static_assert(TOK == 64 || TOK == 128, "two m64nTOK accumulators a consumer thread");
  using C = WtCfg<TOK, WIDE_N>;
  // As w4a16_wgt: 168 registers a thread at launch, the producer's given to the consumers.
  constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long s_bar[2 * C::STAGES];  // full[b], then empty[b]
  const unsigned int smem0 = wgt_smem0<TOK, WIDE_N>(smem_raw);
  unsigned char* const smem = smem_raw + (smem0 - ps::smem_addr(smem_raw));
  const unsigned int bars = ps::smem_addr(s_bar);
  const int tid = threadIdx.x, ncta = blockIdx.x, m0 = blockIdx.z * TOK;
  const int s0 = blockIdx.y * split_stages, nst = min(Kp / STAGE_K - s0, split_stages);
  wgt_init_bars<TOK, WIDE_N>(bars);

  if (tid >= THREADS) {
    ps::setmaxnreg_dec<PRODUCER_REGS>();
    wgt_producer<T, TOK, WIDE_N>(tid - THREADS, ncta, m0, s0, nst, smem0, bars, x, x_stride, qw,
                                 scales, zeros, M, K, Kp, Np, group);
    return;
  }
  ps::grid_dependency_wait();  // the consumers write y and the workspace: after that kernel
  ps::launch_dependents();
  ps::setmaxnreg_inc<CONSUMER_REGS>();

  const int c = __shfl_sync(0xffffffffu, tid >> 7, 0), w = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3, h = w & 1;
  const int nbl0 = 4 * c + (w >> 1), nbl1 = nbl0 + 2;  // the halves' n32 blocks
  const bool has_zeros = zeros != nullptr;
  float acc0[TOK / 2], acc1[TOK / 2];
#pragma unroll
  for (int r = 0; r < TOK / 2; ++r) acc0[r] = acc1[r] = 0.f;

  unsigned int a0[4][4], a1[4][4];  // each half's fragments live until its group retires
  for (int i = 0; i < nst; ++i) {
    const int b = i % C::STAGES;
    ps::mbar_wait(bars + 8 * b, (i / C::STAGES) & 1);  // stage i landed
    ps::fence_proxy_async();  // cp.async writes -> visible to the tensor cores' (async) proxy
    const unsigned char* st = smem + b * C::STAGE_BYTES;
    const unsigned long long x_desc = ps::wg_desc(smem0 + b * C::STAGE_BYTES, 16, 1024);
    wgt_dequant<T, TOK, WIDE_N>(st, nbl0, h, lane, g, has_zeros, a0);  // i - 1's half 0 retired
    wgt_group<T, TOK>(acc0, a0, x_desc);
    ps::wgmma_wait<1>();  // stage i - 1's half 1 retired: a1 and that stage's buffer are free
    ps::fence_regs(acc1);
    if (i > 0) ps::mbar_arrive(bars + 8 * (C::STAGES + (i - 1) % C::STAGES));
    wgt_dequant<T, TOK, WIDE_N>(st, nbl1, h, lane, g, has_zeros, a1);
    wgt_group<T, TOK>(acc1, a1, x_desc);
    ps::wgmma_wait<1>();  // this stage's half 0 retired: a0 is free
    ps::fence_regs(acc0);
  }
  ps::wgmma_wait<0>();
  ps::fence_regs(acc0);
  ps::fence_regs(acc1);
  sync_threads<true>();  // both warpgroups' MMAs retired: the stage buffers hold the output

  // The fp32 tile [TOK][WIDE_N], then out by rows (store_tile).
  float* out = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < TOK / 2; ++r) {
    const int n = 128 * c + 16 * w + g + 8 * ((r >> 1) & 1);
    const int m = 8 * (r >> 2) + 2 * t + (r & 1);
    out[m * C::OUT_STRIDE + n] = acc0[r];
    out[m * C::OUT_STRIDE + n + 64] = acc1[r];
  }
  sync_threads<true>();
  store_tile<T, TOK, C::OUT_STRIDE, true, WIDE_N>(out, y, y_stride, bias, ws, counters, M, N, m0,
                                                 tid, ncta, blockIdx.y);
#else
  __trap();  // built without sm_90a: the launcher never picks this kernel then
#endif
}

// Stream-K on the wgt tile ("wgs", sm_90a): a persistent grid, each CTA an equal run of the
// (tile, k-stage) units in tile order (tile t: row tile t / column blocks, column block t %
// column blocks), so that no SM idles through a last partial wave. Producer and consumers run
// on across tiles without draining the pipeline; a tile leaves from registers (the stage
// buffers are already refilled for the next). A shared tile: the CTA holding its first stages
// (the head, whose share ends in it, so it finishes there last) adds the others' fp32 parts to
// its own accumulators and stores y; the others each write their part into their own slot of
// `ws` (slot 0 for the first tile of their share, 1 for the last: a share holds at most two
// shared tiles) and count themselves in (counters[tile]). A head that finds a part missing
// writes its own and counts in too, and the last to count in sums. Either way the parts are
// added in CTA order from zero, so the result does not depend on who sums. `ws` holds 2 x
// gridDim.x x TOK x CTA_N floats. The tiles are `blocks` column blocks from the pointers' first
// column: a whole product's, or the rest after the whole waves of another tile (quant.py's
// last_wave "stream"); Np stays the weights' and scales' row stride.
__device__ __forceinline__ long long wgs_start(long long units, int cta, int ctas) {
  return units * cta / ctas;
}
__device__ __forceinline__ int wgs_cta_of(long long u, long long units, int ctas) {
  int c = (int)(u * ctas / units);
  while (c + 1 < ctas && wgs_start(units, c + 1, ctas) <= u) ++c;
  while (c > 0 && wgs_start(units, c, ctas) > u) --c;
  return c;
}

// The next run of a share's units [u, u1) within one tile: (tile, first stage, stage end) into
// the last three and u past it; false at the share's end.
__device__ __forceinline__ bool wgs_next(int S, long long u1, long long& u, int& tile, int& sb,
                                         int& se) {
  if (u >= u1) return false;
  tile = (int)(u / S);
  sb = (int)(u - (long long)tile * S);
  se = (int)min((long long)S, sb + (u1 - u));
  u += se - sb;
  return true;
}

template <typename T, int TOK>
__device__ __forceinline__ void wgs_store(T* __restrict__ y, long long y_stride,
                                          const T* __restrict__ bias, const float (&acc)[TOK / 2],
                                          int M, int N, int m0, int n0, int c, int w, int g,
                                          int t) {
#pragma unroll
  for (int r = 0; r < TOK / 2; ++r) {
    const int n = n0 + 64 * c + 16 * w + g + 8 * ((r >> 1) & 1);
    const int m = m0 + 8 * (r >> 2) + 2 * t + (r & 1);
    if (m < M && n < N)  // rounded once to nearest, as store2's pairs
      y[(long long)m * y_stride + n] =
          T(bias != nullptr ? acc[r] + static_cast<float>(bias[n]) : acc[r]);
  }
}

// A thread's offset of accumulator r in a TOK x CTA_N fp32 part.
template <int TOK>
__device__ __forceinline__ int wgs_part_at(int r, int c, int w, int g, int t) {
  return (8 * (r >> 2) + 2 * t + (r & 1)) * CTA_N + 64 * c + 16 * w + g + 8 * ((r >> 1) & 1);
}

// acc += the part at src, 32 loads in flight before their adds.
template <int TOK>
__device__ __forceinline__ void wgs_take_part(float (&acc)[TOK / 2], const float* src, int c,
                                              int w, int g, int t) {
  constexpr int BATCH = TOK == 256 ? 16 : 32;
#pragma unroll
  for (int r0 = 0; r0 < TOK / 2; r0 += BATCH) {
    float v[BATCH];
#pragma unroll
    for (int j = 0; j < BATCH; ++j) v[j] = __ldcg(src + wgs_part_at<TOK>(r0 + j, c, w, g, t));
#pragma unroll
    for (int j = 0; j < BATCH; ++j) acc[r0 + j] += v[j];
  }
}

template <typename T, int TOK>
__device__ __forceinline__ void w4a16_wgs(T* __restrict__ y, long long y_stride,
                                          const T* __restrict__ x, long long x_stride,
                                          const uint4* __restrict__ qw,
                                          const T* __restrict__ scales,
                                          const T* __restrict__ zeros, const T* __restrict__ bias,
                                          float* __restrict__ ws, int* __restrict__ counters,
                                          int M, int N, int K, int Kp, int Np, int group,
                                          int blocks) {
#if PS_HAS_WGMMA
  using C = WtCfg<TOK>;
  constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long s_bar[2 * C::STAGES];  // full[b], then empty[b]
  __shared__ int s_last;
  const unsigned int smem0 = wgt_smem0<TOK>(smem_raw);
  unsigned char* const smem = smem_raw + (smem0 - ps::smem_addr(smem_raw));
  const unsigned int bars = ps::smem_addr(s_bar);
  const int tid = threadIdx.x, cta = blockIdx.x, ctas = gridDim.x;
  const int S = Kp / STAGE_K, NBK = blocks;
  const long long units = (long long)NBK * ((M + TOK - 1) / TOK) * S;
  const long long u1 = wgs_start(units, cta + 1, ctas);
  wgt_init_bars<TOK>(bars);

  if (tid >= THREADS) {  // the producer, through every run of the CTA's work
    ps::setmaxnreg_dec<PRODUCER_REGS>();
    const int gshift = wgt_gshift(group);
    int i = 0, tile, sb, se;
    long long u = wgs_start(units, cta, ctas);
    // the first fill's weights before waiting for the kernel before this one, as in w4a16_wgt
    while (i < C::STAGES && wgs_next(S, u1, u, tile, sb, se))
      for (int s = sb; s < se && i < C::STAGES; ++s, ++i)
        wgt_load_weights<T, TOK>(smem0 + i * C::STAGE_BYTES, s, tid - THREADS, tile % NBK, qw,
                                 scales, zeros, Kp >> 5, Np >> 5, group, gshift);
    const int pre = i;
    ps::grid_dependency_wait();
    ps::launch_dependents();
    i = 0;
    u = wgs_start(units, cta, ctas);
    while (wgs_next(S, u1, u, tile, sb, se))
      for (int s = sb; s < se; ++s, ++i)
        wgt_produce<T, TOK>(i, s, tid - THREADS, tile % NBK, (tile / NBK) * TOK, smem0, bars, x,
                            x_stride, qw, scales, zeros, M, K, Kp, Np, group, gshift, i < pre);
    ps::cp_async_commit();
    ps::cp_async_wait<0>();
    return;
  }
  ps::grid_dependency_wait();  // as in w4a16_wgt
  ps::launch_dependents();
  ps::setmaxnreg_inc<CONSUMER_REGS>();

  const int c = __shfl_sync(0xffffffffu, tid >> 7, 0), w = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3, nbl = 2 * c + (w >> 1), h = w & 1;
  const bool has_zeros = zeros != nullptr;
  float acc[TOK / 2];
  unsigned int a0[4][4], a1[4][4];
  int i = 0, tile, sb, se;
#ifdef PS_QUANT_TRACE
  int run = 0;
#endif
  long long u = wgs_start(units, cta, ctas);
  while (wgs_next(S, u1, u, tile, sb, se)) {
    PS_TRACE_RUN(cta, run++);
    const int n0 = (tile % NBK) * CTA_N, m0 = (tile / NBK) * TOK;
#pragma unroll
    for (int r = 0; r < TOK / 2; ++r) acc[r] = 0.f;
    // the previous run's last buffer was released after its MMAs retired: not again
    const int i0 = i, i1 = i + (se - sb);
    for (; i + 1 < i1; i += 2) {
      wgt_step<T, TOK>(i, i > i0, a0, acc, bars, smem0, smem, nbl, h, lane, g, has_zeros);
      wgt_step<T, TOK>(i + 1, true, a1, acc, bars, smem0, smem, nbl, h, lane, g, has_zeros);
    }
    if (i < i1) {
      wgt_step<T, TOK>(i, i > i0, a0, acc, bars, smem0, smem, nbl, h, lane, g, has_zeros);
      ++i;
    }
    ps::wgmma_wait<0>();
    ps::fence_regs(acc);
    PS_TRACE_RETIRED();
    ps::mbar_arrive(bars + 8 * (C::STAGES + (i1 - 1) % C::STAGES));
    if (sb == 0 && se == S) {  // a whole tile
      wgs_store<T, TOK>(y, y_stride, bias, acc, M, N, m0, n0, c, w, g, t);
      PS_TRACE_OUT(se - sb, TRACE_STORED);
      continue;
    }
    const long long tile_u = (long long)tile * S;
    const int first = wgs_cta_of(tile_u, units, ctas);
    const int last = wgs_cta_of(tile_u + S - 1, units, ctas);
    // CTA k's part: slot 0 when the tile is its share's first, else 1
    auto part_of = [&](int k) {
      return ws + (size_t)(2 * k + (wgs_start(units, k, ctas) >= tile_u ? 0 : 1)) * TOK * CTA_N;
    };
    int from = first;  // the first part to add from ws
    if (sb == 0) {  // the head: when every other part is in, it adds them to its own
      sync_threads<true>();  // everyone has read s_last's previous value
      if (tid == 0) {
        s_last = atomicAdd(counters + tile, 0) == last - first;
        if (s_last) counters[tile] = 0;  // every share has counted: ready for the next launch
      }
      sync_threads<true>();
      if (s_last) from = first + 1;
    }
    if (from == first) {  // count in with a part; the last to do so sums
      float* part = part_of(cta);
#pragma unroll
      for (int r = 0; r < TOK / 2; ++r) part[wgs_part_at<TOK>(r, c, w, g, t)] = acc[r];
      __threadfence();  // the part visible device-wide before this CTA counts itself in
      sync_threads<true>();
      if (tid == 0) {
        s_last = atomicAdd(counters + tile, 1) == last - first;
        if (s_last) counters[tile] = 0;
      }
      sync_threads<true>();
      if (!s_last) {
        PS_TRACE_OUT(se - sb, TRACE_PART);
        continue;
      }
    }
    __threadfence();
#pragma unroll
    for (int r = 0; r < TOK / 2; ++r) acc[r] = from == first ? 0.f : 0.f + acc[r];  // same bits
    for (int k = from; k <= last; ++k) wgs_take_part<TOK>(acc, part_of(k), c, w, g, t);
    wgs_store<T, TOK>(y, y_stride, bias, acc, M, N, m0, n0, c, w, g, t);
    PS_TRACE_OUT(se - sb, from == first ? TRACE_LAST_SUM : TRACE_HEAD_SUM);
  }
#else
  __trap();  // built without sm_90a: the launcher never picks this kernel then
#endif
}

}  // namespace ps_quant

#define PS_QUANT_ENTRY(NAME, T, MT, MIN_CTAS, CLUSTER)                                         \
  extern "C" __global__ void __launch_bounds__(ps_quant::THREADS, MIN_CTAS)                    \
      NAME(T* y, long long y_stride, const T* x, long long x_stride, const uint4* qw,          \
           const T* scales, const T* zeros, const T* bias, float* ws, int* counters, int M,    \
           int N, int K, int Kp, int Np, int group, int split_stages) {                        \
    ps_quant::w4a16<T, MT, CLUSTER>(y, y_stride, x, x_stride, qw, scales, zeros, bias, ws,     \
                                    counters, M, N, K, Kp, Np, group, split_stages);           \
  }
#define PS_QUANT_PRODUCT(NAME, T, MT, MIN_CTAS) PS_QUANT_ENTRY(NAME, T, MT, MIN_CTAS, false)
// 16 rows: four CTAs an SM (at most 64 registers), as many as their shared memory allows.
PS_QUANT_PRODUCT(w4a16_bf16_m16, __nv_bfloat16, 1, 4)
PS_QUANT_PRODUCT(w4a16_bf16_m32, __nv_bfloat16, 2, 2)
PS_QUANT_PRODUCT(w4a16_bf16_m64, __nv_bfloat16, 4, 1)
PS_QUANT_PRODUCT(w4a16_fp16_m16, __half, 1, 4)
PS_QUANT_PRODUCT(w4a16_fp16_m32, __half, 2, 2)
PS_QUANT_PRODUCT(w4a16_fp16_m64, __half, 4, 1)
// 128 rows a CTA: the weight tile dequantized once for twice the rows, at one CTA an SM (its
// accumulators); quant.py takes it from the row count tune_dequant_rows measures it faster.
PS_QUANT_PRODUCT(w4a16_bf16_m128, __nv_bfloat16, 8, 1)
PS_QUANT_PRODUCT(w4a16_fp16_m128, __half, 8, 1)

#ifdef PS_QUANT_CLUSTER
// Candidates (module "quant_cluster", built on demand): the 16- and 32-row tiles summing their K
// parts through a cluster (cluster_splits); quant.py launches them as clusters of (1, splits, 1)
// with at most 8 parts.
#define PS_QUANT_PRODUCT_CL(NAME, T, MT, MIN_CTAS) PS_QUANT_ENTRY(NAME, T, MT, MIN_CTAS, true)
PS_QUANT_PRODUCT_CL(w4a16_cl_bf16_m16, __nv_bfloat16, 1, 4)
PS_QUANT_PRODUCT_CL(w4a16_cl_bf16_m32, __nv_bfloat16, 2, 2)
PS_QUANT_PRODUCT_CL(w4a16_cl_fp16_m16, __half, 1, 4)
PS_QUANT_PRODUCT_CL(w4a16_cl_fp16_m32, __half, 2, 2)
#endif

#define PS_QUANT_PRODUCT_WG(NAME, T, MT, MIN_CTAS)                                            \
  extern "C" __global__ void __launch_bounds__(ps_quant::THREADS, MIN_CTAS)                    \
      NAME(T* y, long long y_stride, const T* x, long long x_stride, const uint4* qw,          \
           const T* scales, const T* zeros, const T* bias, float* ws, int* counters, int M,    \
           int N, int K, int Kp, int Np, int group, int split_stages) {                        \
    ps_quant::w4a16_wg<T, MT>(y, y_stride, x, x_stride, qw, scales, zeros, bias, ws, counters, \
                              M, N, K, Kp, Np, group, split_stages);                           \
  }
// wgmma (sm_90a): quant.py offers them to tuning on Hopper, which keeps those that agree with
// w4a16_*_m64 and are faster at a row count.
PS_QUANT_PRODUCT_WG(w4a16_wgp_bf16_m64, __nv_bfloat16, 4, 2)
PS_QUANT_PRODUCT_WG(w4a16_wgp_bf16_m128, __nv_bfloat16, 8, 1)
PS_QUANT_PRODUCT_WG(w4a16_wgp_fp16_m64, __half, 4, 2)
PS_QUANT_PRODUCT_WG(w4a16_wgp_fp16_m128, __half, 8, 1)

#define PS_QUANT_PRODUCT_WGT(NAME, T, TOK)                                                    \
  extern "C" __global__ void __launch_bounds__(ps_quant::WtCfg<TOK>::BLOCK, 1)                  \
      NAME(T* y, long long y_stride, const T* x, long long x_stride, const uint4* qw,          \
           const T* scales, const T* zeros, const T* bias, float* ws, int* counters, int M,    \
           int N, int K, int Kp, int Np, int group, int split_stages) {                        \
    ps_quant::w4a16_wgt<T, TOK>(y, y_stride, x, x_stride, qw, scales, zeros, bias, ws,          \
                                counters, M, N, K, Kp, Np, group, split_stages);               \
  }
// 64, 128, 256 rows a CTA, 384 threads (a producer warpgroup): offered to tuning on Hopper.
PS_QUANT_PRODUCT_WGT(w4a16_wgt_bf16_m64, __nv_bfloat16, 64)
PS_QUANT_PRODUCT_WGT(w4a16_wgt_bf16_m128, __nv_bfloat16, 128)
PS_QUANT_PRODUCT_WGT(w4a16_wgt_bf16_m256, __nv_bfloat16, 256)
PS_QUANT_PRODUCT_WGT(w4a16_wgt_fp16_m64, __half, 64)
PS_QUANT_PRODUCT_WGT(w4a16_wgt_fp16_m128, __half, 128)
PS_QUANT_PRODUCT_WGT(w4a16_wgt_fp16_m256, __half, 256)

#define PS_QUANT_PRODUCT_WGM(NAME, T, TOK, CS)                                                \
  extern "C" __global__ void __launch_bounds__(ps_quant::WtCfg<TOK>::BLOCK, 1)                  \
      NAME(T* y, long long y_stride, const T* x, long long x_stride, const uint4* qw,          \
           const T* scales, const T* zeros, const T* bias, float* ws, int* counters, int M,    \
           int N, int K, int Kp, int Np, int group, int split_stages,                          \
           const __grid_constant__ ps_quant::TmaMap x_map) {                                   \
    ps_quant::w4a16_wgt<T, TOK, CS>(y, y_stride, x, x_stride, qw, scales, zeros, bias, ws,      \
                                    counters, M, N, K, Kp, Np, group, split_stages, &x_map);   \
  }
// The 128- and 256-row wgt tiles in clusters of 2 ("wgm") or 4 ("wgq") column blocks sharing x
// through multicast loads (wgt_load_x_mc): offered to tuning on Hopper, launched as clusters.
PS_QUANT_PRODUCT_WGM(w4a16_wgm_bf16_m128, __nv_bfloat16, 128, 2)
PS_QUANT_PRODUCT_WGM(w4a16_wgm_bf16_m256, __nv_bfloat16, 256, 2)
PS_QUANT_PRODUCT_WGM(w4a16_wgm_fp16_m128, __half, 128, 2)
PS_QUANT_PRODUCT_WGM(w4a16_wgm_fp16_m256, __half, 256, 2)
PS_QUANT_PRODUCT_WGM(w4a16_wgq_bf16_m128, __nv_bfloat16, 128, 4)
PS_QUANT_PRODUCT_WGM(w4a16_wgq_bf16_m256, __nv_bfloat16, 256, 4)
PS_QUANT_PRODUCT_WGM(w4a16_wgq_fp16_m128, __half, 128, 4)
PS_QUANT_PRODUCT_WGM(w4a16_wgq_fp16_m256, __half, 256, 4)

#define PS_QUANT_PRODUCT_WGW(NAME, T, TOK)                                                    \
  extern "C" __global__ void __launch_bounds__(ps_quant::WtCfg<TOK, ps_quant::WIDE_N>::BLOCK, 1)                  \
      NAME(T* y, long long y_stride, const T* x, long long x_stride, const uint4* qw,          \
           const T* scales, const T* zeros, const T* bias, float* ws, int* counters, int M,    \
           int N, int K, int Kp, int Np, int group, int split_stages) {                        \
    ps_quant::w4a16_wgw<T, TOK>(y, y_stride, x, x_stride, qw, scales, zeros, bias, ws,          \
                                counters, M, N, K, Kp, Np, group, split_stages);               \
  }
// 256 columns a CTA at 64 or 128 rows: a wide product's x is read from L2 by half as many
// column blocks.
PS_QUANT_PRODUCT_WGW(w4a16_wgw_bf16_m64, __nv_bfloat16, 64)
PS_QUANT_PRODUCT_WGW(w4a16_wgw_bf16_m128, __nv_bfloat16, 128)
PS_QUANT_PRODUCT_WGW(w4a16_wgw_fp16_m64, __half, 64)
PS_QUANT_PRODUCT_WGW(w4a16_wgw_fp16_m128, __half, 128)

#define PS_QUANT_PRODUCT_WGS(NAME, T, TOK)                                                    \
  extern "C" __global__ void __launch_bounds__(ps_quant::WtCfg<TOK>::BLOCK, 1)                  \
      NAME(T* y, long long y_stride, const T* x, long long x_stride, const uint4* qw,          \
           const T* scales, const T* zeros, const T* bias, float* ws, int* counters, int M,    \
           int N, int K, int Kp, int Np, int group, int blocks) {                              \
    ps_quant::w4a16_wgs<T, TOK>(y, y_stride, x, x_stride, qw, scales, zeros, bias, ws,          \
                                counters, M, N, K, Kp, Np, group, blocks);                     \
  }
// Stream-K over the same tiles, a grid of one CTA an SM: candidate tiles (quant.py).
PS_QUANT_PRODUCT_WGS(w4a16_wgs_bf16_m64, __nv_bfloat16, 64)
PS_QUANT_PRODUCT_WGS(w4a16_wgs_bf16_m128, __nv_bfloat16, 128)
PS_QUANT_PRODUCT_WGS(w4a16_wgs_bf16_m256, __nv_bfloat16, 256)
PS_QUANT_PRODUCT_WGS(w4a16_wgs_fp16_m64, __half, 64)
PS_QUANT_PRODUCT_WGS(w4a16_wgs_fp16_m128, __half, 128)
PS_QUANT_PRODUCT_WGS(w4a16_wgs_fp16_m256, __half, 256)

#define PS_QUANT_DEQUANT(NAME, T)                                                              \
  extern "C" __global__ void __launch_bounds__(256)                                            \
      NAME(T* w, const uint4* qw, const T* scales, const T* zeros, int N, int K, int Kp,       \
           int Np, int group) {                                                                \
    ps_quant::dequant<T>(w, qw, scales, zeros, N, K, Kp, Np, group);                           \
  }
PS_QUANT_DEQUANT(w4_dequant_bf16, __nv_bfloat16)
PS_QUANT_DEQUANT(w4_dequant_fp16, __half)
