// Elements of the FP8 KV cache (--kv-cache-dtype fp8: e4m3, float8_e4m3fn's bits). A K/V value x
// is written as e4m3(x / scale), saturated at +-448, rounded to nearest even: the reference twin's
// quantize_kv bit for bit. It is read back exactly as bf16/fp16 (every e4m3 value is one); the
// attention kernels apply the layer's scale to the scores and the output instead. Conversions in
// hardware on sm_89+, the same results in integer arithmetic below it.
#pragma once
#include "common.cuh"

namespace ps {

using kv_fp8 = unsigned char;  // one e4m3 cache element

// x -> e4m3 bits: ties to even, +-448 past the range (infinities too), NaN -> 0x7f | sign.
__device__ __forceinline__ unsigned int e4m3_from_float(float x) {
  const unsigned int sign = (__float_as_uint(x) >> 24) & 0x80u;
  const float a = fabsf(x);
  if (a != a) return sign | 0x7Fu;
  if (a >= 448.f) return sign | 0x7Eu;
  // Below 2^-6 (the least normal) e4m3 steps by 2^-9; a carry to 8 is 2^-6's code.
  if (a < 0.015625f) return sign | (unsigned int)__float2int_rn(a * 512.f);
  unsigned int b = __float_as_uint(a);
  b += 0x7FFFFu + ((b >> 20) & 1u);  // keep 3 mantissa bits, ties to even
  return sign | (((b >> 23) - 120u) << 3) | ((b >> 20) & 7u);
}

// (lo, hi) -> two e4m3 in the low 16 bits, lo in the low byte.
__device__ __forceinline__ unsigned int e4m3x2_from_float(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return e4m3_from_float(lo) | (e4m3_from_float(hi) << 8);
#endif
}

// 8 values -> 8 e4m3 (element i in byte i), each value / scale rounded to float first.
__device__ __forceinline__ uint2 e4m3x8_from_float(const float (&f)[8], float scale) {
  unsigned int b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    b[i] = e4m3x2_from_float(__fdiv_rn(f[2 * i], scale), __fdiv_rn(f[2 * i + 1], scale));
  return make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
}

#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890)
// x: an e4m3 byte in the high byte of each 16-bit lane -> f16x2 of the same values. The bits
// shifted into fp16's place give value * 2^-8 (subnormals included); e4m3's NaN (0x7f) would
// read as 480, which no e4m3 value is, so it is mapped back to NaN.
__device__ __forceinline__ unsigned int e4m3x2_hi_bytes_to_half2(unsigned int x) {
  const unsigned int h = (x & 0x80008000u) | ((x >> 1) & 0x3F803F80u);
  const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h), __floats2half2_rn(256.f, 256.f));
  const unsigned int r = *reinterpret_cast<const unsigned int*>(&v);
  return r | __vcmpeq2(r & 0x7FFF7FFFu, 0x5F805F80u);
}
#endif

// Four e4m3 (element i in byte i of w) -> two f16x2 words (elements 0-1, 2-3), exactly.
__device__ __forceinline__ void e4m3x4_to_half2(unsigned int w, unsigned int& lo,
                                                unsigned int& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\n"
      "cvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  lo = e4m3x2_hi_bytes_to_half2(__byte_perm(w, 0u, 0x1404));
  hi = e4m3x2_hi_bytes_to_half2(__byte_perm(w, 0u, 0x3424));
#endif
}

// 8 e4m3 (element i in byte i) -> one 16-byte vector of 8 T (element 2i in the low half of
// word i), exactly.
template <typename T> struct FromE4m3;
template <> struct FromE4m3<__half> {
  static __device__ __forceinline__ uint4 eight(uint2 raw) {
    uint4 r;
    e4m3x4_to_half2(raw.x, r.x, r.y);
    e4m3x4_to_half2(raw.y, r.z, r.w);
    return r;
  }
};
template <> struct FromE4m3<__nv_bfloat16> {
  static __device__ __forceinline__ unsigned int word(unsigned int h) {
    const float2 f = Pack<__half>::unpack(h);
    return Pack<__nv_bfloat16>::two(f.x, f.y);
  }
  static __device__ __forceinline__ uint4 eight(uint2 raw) {
    const uint4 h = FromE4m3<__half>::eight(raw);
    return make_uint4(word(h.x), word(h.y), word(h.z), word(h.w));
  }
};

// 8 consecutive elements of a K/V row (16-byte aligned) as floats.
__device__ __forceinline__ void load8f(const float* p, float (&f)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
template <typename T>
__device__ __forceinline__ void unpack8f(const uint4 u, float (&f)[8]) {
  const float2 a = Pack<T>::unpack(u.x), b = Pack<T>::unpack(u.y);
  const float2 c = Pack<T>::unpack(u.z), d = Pack<T>::unpack(u.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}
template <typename T>
__device__ __forceinline__ void load8f(const T* p, float (&f)[8]) {
  unpack8f<T>(*reinterpret_cast<const uint4*>(p), f);
}

// Rows [r0, r0 + ROWS) of an FP8 tile (row-major, HD bytes a row) into a T tile of the swz<HD>
// layout the ldmatrix paths read, 8 elements a step, by thread t of NT. Consecutive threads read
// consecutive 8-byte pieces and write the 8 chunks of one 128-byte span (no bank conflicts).
template <typename T, int HD, int ROWS, int NT>
__device__ __forceinline__ void fp8_rows_to_tile(const kv_fp8* src, T* dst, int r0, int t) {
  constexpr int CH = HD / 8;
  static_assert(ROWS * CH % NT == 0, "whole steps per thread");
#pragma unroll 2
  for (int i = 0; i < ROWS * CH / NT; ++i) {
    const int u = t + i * NT;
    const int r = r0 + u / CH, ch = u % CH;
    const uint2 raw = *reinterpret_cast<const uint2*>(src + r * HD + ch * 8);
    *reinterpret_cast<uint4*>(dst + swz<HD>(r, ch)) = FromE4m3<T>::eight(raw);
  }
}

}  // namespace ps
