// The elementwise ops of the Llama forward, one launch each: RMSNorm (alone, or fused with the
// residual add, in place), RoPE (rotate-half or interleaved pairs, over the leading rotary_dim
// of each head) applied in place to the strided q/k views of the fused qkv output, and
// SiLU-and-mul; for an FP8 W8A8 product, the norm's or SiLU-and-mul's output (or any row)
// quantized per token instead of stored. bf16/fp16 storage, fp32 math, one rounding per stored
// value (the residual sum and the normalised value before the weight are rounded where torch
// rounds).
//
// Every kernel has a 16-byte vector path (8 elements per load) and a scalar path; the launcher
// picks the vector one (`vec` = 1) only when every row start it touches is 16-byte aligned and
// the widths it splits into vectors (rows; half of rotary_dim for RoPE) are multiples of 8, so
// the kernels never check alignment themselves.
#include "kv_fp8.cuh"

namespace ps_ops {

constexpr int kVec = 8;  // 2-byte elements per 16-byte vector

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// v rounded to T and back: what torch holds after an op whose result is stored in T.
template <typename T> __device__ __forceinline__ float round_to(float v) {
  return to_float<T>(from_float<T>(v));
}

// One 16-byte vector <-> 8 floats (element 2i in the low half of word i).
template <typename T> __device__ __forceinline__ void unpack8(const uint4 u, float (&f)[kVec]) {
  const float2 a = ps::Pack<T>::unpack(u.x), b = ps::Pack<T>::unpack(u.y);
  const float2 c = ps::Pack<T>::unpack(u.z), d = ps::Pack<T>::unpack(u.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}
template <typename T> __device__ __forceinline__ uint4 pack8(const float (&f)[kVec]) {
  uint4 u;
  u.x = ps::Pack<T>::two(f[0], f[1]);
  u.y = ps::Pack<T>::two(f[2], f[3]);
  u.z = ps::Pack<T>::two(f[4], f[5]);
  u.w = ps::Pack<T>::two(f[6], f[7]);
  return u;
}
__device__ __forceinline__ void load8(const float* p, float (&f)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// Sum over the CTA; every thread gets the total. blockDim.x must be a multiple of 32 (<= 1024);
// called once per kernel (the shared slots are not reused).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Max over the CTA, as block_sum (its own shared slots, so a kernel may call both once).
__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_maxes[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_maxes[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? warp_maxes[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A token row's first pass: rsqrt(mean(v^2) + eps) of v = x, or with ADD of v = residual =
// round(residual + x), which it stores (rms_norm_row's first pass). The passes after it re-read v
// (each thread only its own elements, so its own writes; L1/L2 hits).
template <typename T, bool ADD>
__device__ __forceinline__ float row_inv_rms(const T* x, T* r, int hidden, float eps, int vec) {
  float sumsq = 0.f;
  if (vec) {
    for (int i = threadIdx.x; i < hidden / kVec; i += blockDim.x) {
      float a[kVec];
      unpack8<T>(reinterpret_cast<const uint4*>(x)[i], a);
      if (ADD) {
        float b[kVec];
        unpack8<T>(reinterpret_cast<const uint4*>(r)[i], b);
#pragma unroll
        for (int e = 0; e < kVec; ++e) a[e] = round_to<T>(b[e] + a[e]);
        reinterpret_cast<uint4*>(r)[i] = pack8<T>(a);
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) sumsq += a[e] * a[e];
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      float a = to_float<T>(x[i]);
      if (ADD) {
        a = round_to<T>(to_float<T>(r[i]) + a);
        r[i] = from_float<T>(a);
      }
      sumsq += a * a;
    }
  }
  return rsqrtf(block_sum(sumsq) / (float)hidden + eps);
}

// One CTA per token row. ADD: residual = round(residual + x), then out = weight * round(residual *
// rsqrt(mean(residual^2) + eps)); else the same on x. The second pass re-reads the row (each
// thread only its own elements, so its own writes of the first pass; L1/L2 hits).
template <typename T, bool ADD>
__device__ __forceinline__ void rms_norm_row(T* out, long long out_stride, const T* in,
                                             long long in_stride, T* residual,
                                             long long residual_stride,
                                             const T* __restrict__ weight, int hidden, float eps,
                                             int vec) {
  const long long row = blockIdx.x;
  const T* x = in + row * in_stride;
  T* r = ADD ? residual + row * residual_stride : nullptr;
  T* y = out + row * out_stride;
  const float inv = row_inv_rms<T, ADD>(x, r, hidden, eps, vec);
  const T* src = ADD ? r : x;
  if (vec) {
    for (int i = threadIdx.x; i < hidden / kVec; i += blockDim.x) {
      float a[kVec], w[kVec];
      unpack8<T>(reinterpret_cast<const uint4*>(src)[i], a);
      unpack8<T>(reinterpret_cast<const uint4*>(weight)[i], w);
#pragma unroll
      for (int e = 0; e < kVec; ++e) a[e] = w[e] * round_to<T>(a[e] * inv);
      reinterpret_cast<uint4*>(y)[i] = pack8<T>(a);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      y[i] = from_float<T>(to_float<T>(weight[i]) * round_to<T>(to_float<T>(src[i]) * inv));
    }
  }
}

// Sources of a row's values for quantize_row_fp8, each value in float as the op would store it
// in T: eight(i, f) gives elements 8i..8i+7 (the 16-byte vector path), one(i) element i.
// The row as it is (quantize_fp8).
template <typename T> struct PlainRow {
  const T* x;
  __device__ __forceinline__ void eight(int i, float (&f)[kVec]) const {
    unpack8<T>(reinterpret_cast<const uint4*>(x)[i], f);
  }
  __device__ __forceinline__ float one(int i) const { return to_float<T>(x[i]); }
};

// rms_norm_row's stored values: round(w * round(x * inv)), from the row's inv (row_inv_rms).
template <typename T> struct NormedRow {
  const T* x;
  const T* w;  // the norm's weight, read-only for the kernel's life
  float inv;
  __device__ __forceinline__ void eight(int i, float (&f)[kVec]) const {
    float w8[kVec];
    unpack8<T>(reinterpret_cast<const uint4*>(x)[i], f);
    unpack8<T>(__ldg(reinterpret_cast<const uint4*>(w) + i), w8);
#pragma unroll
    for (int e = 0; e < kVec; ++e) f[e] = round_to<T>(w8[e] * round_to<T>(f[e] * inv));
  }
  __device__ __forceinline__ float one(int i) const {
    return round_to<T>(to_float<T>(w[i]) * round_to<T>(to_float<T>(x[i]) * inv));
  }
};

// A row's `width` values (src, as above) quantized for an FP8 W8A8 product with a dynamic
// scale per token, as reference.quantize_fp8 does: scale = max(amax / 448, min_scale) into
// *scale_out and q = e4m3(clamp(v * (1 / scale), +-448)), ties to even. Two passes over src
// (amax, then the bytes), so a source recomputes its values rather than holding the row;
// q: the row's `width` bytes, 8-byte aligned where vec. Called once per kernel (block_max).
template <typename Src>
__device__ __forceinline__ void quantize_row_fp8(const Src& src, unsigned char* q,
                                                 float* scale_out, int width, float min_scale,
                                                 int vec) {
  float amax = 0.f;
  if (vec) {
    for (int i = threadIdx.x; i < width / kVec; i += blockDim.x) {
      float f[kVec];
      src.eight(i, f);
#pragma unroll
      for (int e = 0; e < kVec; ++e) amax = fmaxf(amax, fabsf(f[e]));
    }
  } else {
    for (int i = threadIdx.x; i < width; i += blockDim.x) amax = fmaxf(amax, fabsf(src.one(i)));
  }
  const float scale = fmaxf(__fdiv_rn(block_max(amax), 448.f), min_scale);
  const float inv_scale = __frcp_rn(scale);
  if (threadIdx.x == 0) *scale_out = scale;
  if (vec) {
    for (int i = threadIdx.x; i < width / kVec; i += blockDim.x) {
      float f[kVec];
      src.eight(i, f);
      unsigned int b[kVec / 2];
#pragma unroll
      for (int e = 0; e < kVec; e += 2) {
        b[e / 2] = ps::e4m3x2_from_float(fminf(fmaxf(f[e] * inv_scale, -448.f), 448.f),
                                         fminf(fmaxf(f[e + 1] * inv_scale, -448.f), 448.f));
      }
      reinterpret_cast<uint2*>(q)[i] = make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
    }
  } else {
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
      const float v = src.one(i) * inv_scale;
      q[i] = (unsigned char)ps::e4m3_from_float(fminf(fmaxf(v, -448.f), 448.f));
    }
  }
}

// rms_norm_row's output for an FP8 W8A8 product with a dynamic scale per token, never stored in
// T: its values rounded to T as rms_norm_row stores them, then quantized as
// reference.quantize_fp8 does (quantize_row_fp8). One CTA per row: row_inv_rms's pass, then
// quantize_row_fp8's two, which recompute y (out rows of `hidden` bytes, contiguous).
template <typename T, bool ADD>
__device__ __forceinline__ void rms_norm_fp8_row(unsigned char* out, float* scales, const T* in,
                                                 long long in_stride, T* residual,
                                                 long long residual_stride,
                                                 const T* __restrict__ weight, int hidden,
                                                 float eps, float min_scale, int vec) {
  const long long row = blockIdx.x;
  const T* x = in + row * in_stride;
  T* r = ADD ? residual + row * residual_stride : nullptr;
  const float inv = row_inv_rms<T, ADD>(x, r, hidden, eps, vec);
  const NormedRow<T> src{ADD ? r : x, weight, inv};
  quantize_row_fp8(src, out + row * (long long)hidden, scales + row, hidden, min_scale, vec);
}

// reference.quantize_fp8 of a row of T, dynamic per token (quantize_row_fp8): one CTA per row
// of x (any row stride), out rows of `width` bytes, contiguous.
template <typename T>
__device__ __forceinline__ void quantize_fp8_row(unsigned char* out, float* scales, const T* x,
                                                 long long x_stride, int width, float min_scale,
                                                 int vec) {
  const long long row = blockIdx.x;
  const PlainRow<T> src{x + row * x_stride};
  quantize_row_fp8(src, out + row * (long long)width, scales + row, width, min_scale, vec);
}

// Per-head RMSNorm in place on one token's q and k heads (Qwen3's and Gemma 3's q_norm / k_norm):
// `lanes` = head_dim / 8 threads a head (8, 16 or 32: aligned groups of a warp), one 16-byte
// vector each. A thread sums its 8 squares in turn and the head's lanes reduce by xor offsets
// lanes / 2 .. 1: rms_norm_row's order on a row of head_dim (its other lanes add zeros), so the
// result equals rms_norm on the heads' rows bit for bit.
template <typename T>
__device__ __forceinline__ void head_rms_norm_row(T* q, long long q_stride_tok,
                                                  long long q_stride_head, T* k,
                                                  long long k_stride_tok, long long k_stride_head,
                                                  const T* __restrict__ q_weight,
                                                  const T* __restrict__ k_weight, int num_heads,
                                                  int num_kv_heads, int head_dim, float eps) {
  const long long tok = blockIdx.x;
  const int lanes = head_dim / kVec;
  const int lane = threadIdx.x % lanes;  // which of the head's vectors this thread holds
  const unsigned group = lanes == 32 ? 0xffffffffu
                                     : ((1u << lanes) - 1u) << ((threadIdx.x & 31) & ~(lanes - 1));
  for (int h = threadIdx.x / lanes; h < num_heads + num_kv_heads; h += blockDim.x / lanes) {
    const bool is_k = h >= num_heads;
    T* row = is_k ? k + tok * k_stride_tok + (long long)(h - num_heads) * k_stride_head
                  : q + tok * q_stride_tok + (long long)h * q_stride_head;
    uint4* p = reinterpret_cast<uint4*>(row) + lane;
    float a[kVec], w[kVec];
    unpack8<T>(*p, a);
    unpack8<T>(reinterpret_cast<const uint4*>(is_k ? k_weight : q_weight)[lane], w);
    float sumsq = 0.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) sumsq += a[e] * a[e];
    for (int o = lanes / 2; o > 0; o >>= 1) sumsq += __shfl_xor_sync(group, sumsq, o);
    const float inv = rsqrtf(sumsq / (float)head_dim + eps);
#pragma unroll
    for (int e = 0; e < kVec; ++e) a[e] = w[e] * round_to<T>(a[e] * inv);
    *p = pack8<T>(a);
  }
}

// Where a RoPE unit's two members lie in a head row (`width` 8 for vectors, 1 for scalars), from
// its first frequency j: rotate-half pairs (j, j + half); interleaved ones the neighbours
// (2j, 2j + 1), so a vector unit is the two adjacent vectors at 2j and 2j + 8.
__device__ __forceinline__ int2 rope_members(int j, int half, int width, int interleaved) {
  return interleaved ? make_int2(2 * j, 2 * j + width) : make_int2(j, half + j);
}

// RoPE on one vector unit held in registers, fp32 math, one rounding each. Rotate-half: r1 holds
// elements j..j+7 of the rotated span's first half and r2 the same of its second half, pairs
// (r1[e], r2[e]). Interleaved: r1, r2 hold elements 2j..2j+15, pairs of neighbours, frequency
// j + e for r1's pair e and j + 4 + e for r2's (the table's first half, as the reference).
template <typename T>
__device__ __forceinline__ void rope8(uint4& r1, uint4& r2, const float* cos_row,
                                      const float* sin_row, int j, int half, int interleaved) {
  float x1[kVec], x2[kVec], c1[kVec], s1[kVec], o1[kVec], o2[kVec];
  unpack8<T>(r1, x1);
  unpack8<T>(r2, x2);
  load8(cos_row + j, c1);
  load8(sin_row + j, s1);
  if (interleaved) {
    constexpr int kPairs = kVec / 2;
#pragma unroll
    for (int e = 0; e < kPairs; ++e) {
      o1[2 * e] = x1[2 * e] * c1[e] - x1[2 * e + 1] * s1[e];
      o1[2 * e + 1] = x1[2 * e + 1] * c1[e] + x1[2 * e] * s1[e];
      o2[2 * e] = x2[2 * e] * c1[kPairs + e] - x2[2 * e + 1] * s1[kPairs + e];
      o2[2 * e + 1] = x2[2 * e + 1] * c1[kPairs + e] + x2[2 * e] * s1[kPairs + e];
    }
  } else {
    float c2[kVec], s2[kVec];
    load8(cos_row + half + j, c2);
    load8(sin_row + half + j, s2);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      o1[e] = x1[e] * c1[e] - x2[e] * s1[e];
      o2[e] = x2[e] * c2[e] + x1[e] * s2[e];
    }
  }
  r1 = pack8<T>(o1);
  r2 = pack8<T>(o2);
}

// One CTA per token; a work unit is 8 (vec) or 1 element pair of one head (rope_members), q
// heads first, then k heads. Only each head's first rotary_dim elements are touched (partial
// rotary); tables: float32 [max_pos, rotary_dim], contiguous, rows cat(f, f). Tokens whose
// position is outside [0, max_pos) are left as they are (the launcher cannot check without a
// host sync; the reference twin raises).
template <typename T>
__device__ __forceinline__ void rotary_row(const long long* __restrict__ positions, T* q,
                                           long long q_stride_tok, long long q_stride_head, T* k,
                                           long long k_stride_tok, long long k_stride_head,
                                           const float* __restrict__ cos_table,
                                           const float* __restrict__ sin_table, int num_heads,
                                           int num_kv_heads, int rotary_dim, int interleaved,
                                           long long max_pos, int vec) {
  const long long tok = blockIdx.x;
  const long long pos = positions[tok];
  if (pos < 0 || pos >= max_pos) return;
  const int half = rotary_dim / 2;
  const float* cos_row = cos_table + pos * rotary_dim;
  const float* sin_row = sin_table + pos * rotary_dim;
  const int width = vec ? kVec : 1;
  const int per_head = half / width;
  const int units = (num_heads + num_kv_heads) * per_head;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const int head = u / per_head;
    const int j = (u - head * per_head) * width;  // the unit's first frequency
    const int2 m = rope_members(j, half, width, interleaved);
    T* row = head < num_heads ? q + tok * q_stride_tok + head * q_stride_head
                              : k + tok * k_stride_tok + (long long)(head - num_heads) * k_stride_head;
    if (vec) {
      uint4* p1 = reinterpret_cast<uint4*>(row + m.x);
      uint4* p2 = reinterpret_cast<uint4*>(row + m.y);
      uint4 r1 = *p1, r2 = *p2;
      rope8<T>(r1, r2, cos_row, sin_row, j, half, interleaved);
      *p1 = r1;
      *p2 = r2;
    } else {
      const int f2 = interleaved ? j : half + j;  // the second member's table column
      const float x1 = to_float<T>(row[m.x]), x2 = to_float<T>(row[m.y]);
      row[m.x] = from_float<T>(x1 * cos_row[j] - x2 * sin_row[j]);
      row[m.y] = from_float<T>(x2 * cos_row[f2] + x1 * sin_row[f2]);
    }
  }
}

// 8 elements of a K/V row (one 16-byte vector of T) to their cache slot: as they are, or into an
// FP8 cache (C = kv_fp8) as e4m3(x / scale), the cache kernel's rule.
template <typename T, typename C>
__device__ __forceinline__ void store_cache8(C* dst, const uint4 v, float scale) {
  if constexpr (sizeof(C) == 1) {
    float f[kVec];
    unpack8<T>(v, f);
    *reinterpret_cast<uint2*>(dst) = ps::e4m3x8_from_float(f, scale);
  } else {
    *reinterpret_cast<uint4*>(dst) = v;
  }
}

// RoPE and the KV cache write in one launch: one CTA per token, the 16-byte vector path only
// (the launcher falls back to rotary_embedding + reshape_and_cache otherwise). Units: (q and k
// heads) x rotary_dim / 16 vector pairs (rope_members), rotated in place as rotary_row does
// (same math, same single rounding); a k unit also stores its pair to the token's cache slot,
// unit u < kv_heads x head_dim / 8 copies v's u-th vector to the slot (the q units, which
// would otherwise finish first), and unit u < kv_heads x (head_dim - rotary_dim) / 8 copies
// the u-th vector of k's unrotated tails. As many threads as rotary_embedding's. A position
// outside [0, max_pos) leaves q and k unrotated (k still cached, as the two kernels would); a
// negative slot writes no cache row (a graph batch's padding token). Caches [num_blocks,
// kv_heads, block_size, head_dim], contiguous, of T or FP8 (C = kv_fp8: rows quantized with the
// layer's k_scale / v_scale, read from the device).
template <typename T, typename Index, typename C = T>
__device__ __forceinline__ void rotary_cache_row(
    const long long* __restrict__ positions, T* q, long long q_stride_tok, long long q_stride_head,
    T* k, long long k_stride_tok, long long k_stride_head, const T* __restrict__ v,
    long long v_stride_tok, long long v_stride_head, const float* __restrict__ cos_table,
    const float* __restrict__ sin_table, C* __restrict__ k_cache, C* __restrict__ v_cache,
    const Index* __restrict__ slot_mapping, int num_heads, int num_kv_heads, int head_dim,
    int rotary_dim, int interleaved, long long max_pos, long long block_size,
    const float* __restrict__ k_scale = nullptr, const float* __restrict__ v_scale = nullptr) {
  const long long tok = blockIdx.x;
  const long long pos = positions[tok];
  const bool rotate = pos >= 0 && pos < max_pos;
  const long long slot = (long long)slot_mapping[tok];
  const long long block = slot / block_size, off = slot - block * block_size;
  float ks = 1.f, vs = 1.f;
  if constexpr (sizeof(C) == 1) {
    ks = *k_scale;
    vs = *v_scale;
  }
  // element offset of kv head h's row for this token in either cache
  auto cache_row = [&](int h) {
    return ((block * num_kv_heads + h) * block_size + off) * head_dim;
  };
  const int half = rotary_dim / 2;
  const float* cos_row = cos_table + (rotate ? pos : 0) * rotary_dim;
  const float* sin_row = sin_table + (rotate ? pos : 0) * rotary_dim;
  const int per_head = half / kVec;
  const int units = (num_heads + num_kv_heads) * per_head;
  const int v_per_head = head_dim / kVec;
  const int v_units = slot >= 0 ? num_kv_heads * v_per_head : 0;  // may exceed units
  const int tail_per_head = (head_dim - rotary_dim) / kVec;
  const int tail_units = slot >= 0 ? num_kv_heads * tail_per_head : 0;  // < v_units
  for (int u = threadIdx.x; u < max(units, v_units); u += blockDim.x) {
    if (u < v_units) {
      const int vh = u / v_per_head, c = (u - vh * v_per_head) * kVec;
      const uint4 x = *reinterpret_cast<const uint4*>(v + tok * v_stride_tok + vh * v_stride_head + c);
      store_cache8<T>(v_cache + cache_row(vh) + c, x, vs);
    }
    if (u < tail_units) {  // partial rotary: k's elements past rotary_dim, cached as they are
      const int kh = u / tail_per_head, c = rotary_dim + (u - kh * tail_per_head) * kVec;
      const uint4 x = *reinterpret_cast<const uint4*>(k + tok * k_stride_tok + kh * k_stride_head + c);
      store_cache8<T>(k_cache + cache_row(kh) + c, x, ks);
    }
    if (u >= units) continue;
    const int head = u / per_head;
    const int j = (u - head * per_head) * kVec;  // the unit's first frequency
    const int2 m = rope_members(j, half, kVec, interleaved);
    const bool is_k = head >= num_heads;
    T* row = is_k ? k + tok * k_stride_tok + (long long)(head - num_heads) * k_stride_head
                  : q + tok * q_stride_tok + head * q_stride_head;
    uint4* p1 = reinterpret_cast<uint4*>(row + m.x);
    uint4* p2 = reinterpret_cast<uint4*>(row + m.y);
    uint4 r1 = *p1, r2 = *p2;
    if (rotate) {
      rope8<T>(r1, r2, cos_row, sin_row, j, half, interleaved);
      *p1 = r1;
      *p2 = r2;
    }
    if (is_k && slot >= 0) {
      C* dst = k_cache + cache_row(head - num_heads);
      store_cache8<T>(dst + m.x, r1, ks);
      store_cache8<T>(dst + m.y, r2, ks);
    }
  }
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// grid (tokens, chunks of blockDim units); a unit is 8 (vec) or 1 output element.
template <typename T>
__device__ __forceinline__ void silu_and_mul_row(T* __restrict__ out, long long out_stride,
                                                 const T* __restrict__ x, long long x_stride,
                                                 int d, int vec) {
  const long long tok = blockIdx.x;
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  const T* gate = x + tok * x_stride;
  const T* up = gate + d;
  T* y = out + tok * out_stride;
  if (vec) {
    if (i >= d / kVec) return;
    float g[kVec], u[kVec];
    unpack8<T>(reinterpret_cast<const uint4*>(gate)[i], g);
    unpack8<T>(reinterpret_cast<const uint4*>(up)[i], u);
#pragma unroll
    for (int e = 0; e < kVec; ++e) g[e] = silu(g[e]) * u[e];
    reinterpret_cast<uint4*>(y)[i] = pack8<T>(g);
  } else {
    if (i >= d) return;
    y[i] = from_float<T>(silu(to_float<T>(gate[i])) * to_float<T>(up[i]));
  }
}

// silu_and_mul_row's stored values, round(silu(gate) * up), for quantize_row_fp8.
template <typename T> struct SiluMulRow {
  const T* gate;
  const T* up;
  __device__ __forceinline__ void eight(int i, float (&f)[kVec]) const {
    float u[kVec];
    unpack8<T>(reinterpret_cast<const uint4*>(gate)[i], f);
    unpack8<T>(reinterpret_cast<const uint4*>(up)[i], u);
#pragma unroll
    for (int e = 0; e < kVec; ++e) f[e] = round_to<T>(silu(f[e]) * u[e]);
  }
  __device__ __forceinline__ float one(int i) const {
    return round_to<T>(silu(to_float<T>(gate[i])) * to_float<T>(up[i]));
  }
};

// silu_and_mul_row's output for an FP8 W8A8 product with a dynamic scale per token, never
// stored in T: reference.quantize_fp8 of it (quantize_row_fp8). One CTA per row of x (gate | up,
// any row stride); out rows of d bytes, contiguous. The second pass recomputes the product from
// gate and up (its own loads of the first pass, L1/L2 hits) rather than holding the row, so
// any width runs without a register or shared-memory bound; silu is cheap beside the loads.
template <typename T>
__device__ __forceinline__ void silu_and_mul_fp8_row(unsigned char* out, float* scales,
                                                     const T* x, long long x_stride, int d,
                                                     float min_scale, int vec) {
  const long long row = blockIdx.x;
  const T* gate = x + row * x_stride;
  const SiluMulRow<T> src{gate, gate + d};
  quantize_row_fp8(src, out + row * (long long)d, scales + row, d, min_scale, vec);
}

}  // namespace ps_ops

#ifndef PS_KV_FP8  // kv_fp8.cu defines the FP8 cache's entry points, not these
// The ops before a W4A16 product (the norms, silu_and_mul) let it launch as soon as they all
// run (ps::launch_dependents): it loads its first weights while they finish.
#define PS_OPS(NAME, T)                                                                          \
  extern "C" __global__ void __launch_bounds__(1024)                                             \
      rms_norm_##NAME(T* out, long long out_stride, const T* x, long long x_stride,              \
                      const T* weight, int hidden, float eps, int vec) {                         \
    ps::launch_dependents();                                                                     \
    ps_ops::rms_norm_row<T, false>(out, out_stride, x, x_stride, nullptr, 0, weight, hidden,     \
                                   eps, vec);                                                    \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(1024)                                             \
      fused_add_rms_norm_##NAME(T* x, long long x_stride, T* residual,                           \
                                long long residual_stride, const T* weight, int hidden,          \
                                float eps, int vec) {                                            \
    ps::launch_dependents();                                                                     \
    ps_ops::rms_norm_row<T, true>(x, x_stride, x, x_stride, residual, residual_stride, weight,   \
                                  hidden, eps, vec);                                             \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(1024)                                             \
      rms_norm_fp8_##NAME(unsigned char* out, float* scales, const T* x, long long x_stride,     \
                          const T* weight, int hidden, float eps, float min_scale, int vec) {    \
    ps_ops::rms_norm_fp8_row<T, false>(out, scales, x, x_stride, nullptr, 0, weight, hidden,     \
                                       eps, min_scale, vec);                                     \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(1024)                                             \
      fused_add_rms_norm_fp8_##NAME(unsigned char* out, float* scales, const T* x,               \
                                    long long x_stride, T* residual, long long residual_stride,  \
                                    const T* weight, int hidden, float eps, float min_scale,     \
                                    int vec) {                                                   \
    ps_ops::rms_norm_fp8_row<T, true>(out, scales, x, x_stride, residual, residual_stride,       \
                                      weight, hidden, eps, min_scale, vec);                      \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(1024)                                             \
      quantize_fp8_##NAME(unsigned char* out, float* scales, const T* x, long long x_stride,     \
                          int width, float min_scale, int vec) {                                 \
    ps_ops::quantize_fp8_row<T>(out, scales, x, x_stride, width, min_scale, vec);                \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(1024)                                             \
      silu_and_mul_fp8_##NAME(unsigned char* out, float* scales, const T* x, long long x_stride, \
                              int d, float min_scale, int vec) {                                 \
    ps_ops::silu_and_mul_fp8_row<T>(out, scales, x, x_stride, d, min_scale, vec);                \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(1024)                                             \
      head_rms_norm_##NAME(T* q, long long q_stride_tok, long long q_stride_head, T* k,          \
                           long long k_stride_tok, long long k_stride_head, const T* q_weight,   \
                           const T* k_weight, int num_heads, int num_kv_heads, int head_dim,     \
                           float eps) {                                                          \
    ps_ops::head_rms_norm_row<T>(q, q_stride_tok, q_stride_head, k, k_stride_tok, k_stride_head, \
                                 q_weight, k_weight, num_heads, num_kv_heads, head_dim, eps);    \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(512)                                              \
      rotary_embedding_##NAME(const long long* positions, T* q, long long q_stride_tok,          \
                              long long q_stride_head, T* k, long long k_stride_tok,             \
                              long long k_stride_head, const float* cos_table,                   \
                              const float* sin_table, int num_heads, int num_kv_heads,           \
                              int rotary_dim, int interleaved, long long max_pos, int vec) {     \
    ps_ops::rotary_row<T>(positions, q, q_stride_tok, q_stride_head, k, k_stride_tok,            \
                          k_stride_head, cos_table, sin_table, num_heads, num_kv_heads,          \
                          rotary_dim, interleaved, max_pos, vec);                                \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(256)                                              \
      silu_and_mul_##NAME(T* out, long long out_stride, const T* x, long long x_stride, int d,   \
                          int vec) {                                                             \
    ps::launch_dependents();                                                                     \
    ps_ops::silu_and_mul_row<T>(out, out_stride, x, x_stride, d, vec);                           \
  }
PS_OPS(bf16, __nv_bfloat16)
PS_OPS(fp16, __half)

#define PS_ROPE_CACHE(NAME, T, INDEX)                                                            \
  extern "C" __global__ void __launch_bounds__(512)                                              \
      rotary_embedding_cache_##NAME(                                                             \
          const long long* positions, T* q, long long q_stride_tok, long long q_stride_head,     \
          T* k, long long k_stride_tok, long long k_stride_head, const T* v,                     \
          long long v_stride_tok, long long v_stride_head, const float* cos_table,               \
          const float* sin_table, T* k_cache, T* v_cache, const INDEX* slot_mapping,             \
          int num_heads, int num_kv_heads, int head_dim, int rotary_dim, int interleaved,        \
          long long max_pos, long long block_size) {                                             \
    ps_ops::rotary_cache_row<T, INDEX>(positions, q, q_stride_tok, q_stride_head, k,             \
                                       k_stride_tok, k_stride_head, v, v_stride_tok,             \
                                       v_stride_head, cos_table, sin_table, k_cache, v_cache,    \
                                       slot_mapping, num_heads, num_kv_heads, head_dim,          \
                                       rotary_dim, interleaved, max_pos, block_size);            \
  }
