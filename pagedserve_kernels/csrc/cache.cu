// KV cache movement: writing new K/V rows into their slots, and copying whole pages (all layers, K
// and V, every pair of the step) in one launch. Pages are moved as raw bytes with 16-byte vectors,
// so the kernels are dtype-agnostic. Host-side pages are pinned memory mapped into the device's
// address space (UVA): the same kernel runs device<->device, device->host and host->device.
// An FP8 cache's rows are quantized on the way in (reshape_and_cache_fp8_impl, whose entry
// points kv_fp8.cu defines); its pages move as bytes like any other.
#include "kv_fp8.cuh"

// One thread per 16-byte chunk of one (token, kv head) row, K and V together.
template <typename Index>
__device__ __forceinline__ void reshape_and_cache_impl(
    const char* __restrict__ key, const char* __restrict__ value, char* __restrict__ k_cache,
    char* __restrict__ v_cache, const Index* __restrict__ slot_mapping, int num_tokens,
    int num_kv_heads, int row_chunks, long long key_stride_tok, long long key_stride_head,
    long long value_stride_tok, long long value_stride_head, long long block_size) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long per_token = (long long)num_kv_heads * row_chunks;
  if (idx >= per_token * num_tokens) return;
  const int tok = (int)(idx / per_token);
  const int rem = (int)(idx - tok * per_token);
  const int head = rem / row_chunks, c = rem % row_chunks;
  const long long slot = (long long)slot_mapping[tok];
  if (slot < 0) return;  // padding token (e.g. a CUDA-graph batch padded past its real size)
  const long long block = slot / block_size, off = slot - block * block_size;
  const long long dst = (((block * num_kv_heads + head) * block_size + off) * row_chunks + c) * 16;
  const uint4 k = *reinterpret_cast<const uint4*>(key + tok * key_stride_tok + head * key_stride_head + c * 16);
  const uint4 v = *reinterpret_cast<const uint4*>(value + tok * value_stride_tok + head * value_stride_head + c * 16);
  *reinterpret_cast<uint4*>(k_cache + dst) = k;
  *reinterpret_cast<uint4*>(v_cache + dst) = v;
}

// The FP8 cache's write: one thread per 8 elements of one (token, kv head) row, K and V together,
// each element x / scale (the layer's k_scale or v_scale, read from the device: capturable)
// stored as e4m3 (kv_fp8.cuh). key / value rows in T (bf16, fp16 or float32), strides in elements.
template <typename T, typename Index>
__device__ __forceinline__ void reshape_and_cache_fp8_impl(
    const T* __restrict__ key, const T* __restrict__ value, ps::kv_fp8* __restrict__ k_cache,
    ps::kv_fp8* __restrict__ v_cache, const Index* __restrict__ slot_mapping, int num_tokens,
    int num_kv_heads, int head_dim, long long key_stride_tok, long long key_stride_head,
    long long value_stride_tok, long long value_stride_head, long long block_size,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int row_units = head_dim / 8;
  const long long per_token = (long long)num_kv_heads * row_units;
  if (idx >= per_token * num_tokens) return;
  const int tok = (int)(idx / per_token);
  const int rem = (int)(idx - tok * per_token);
  const int head = rem / row_units, c = (rem % row_units) * 8;
  const long long slot = (long long)slot_mapping[tok];
  if (slot < 0) return;  // padding token
  const long long block = slot / block_size, off = slot - block * block_size;
  const long long dst = ((block * num_kv_heads + head) * block_size + off) * head_dim + c;
  float k[8], v[8];
  ps::load8f(key + tok * key_stride_tok + head * key_stride_head + c, k);
  ps::load8f(value + tok * value_stride_tok + head * value_stride_head + c, v);
  *reinterpret_cast<uint2*>(k_cache + dst) = ps::e4m3x8_from_float(k, *k_scale);
  *reinterpret_cast<uint2*>(v_cache + dst) = ps::e4m3x8_from_float(v, *v_scale);
}

#ifndef PS_KV_FP8  // kv_fp8.cu defines the FP8 cache's entry points, not these
#define PS_RESHAPE(NAME, INDEX)                                                                  \
  extern "C" __global__ void __launch_bounds__(256)                                              \
      NAME(const char* key, const char* value, char* k_cache, char* v_cache,                     \
           const INDEX* slot_mapping, int num_tokens, int num_kv_heads, int row_chunks,          \
           long long key_stride_tok, long long key_stride_head, long long value_stride_tok,      \
           long long value_stride_head, long long block_size) {                                  \
    reshape_and_cache_impl<INDEX>(key, value, k_cache, v_cache, slot_mapping, num_tokens,        \
                                  num_kv_heads, row_chunks, key_stride_tok, key_stride_head,     \
                                  value_stride_tok, value_stride_head, block_size);              \
  }
PS_RESHAPE(reshape_and_cache_i64, long long)
PS_RESHAPE(reshape_and_cache_i32, int)
#endif

// Work item = (pair, layer, K|V): one page of one layer, `page_bytes` contiguous on both sides.
// A CTA walks items grid-stride; each thread keeps UNROLL 16-byte loads in flight before storing.
// Pairs whose block ids fall outside either cache are skipped (never written out of bounds).
#ifndef PS_KV_FP8
constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;

extern "C" __global__ void __launch_bounds__(kCopyThreads)
    copy_pages(const char* src_k, const char* src_v, char* dst_k, char* dst_v,
               const long long* __restrict__ mapping, int num_pairs, int num_layers,
               long long page_bytes, long long src_blocks, long long dst_blocks) {
  const long long items = (long long)num_pairs * num_layers * 2;
  const long long vecs = page_bytes >> 4;
  for (long long it = blockIdx.x; it < items; it += gridDim.x) {
    const int kv = (int)(it & 1);
    const long long rest = it >> 1;
    const long long layer = rest % num_layers;
    const long long pair = rest / num_layers;
    const long long s = mapping[2 * pair], d = mapping[2 * pair + 1];
    if (s < 0 || s >= src_blocks || d < 0 || d >= dst_blocks) continue;
    const uint4* src = reinterpret_cast<const uint4*>((kv ? src_v : src_k) +
                                                      (layer * src_blocks + s) * page_bytes);
    uint4* dst = reinterpret_cast<uint4*>((kv ? dst_v : dst_k) + (layer * dst_blocks + d) * page_bytes);
    for (long long i = threadIdx.x; i < vecs; i += kCopyThreads * kCopyUnroll) {
      uint4 r[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const long long j = i + u * kCopyThreads;
        if (j < vecs) r[u] = src[j];
      }
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const long long j = i + u * kCopyThreads;
        if (j < vecs) dst[j] = r[u];
      }
    }
  }
}
#endif  // PS_KV_FP8
