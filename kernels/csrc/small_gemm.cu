// Small-M matrix product for decode steps: y[M, N] = x[M, K] . w[N, K]^T, M <= 128 (a decode
// batch's rows), bf16/fp16 in, fp32 accumulation, one rounding to the dtype. Memory-bound on the
// weights: every CTA streams 128 rows of w over its share of K through a multi-stage cp.async
// pipeline and multiplies them on wgmma with the rows swapped (w is the m64 A operand, x's MT
// padded rows the n operand, both K-major in the 128-byte-swizzle layout of the prefill kernel),
// so M needs no 64-row tile. Split-K over gridDim.y for occupancy: each split writes its fp32
// partial tile (in accumulator order, coalesced) to a workspace, and the split that finishes last
// (a per-tile counter) adds all of them in split order (fixed: results do not depend on which
// split finishes last), rounds once and writes y; it then resets the counter, so a CUDA graph can
// replay the launch. Workspace and counters belong to one stream at a time.
#include "common.cuh"

namespace ps_gemm {
using namespace ps;

template <typename T> __device__ __forceinline__ T round_to(float v);
template <> __device__ __forceinline__ __nv_bfloat16 round_to<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half round_to<__half>(float v) { return __float2half_rn(v); }

constexpr int kThreads = 128;  // one warpgroup
constexpr int kRows = 128;     // w rows per CTA: two m64 blocks
constexpr int kChunk = 64;     // K elements per stage (one 128-byte swizzled row)

#if PS_HAS_WGMMA
__device__ __forceinline__ void wgmma_ss_m64n16_acc(float (&d)[8], unsigned long long da, unsigned long long db, __nv_bfloat16) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_ss_m64n16_acc(float (&d)[8], unsigned long long da, unsigned long long db, __half) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_ss_m64n32_acc(float (&d)[16], unsigned long long da, unsigned long long db, __nv_bfloat16) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_ss_m64n32_acc(float (&d)[16], unsigned long long da, unsigned long long db, __half) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_ss_m64n64_acc(float (&d)[32], unsigned long long da, unsigned long long db, __nv_bfloat16) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_ss_m64n64_acc(float (&d)[32], unsigned long long da, unsigned long long db, __half) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_ss_m64n128_acc(float (&d)[64], unsigned long long da, unsigned long long db, __nv_bfloat16) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_ss_m64n128_acc(float (&d)[64], unsigned long long da, unsigned long long db, __half) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db));
}

template <int MT, typename T>
__device__ __forceinline__ void mma(float (&d)[MT / 2], unsigned long long da, unsigned long long db) {
  if constexpr (MT == 16) wgmma_ss_m64n16_acc(d, da, db, T());
  else if constexpr (MT == 32) wgmma_ss_m64n32_acc(d, da, db, T());
  else if constexpr (MT == 64) wgmma_ss_m64n64_acc(d, da, db, T());
  else wgmma_ss_m64n128_acc(d, da, db, T());
}
#endif

template <int MT>
struct Shape {
  static constexpr int kStages = MT == 128 ? 3 : 4;
  static constexpr unsigned int kWBytes = kRows * 128;
  static constexpr unsigned int kStageBytes = kWBytes + MT * 128;  // multiples of 1024
  static constexpr unsigned int kSmem = kStages * kStageBytes + 1024;  // + alignment slack
  static constexpr int kAcc = MT / 2;  // fp32 accumulators per thread per m64 block
};

// grid (N / 128, splits); block 128; dynamic smem Shape<MT>::kSmem.
template <typename T, int MT>
__device__ __forceinline__ void small_gemm_impl(
    const T* __restrict__ x, long long ldx, const T* __restrict__ w, T* __restrict__ y,
    long long ldy, int m, int k, float* __restrict__ workspace, int* __restrict__ counters) {
#if PS_HAS_WGMMA
  using S = Shape<MT>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ int s_last;
  const unsigned int raw_addr = smem_addr(smem_raw);
  const unsigned int base = (raw_addr + 1023u) & ~1023u;
  unsigned char* const base_ptr = smem_raw + (base - raw_addr);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const long long n0 = (long long)tile * kRows;
  const int chunks = k / kChunk;
  const int c_begin = (int)((long long)chunks * split / splits);
  const int c_end = (int)((long long)chunks * (split + 1) / splits);
  const int n_chunks = c_end - c_begin;
  const int ld_ch = tid & 7, ld_row = tid >> 3;  // 16 rows x 8 chunks of 16 bytes per pass

  auto load = [&](int c, int stage) {
    const unsigned int sw = base + stage * S::kStageBytes, sx = sw + S::kWBytes;
    const long long k0 = (long long)(c_begin + c) * kChunk + ld_ch * 8;
#pragma unroll
    for (int i = 0; i < kRows / 16; ++i) {
      const int r = ld_row + i * 16;
      cp_async16(sw + sw128_off(r, ld_ch, kRows), w + (n0 + r) * k + k0, 16);
    }
#pragma unroll
    for (int i = 0; i < (MT + 15) / 16; ++i) {
      const int r = ld_row + i * 16;
      if (r < MT) {
        const bool ok = r < m;
        cp_async16(sx + sw128_off(r, ld_ch, MT), ok ? x + r * ldx + k0 : x, ok ? 16 : 0);
      }
    }
  };

  float acc[2][S::kAcc];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < S::kAcc; ++i) acc[b][i] = 0.f;