PS_ROPE_CACHE(bf16_i64, __nv_bfloat16, long long)
PS_ROPE_CACHE(bf16_i32, __nv_bfloat16, int)
PS_ROPE_CACHE(fp16_i64, __half, long long)
PS_ROPE_CACHE(fp16_i32, __half, int)
#endif  // PS_KV_FP8

// A grammar's token mask: logits[row, t] = -inf where bit t % 32 of word t / 32 of bitmask row
// i is clear, row = indices[i] (i when indices is null); an index outside [0, num_rows) masks
// nothing (a graph's padding rows). Grid (chunks of the vocabulary, bitmask rows): one pass over
// the masked rows, the 32 tokens of a warp sharing one word.
#ifndef PS_KV_FP8
extern "C" __global__ void __launch_bounds__(256)
    apply_token_bitmask(float* logits, long long logits_stride, const int* bitmask,
                        long long bitmask_stride, const long long* indices, long long num_rows,
                        int vocab) {
  const long long i = blockIdx.y;
  const long long row = indices != nullptr ? indices[i] : i;
  if (row < 0 || row >= num_rows) return;
  const int* words = bitmask + i * bitmask_stride;
  float* out = logits + row * logits_stride;
  const float neg_inf = __uint_as_float(0xff800000u);
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < vocab; t += gridDim.x * blockDim.x) {
    if (!((words[t >> 5] >> (t & 31)) & 1)) out[t] = neg_inf;
  }
}
#endif  // PS_KV_FP8

