// The kernels of an FP8 (e4m3) KV cache (--kv-cache-dtype fp8), a module of their own
// (_compile.LAZY: only an executor serving an FP8 cache compiles it): attention.cu's prefill,
// few-query and decode kernels reading such a cache, ops.cu's fused RoPE and cache write and
// cache.cu's cache write storing into it. Each takes the arguments of its 16-bit-cache twin plus
// the layer's k_scale and v_scale ([] float32 on the device, so a captured graph keeps them).
// PS_KV_FP8 leaves out the included files' own entry points.
#define PS_KV_FP8 1
#include "attention.cu"
#include "ops.cu"
#include "cache.cu"

// ---------------------------------------------------------------------------------------------
// Attention (the same launch bounds as the 16-bit-cache kernels).
#define PS_PREFILL_FP8_ENTRY(NAME, IMPL, THREADS, T, HD, MIN_CTAS)                                \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)                                 \
      NAME(const T* q, T* out, const ps::kv_fp8* k_cache, const ps::kv_fp8* v_cache,             \
           const int* block_tables, const int* cu_seqlens_q, const int* seq_lens,                 \
           const int2* tiles, long long q_stride_tok, int q_stride_head, long long o_stride_tok,  \
           int o_stride_head, int num_heads, int num_kv_heads, int block_size_log2,               \
           int max_blocks_per_seq, float scale_log2, int window, float soft_cap,                  \
           const float* k_scale, const float* v_scale) {                                          \
    ps::IMPL<T, HD, ps::kv_fp8>(q, out, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,   \
                                tiles, q_stride_tok, q_stride_head, o_stride_tok, o_stride_head,  \
                                num_heads, num_kv_heads, block_size_log2, max_blocks_per_seq,     \
                                scale_log2, window, soft_cap, k_scale, v_scale);                  \
  }
#define PS_PREFILL_FP8(NAME, T, HD, MIN_CTAS) \
  PS_PREFILL_FP8_ENTRY(NAME, prefill_impl, ps::kThreads, T, HD, MIN_CTAS)
PS_PREFILL_FP8(prefill_bf16_hd64_fp8, __nv_bfloat16, 64, 3)
PS_PREFILL_FP8(prefill_bf16_hd128_fp8, __nv_bfloat16, 128, 2)
PS_PREFILL_FP8(prefill_fp16_hd64_fp8, __half, 64, 3)
PS_PREFILL_FP8(prefill_fp16_hd128_fp8, __half, 128, 2)

#define PS_PREFILL_WG_FP8(NAME, T, HD, MIN_CTAS) \
  PS_PREFILL_FP8_ENTRY(NAME, prefill_wg_impl, ps::kWgThreads, T, HD, MIN_CTAS)
PS_PREFILL_WG_FP8(prefill_wg_bf16_hd64_fp8, __nv_bfloat16, 64, 2)
PS_PREFILL_WG_FP8(prefill_wg_bf16_hd128_fp8, __nv_bfloat16, 128, 1)
PS_PREFILL_WG_FP8(prefill_wg_fp16_hd64_fp8, __half, 64, 2)
PS_PREFILL_WG_FP8(prefill_wg_fp16_hd128_fp8, __half, 128, 1)

#define PS_DECODE_FP8(NAME, T, HD, STAGES, MIN_CTAS)                                             \
  extern "C" __global__ void __launch_bounds__(ps::kThreads, MIN_CTAS)                           \
      NAME(const T* q, T* out, float* part_o, float* part_lse, const ps::kv_fp8* k_cache,        \
           const ps::kv_fp8* v_cache, const int* block_tables, const int* seq_lens,              \
           long long q_stride_tok, int q_stride_head, long long o_stride_tok, int o_stride_head, \
           int num_heads, int num_kv_heads, int block_size_log2, int max_blocks_per_seq,         \
           int chunk_pages, int num_splits, float scale_log2, int window, float soft_cap,        \
           const float* k_scale, const float* v_scale) {                                         \
    ps::decode_impl<T, HD, STAGES, false, false, ps::kv_fp8>(                                    \
        q, out, part_o, part_lse, k_cache, v_cache, block_tables, seq_lens, q_stride_tok,        \
        q_stride_head, o_stride_tok, o_stride_head, num_heads, num_kv_heads, block_size_log2,    \
        max_blocks_per_seq, chunk_pages, num_splits, scale_log2, window, soft_cap, nullptr,      \
        nullptr, 1, k_scale, v_scale);                                                           \
  }
// hd128: 2 stages and the one converted tile in 52 KiB, 4 CTAs an SM (more warps to hide each
// stage's conversion; attention.py's _DECODE_STAGES_FP8 mirrors the stages).
PS_DECODE_FP8(decode_bf16_hd64_fp8, __nv_bfloat16, 64, 4, 1)
PS_DECODE_FP8(decode_bf16_hd128_fp8, __nv_bfloat16, 128, 2, 4)
PS_DECODE_FP8(decode_fp16_hd64_fp8, __half, 64, 4, 1)
PS_DECODE_FP8(decode_fp16_hd128_fp8, __half, 128, 2, 4)

