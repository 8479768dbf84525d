"""The FP8 KV cache in the reference twins: a write quantizes as vLLM's cache kernels (x / scale,
saturated, rounded to e4m3), every attention twin reads it dequantized (the same result as a
float32 cache holding the dequantized rows), and page copies move its bytes unchanged."""
import torch

from pagedserve_kernels import reference

FP8 = torch.float8_e4m3fn
LAYERS, BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM, HEADS = 2, 12, 2, 4, 16, 4


def caches(dtype):
    shape = (LAYERS, BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_a_write_quantizes_as_vllm_and_saturates():
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(6, KV_HEADS, HEAD_DIM, generator=gen) * 3
    value = torch.randn(6, KV_HEADS, HEAD_DIM, generator=gen)
    key[0, 0, 0], key[1, 1, 1] = 1e4, -1e4  # past 448 * scale: saturated, never NaN
    k_cache, v_cache = caches(FP8)
    slots = torch.tensor([0, 1, 5, 6, 40, 47])
    k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.004)
    reference.reshape_and_cache(key, value, k_cache[0], v_cache[0], slots, k_scale, v_scale)
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    stored_k = k_cache[0][blocks, :, offsets]  # [6, kv_heads, head_dim]
    stored_v = v_cache[0][blocks, :, offsets]
    expected_k = (key / k_scale).clamp(-448, 448).to(FP8)
    assert torch.equal(bits(stored_k), bits(expected_k))
    assert torch.equal(bits(stored_v), bits((value / v_scale).clamp(-448, 448).to(FP8)))
    assert stored_k[0, 0, 0].float() == 448 and stored_k[1, 1, 1].float() == -448
    # e4m3 keeps 3 mantissa bits: a round trip is within half a step (1/16) of each value
    inside = (key / k_scale).abs() < 448
    back = reference.dequantize_kv(stored_k, k_scale)
    assert torch.all((back - key).abs()[inside] <= key.abs()[inside] / 16 + 2**-9 * k_scale)


def test_attention_reads_an_fp8_cache_as_its_dequantized_rows():
    """Prefill (packed, chunked), decode and the graphs' torch decode all give exactly what a
    float32 cache holding the dequantized rows gives."""
    gen = torch.Generator().manual_seed(1)
    tables = torch.tensor([[3, 7, 1, 0], [9, 2, 11, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([13, 16], dtype=torch.int32)
    k_fp8, v_fp8 = caches(FP8)
    k_scale, v_scale = torch.tensor(0.03), torch.tensor(0.5)
    for seq, length in enumerate(seq_lens.tolist()):
        pos = torch.arange(length)
        slots = tables[seq].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        k = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen) * 40
        reference.reshape_and_cache(k, v, k_fp8[0], v_fp8[0], slots, k_scale, v_scale)
    k_f32 = reference.dequantize_kv(k_fp8, k_scale)
    v_f32 = reference.dequantize_kv(v_fp8, v_scale)
    q = torch.randn(7, HEADS, HEAD_DIM, generator=gen)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)  # 3 and 4 query tokens: chunks at the end
    fp8 = reference.paged_prefill_attention(q, k_fp8[0], v_fp8[0], tables, cu, seq_lens, 0.25,
                                            k_scale=k_scale, v_scale=v_scale)
    f32 = reference.paged_prefill_attention(q, k_f32[0], v_f32[0], tables, cu, seq_lens, 0.25)
    assert torch.equal(fp8, f32)
    qd = q[:2]
    for twin in (reference.paged_decode_attention, reference.torch_decode_attention):
        fp8 = twin(qd, k_fp8[0], v_fp8[0], tables, seq_lens, 0.25, k_scale=k_scale,
                   v_scale=v_scale)
        assert torch.equal(fp8, twin(qd, k_f32[0], v_f32[0], tables, seq_lens, 0.25)), twin


def test_swap_and_copy_move_fp8_pages_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    gpu_k, gpu_v = (torch.randn(LAYERS, BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=gen)
                    .mul(100).clamp(-448, 448).to(FP8) for _ in range(2))
    gpu_k[0, 1, 0, 0, 0] = float("nan")  # a NaN page travels as it is too
    cpu_k, cpu_v = caches(FP8)
    reference.swap_blocks(gpu_k, gpu_v, cpu_k, cpu_v, torch.tensor([[1, 5], [4, 0]]))
    assert torch.equal(bits(cpu_k[:, [5, 0]]), bits(gpu_k[:, [1, 4]]))
    assert torch.equal(bits(cpu_v[:, [5, 0]]), bits(gpu_v[:, [1, 4]]))
    reference.swap_blocks(cpu_k, cpu_v, gpu_k, gpu_v, torch.tensor([[5, 9], [0, 10]]))
    assert torch.equal(bits(gpu_k[:, [9, 10]]), bits(gpu_k[:, [1, 4]]))
    reference.copy_blocks(gpu_k, gpu_v, torch.tensor([[2, 11]]))
    assert torch.equal(bits(gpu_k[:, 11]), bits(gpu_k[:, 2]))
    assert torch.equal(bits(gpu_v[:, 11]), bits(gpu_v[:, 2]))