// Sampling's race: out[row] = argmax over t of scores[row, t] + g(t), g = -log(max(E, FLT_MIN)),
// E = -log(u), u the splitmix64 stream of seeds[row] at t + 1 as float32 in (0, 1]
// (executor_svc.sampler.race_argmax's torch ops, bit for bit: the same integer ops and float32
// roundings, ties and NaN as torch.argmax takes them: the first). One CTA per row; nothing [n, vocab] is
// written, where the torch ops write two int64 tensors of that size.
#ifndef PS_KV_FP8
#define PS_RACE_THREADS 512
__device__ __forceinline__ bool race_beats(float a, int ia, float b, int ib) {
  const bool nan_a = a != a, nan_b = b != b;
  if (nan_a || nan_b) return nan_a && (!nan_b || ia < ib);
  return a > b || (a == b && ia < ib);
}

extern "C" __global__ void __launch_bounds__(PS_RACE_THREADS)
    gumbel_argmax(const float* scores, long long stride, const long long* seeds,
                  long long* out, int vocab) {
  const long long row = blockIdx.x;
  const float* s = scores + row * stride;
  const unsigned long long seed = static_cast<unsigned long long>(seeds[row]);
  float best = __uint_as_float(0xff800000u);  // -inf
  int best_i = vocab;  // beaten by any index
  for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
    unsigned long long z = seed + static_cast<unsigned long long>(t + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = __fadd_rn(static_cast<float>(z >> 40), 0.5f);
    u = __fmul_rn(u, 1.0f / 16777216.0f);
    const float e = fmaxf(-logf(u), 1.17549435e-38f);
    const float v = __fadd_rn(s[t], -logf(e));
    if (race_beats(v, t, best, best_i)) {
      best = v;
      best_i = t;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float v = __shfl_down_sync(0xffffffffu, best, offset);
    const int i = __shfl_down_sync(0xffffffffu, best_i, offset);
    if (race_beats(v, i, best, best_i)) {
      best = v;
      best_i = i;
    }
  }
  __shared__ float warp_best[PS_RACE_THREADS / 32];
  __shared__ int warp_index[PS_RACE_THREADS / 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_index[warp] = best_i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    best = warp_best[0];
    best_i = warp_index[0];
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
      if (race_beats(warp_best[w], warp_index[w], best, best_i)) {
        best = warp_best[w];
        best_i = warp_index[w];
      }
    }
    out[row] = best_i < vocab ? best_i : 0;
  }
}
#endif  // PS_KV_FP8