#define PS_DECODE_MQ_FP8(NAME, T, HD, STAGES, MIN_CTAS)                                          \
  extern "C" __global__ void __launch_bounds__(ps::kThreads, MIN_CTAS)                           \
      NAME(const T* q, T* out, float* part_o, float* part_lse, const ps::kv_fp8* k_cache,        \
           const ps::kv_fp8* v_cache, const int* block_tables, const int* cu_seqlens_q,          \
           const int* seq_lens, const int2* tiles, int tpc, long long q_stride_tok,              \
           int q_stride_head, long long o_stride_tok, int o_stride_head, int num_heads,          \
           int num_kv_heads, int block_size_log2, int max_blocks_per_seq, int chunk_pages,       \
           int num_splits, float scale_log2, int window, float soft_cap, const float* k_scale,   \
           const float* v_scale) {                                                               \
    ps::decode_impl<T, HD, STAGES, true, false, ps::kv_fp8>(                                     \
        q, out, part_o, part_lse, k_cache, v_cache, block_tables, seq_lens, q_stride_tok,        \
        q_stride_head, o_stride_tok, o_stride_head, num_heads, num_kv_heads, block_size_log2,    \
        max_blocks_per_seq, chunk_pages, num_splits, scale_log2, window, soft_cap, cu_seqlens_q, \
        tiles, tpc, k_scale, v_scale);                                                           \
  }
PS_DECODE_MQ_FP8(decode_mq_bf16_hd64_fp8, __nv_bfloat16, 64, 4, 1)
PS_DECODE_MQ_FP8(decode_mq_bf16_hd128_fp8, __nv_bfloat16, 128, 3, 2)
PS_DECODE_MQ_FP8(decode_mq_fp16_hd64_fp8, __half, 64, 4, 1)
PS_DECODE_MQ_FP8(decode_mq_fp16_hd128_fp8, __half, 128, 3, 2)

// ---------------------------------------------------------------------------------------------
// The cache write, from bf16, fp16 or float32 rows (a float32 model's cache write runs here).
#define PS_RESHAPE_FP8(NAME, T, INDEX)                                                           \
  extern "C" __global__ void __launch_bounds__(256)                                              \
      NAME(const T* key, const T* value, ps::kv_fp8* k_cache, ps::kv_fp8* v_cache,               \
           const INDEX* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,            \
           long long key_stride_tok, long long key_stride_head, long long value_stride_tok,      \
           long long value_stride_head, long long block_size, const float* k_scale,              \
           const float* v_scale) {                                                               \
    reshape_and_cache_fp8_impl<T, INDEX>(key, value, k_cache, v_cache, slot_mapping, num_tokens, \
                                         num_kv_heads, head_dim, key_stride_tok,                 \
                                         key_stride_head, value_stride_tok, value_stride_head,   \
                                         block_size, k_scale, v_scale);                          \
  }
PS_RESHAPE_FP8(reshape_and_cache_fp8_bf16_i64, __nv_bfloat16, long long)
PS_RESHAPE_FP8(reshape_and_cache_fp8_bf16_i32, __nv_bfloat16, int)
PS_RESHAPE_FP8(reshape_and_cache_fp8_fp16_i64, __half, long long)
PS_RESHAPE_FP8(reshape_and_cache_fp8_fp16_i32, __half, int)
PS_RESHAPE_FP8(reshape_and_cache_fp8_fp32_i64, float, long long)
PS_RESHAPE_FP8(reshape_and_cache_fp8_fp32_i32, float, int)

// ---------------------------------------------------------------------------------------------
// RoPE fused with the cache write (bf16/fp16 models).
#define PS_ROPE_CACHE_FP8(NAME, T, INDEX)                                                        \
  extern "C" __global__ void __launch_bounds__(512)                                              \
      NAME(                                                                                      \
          const long long* positions, T* q, long long q_stride_tok, long long q_stride_head,     \
          T* k, long long k_stride_tok, long long k_stride_head, const T* v,                     \
          long long v_stride_tok, long long v_stride_head, const float* cos_table,               \
          const float* sin_table, ps::kv_fp8* k_cache, ps::kv_fp8* v_cache,                      \
          const INDEX* slot_mapping, int num_heads, int num_kv_heads, int head_dim,              \
          int rotary_dim, int interleaved, long long max_pos, long long block_size,              \
          const float* k_scale, const float* v_scale) {                                          \
    ps_ops::rotary_cache_row<T, INDEX, ps::kv_fp8>(                                              \
        positions, q, q_stride_tok, q_stride_head, k, k_stride_tok, k_stride_head, v,            \
        v_stride_tok, v_stride_head, cos_table, sin_table, k_cache, v_cache, slot_mapping,       \
        num_heads, num_kv_heads, head_dim, rotary_dim, interleaved, max_pos, block_size,         \
        k_scale, v_scale);                                                                       \
  }
PS_ROPE_CACHE_FP8(rotary_embedding_cache_bf16_i64_fp8, __nv_bfloat16, long long)
PS_ROPE_CACHE_FP8(rotary_embedding_cache_bf16_i32_fp8, __nv_bfloat16, int)
PS_ROPE_CACHE_FP8(rotary_embedding_cache_fp16_i64_fp8, __half, long long)
PS_ROPE_CACHE_FP8(rotary_embedding_cache_fp16_i32_fp8, __half, int)
