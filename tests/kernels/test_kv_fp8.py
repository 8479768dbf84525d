"""The FP8 KV cache's kernels without a GPU: their lazy module lists exactly what kv_fp8.cu
compiles (the files it includes contribute none of theirs) and warmup() leaves it alone; kernel
names by cache dtype and the decode kernels' stages as built, candidates with no FP8 kernel
refused, shared memory within the launch bounds' CTAs per SM; the scale arguments' checks. The
kernels themselves: test_kernels_gpu.py."""
import re
from pathlib import Path

import pytest
import torch

from pagedserve_kernels import _compile, attention, cache_ops
from tests.kernels.test_launchers import entry_points

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _as_compiled_with(src: str, macro: str) -> str:
    """src without its `#ifndef macro` blocks (nesting followed), as a build defining `macro`
    sees it; other conditionals keep both branches."""
    kept, dropped = [], []  # dropped: per open conditional, whether it drops its lines
    for line in src.splitlines():
        directive = line.strip()
        if directive.startswith("#if"):
            dropped.append(directive.startswith(f"#ifndef {macro}") or any(dropped))
            continue
        if directive.startswith("#endif"):
            dropped.pop()
            continue
        if not any(dropped):
            kept.append(line)
    assert not dropped, "unbalanced #if / #endif"
    return "\n".join(kept)


def test_the_fp8_module_lists_every_kernel_it_compiles():
    src = _compile.load_source("kv_fp8.cu")
    compiled = entry_points(_as_compiled_with(src, "PS_KV_FP8"))
    assert sorted(_compile.MODULES["kv_fp8"][1]) == compiled
    assert len(_compile.MODULES["kv_fp8"][1]) == 26
    # the included sources' own entry points are all behind the guard
    for module in ("attention", "cache", "ops"):
        assert not set(_compile.MODULES[module][1]) & set(_compile.MODULES["kv_fp8"][1])


def test_warmup_leaves_the_fp8_module_to_its_first_launch(monkeypatch):
    loaded = []
    monkeypatch.setattr(_compile, "get_function",
                        lambda module, kernel, device=None, shared_mem=0: loaded.append(module))
    _compile.warmup(0)
    assert "kv_fp8" in _compile.LAZY and "kv_fp8" not in loaded
    assert set(loaded) == set(_compile.MODULES) - _compile.LAZY


def _fp8_decode_builds() -> dict[str, tuple[int, int]]:
    """kv_fp8.cu's one-token decode kernels: {name: (pipeline stages, CTAs an SM it is built
    for)}."""
    source = (Path(attention.__file__).parent / "csrc" / "kv_fp8.cu").read_text()
    return {kernel: (int(stages), int(ctas)) for kernel, stages, ctas in re.findall(
        r"^PS_DECODE_FP8\((decode_\w+?_fp8), [^,]+, \d+, (\d+), (\d+)\)", source, re.MULTILINE)}


def test_kernels_over_an_fp8_cache_are_named_by_it_and_candidates_refused():
    names = [attention.decode_kernel(BF16, 128, fp8=True)[0],
             attention.prefill_kernel(torch.float16, 64, torch.device("cpu"), "mma_sync", fp8=True),
             attention._few_query_kernel(BF16, 64, False, fp8=True)]
    assert names == ["decode_bf16_hd128_fp8", "prefill_fp16_hd64_fp8", "decode_mq_bf16_hd64_fp8"]
    # the launcher's stage counts (its shared memory) are the kernels' own
    built = _fp8_decode_builds()
    assert len(built) == 4
    for kernel, (stages, _) in built.items():
        dtype = BF16 if "_bf16_" in kernel else torch.float16
        head_dim = int(kernel.split("_hd")[1].split("_")[0])
        assert attention.decode_kernel(dtype, head_dim, fp8=True) == (kernel, stages)
    assert {attention._module_of(name) for name in names} == {"kv_fp8"}
    with pytest.raises(ValueError, match="decode variant 's2' has no kernel over an FP8 cache"):
        attention.decode_kernel(BF16, 128, "s2", fp8=True)
    with pytest.raises(ValueError, match="prefill variant 'wg1' has no kernel over an FP8 cache"):
        attention.prefill_kernel(BF16, 64, torch.device("cpu"), "wg1", fp8=True)
    with pytest.raises(ValueError, match="key_split has no few-query kernel over an FP8 cache"):
        attention._few_query_kernel(BF16, 64, True, fp8=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_kernels_fit_the_ctas_per_sm_of_their_launch_bounds(head_dim):
    """Hopper: 228 KiB of shared memory per SM, 1 KiB of it reserved per CTA; the static
    arrays (the wgmma kernel's row list, the mma.sync kernel's page list) included."""
    per_sm = 228 * 1024
    q = torch.empty(1, 1, head_dim, dtype=BF16)
    prefill_ctas = {64: 3, 128: 2}[head_dim]
    wg_ctas = {64: 2, 128: 1}[head_dim]
    _, smem = attention.prefill_launch_shape(f"prefill_bf16_hd{head_dim}_fp8", head_dim, 2)
    assert prefill_ctas * (smem + 128 + 1024) <= per_sm
    _, smem = attention.prefill_launch_shape(f"prefill_wg_bf16_hd{head_dim}_fp8", head_dim, 2)
    assert wg_ctas * (smem + 2048 + 1024) <= per_sm
    # the same bytes as over a bf16 cache: staged bytes double-buffered, one converted tile
    assert smem == attention.prefill_launch_shape(f"prefill_wg_bf16_hd{head_dim}", head_dim, 2)[1]
    # the one-token kernel converts K, then V, into one tile: as many CTAs as it is built for
    kernel, stages = attention.decode_kernel(BF16, head_dim, fp8=True)
    smem = attention._decode_smem(stages, head_dim, q, fp8=True)
    assert smem < attention._decode_smem(attention._DECODE_STAGES[head_dim], head_dim, q)
    assert _fp8_decode_builds()[kernel][1] * (smem + 1024) <= per_sm
    # the few-query kernel converts K and V into a tile each, at the 16-bit kernel's stages
    smem = attention._decode_smem(attention._DECODE_STAGES[head_dim], head_dim, q, fp8=True,
                                  few_query=True)
    assert {64: 1, 128: 2}[head_dim] * (smem + 1024) <= per_sm


def test_an_fp8_cache_needs_one_float32_scale_per_tensor_on_its_device():
    cache = torch.empty(2, 1, 16, 64, dtype=FP8)
    one = torch.tensor(0.5)
    assert cache_ops.kv_scale_args(torch.empty(2, 1, 16, 64, dtype=BF16), None, None) == ()
    k, v = torch.tensor(0.25), torch.tensor([0.125])
    assert cache_ops.kv_scale_args(cache, k, v) == (k.data_ptr(), v.data_ptr())
    for bad in (None, 0.5, torch.tensor(0.5, dtype=torch.float64), torch.ones(2),
                torch.tensor(0.5, dtype=BF16)):
        with pytest.raises(ValueError, match="an FP8 KV cache needs k_scale, the layer's scale, "
                                             "as a one-element float32 tensor on cpu"):
            cache_ops.kv_scale_args(cache, bad, one)
        with pytest.raises(ValueError, match="needs v_scale"):
            cache_ops.kv_scale_args(cache, one, bad)