#pragma unroll
  for (int c = 0; c < S::kStages - 1; ++c) {
    if (c < n_chunks) load(c, c);
    cp_async_commit();
  }
  for (int c = 0; c < n_chunks; ++c) {
    cp_async_wait<S::kStages - 2>();
    fence_proxy_async();  // cp.async writes -> visible to the tensor cores' (async) proxy
    __syncthreads();      // chunk c landed for all threads; the stage read at c - 1 is free
    if (c + S::kStages - 1 < n_chunks) load(c + S::kStages - 1, (c + S::kStages - 1) % S::kStages);
    cp_async_commit();
    const unsigned int sw = base + (c % S::kStages) * S::kStageBytes, sx = sw + S::kWBytes;
    const unsigned long long x_desc = wg_desc(sx, 16, 1024);
    fence_regs(acc[0]);
    fence_regs(acc[1]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      mma<MT, T>(acc[0], wg_desc(sw, 16, 1024) + kk * 2, x_desc + kk * 2);
      mma<MT, T>(acc[1], wg_desc(sw + 64 * 128, 16, 1024) + kk * 2, x_desc + kk * 2);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc[0]);
    fence_regs(acc[1]);
  }
  cp_async_wait<0>();

  if (splits > 1) {
    // This split's partial tile, in accumulator order: float4 q of thread t at [q][t].
    float4* part = reinterpret_cast<float4*>(workspace) +
                   ((long long)tile * splits + split) * (kThreads * S::kAcc / 2);
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int q = 0; q < S::kAcc / 4; ++q)
        part[(b * (S::kAcc / 4) + q) * kThreads + tid] =
            make_float4(acc[b][4 * q], acc[b][4 * q + 1], acc[b][4 * q + 2], acc[b][4 * q + 3]);
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(counters + tile, 1) == splits - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const float4* all = reinterpret_cast<const float4*>(workspace) +
                        (long long)tile * splits * (kThreads * S::kAcc / 2);
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int q = 0; q < S::kAcc / 4; ++q) {
        float4 sum = __ldcg(all + (b * (S::kAcc / 4) + q) * kThreads + tid);
        for (int s = 1; s < splits; ++s) {
          const float4 v = __ldcg(all + ((long long)s * 2 * (S::kAcc / 4) + b * (S::kAcc / 4) + q) *
                                            kThreads + tid);
          sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
        }
        acc[b][4 * q] = sum.x; acc[b][4 * q + 1] = sum.y;
        acc[b][4 * q + 2] = sum.z; acc[b][4 * q + 3] = sum.w;
      }
    if (tid == 0) counters[tile] = 0;  // ready for the next launch (graph replays included)
  }

  // Round once and stage y's tile as [MT tokens][128 outputs] in smem, then 16-byte stores.
  __syncthreads();  // every thread is past its last wgmma: the pipeline's smem is free
  T* out = reinterpret_cast<T*>(base_ptr);
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < S::kAcc; ++i) {
      const int j = i >> 2, e = i & 3;
      const int row = b * 64 + warp * 16 + g + ((e & 2) ? 8 : 0);  // output column n - n0
      const int tok = 8 * j + 2 * t4 + (e & 1);
      out[tok * kRows + row] = round_to<T>(acc[b][i]);
    }
  __syncthreads();
  for (int v = tid; v < MT * (kRows / 8); v += kThreads) {
    const int tok = v / (kRows / 8), c = v % (kRows / 8);
    if (tok < m)
      *reinterpret_cast<uint4*>(y + tok * ldy + n0 + c * 8) =
          *reinterpret_cast<const uint4*>(out + tok * kRows + c * 8);
  }
#endif
}

}  // namespace ps_gemm

#define PS_SMALL_GEMM(NAME, T, MT)                                                               \
  extern "C" __global__ void __launch_bounds__(ps_gemm::kThreads)                                \
      small_gemm_##NAME##_m##MT(const T* x, long long ldx, const T* w, T* y, long long ldy,     \
                                int m, int k, float* workspace, int* counters) {                 \
    ps_gemm::small_gemm_impl<T, MT>(x, ldx, w, y, ldy, m, k, workspace, counters);               \
  }
PS_SMALL_GEMM(bf16, __nv_bfloat16, 16)
PS_SMALL_GEMM(bf16, __nv_bfloat16, 32)
PS_SMALL_GEMM(bf16, __nv_bfloat16, 64)
PS_SMALL_GEMM(bf16, __nv_bfloat16, 128)
PS_SMALL_GEMM(fp16, __half, 16)
PS_SMALL_GEMM(fp16, __half, 32)
PS_SMALL_GEMM(fp16, __half, 64)
PS_SMALL_GEMM(fp16, __half, 128)
