"""AWQ and GPTQ int4 folders on the CUDA backend: projections repacked at load for the W4A16
kernel, which the decode graphs capture; bf16 and fp16 logits within the measured tolerance of
the CPU backend's dequantizing twin and of the dequantize-then-dense model on the GPU, greedy
identical until a near-tie; a group size the kernel cannot read refused naming the layer. On the
CPU: the backend's dispatch, repack and refusals."""
from __future__ import annotations

import dataclasses
import functools
import random
from types import SimpleNamespace

import pytest
import torch

from executor_svc.backends.cuda import (_TUNING_LAYERS, CudaBackend, fp8_groups,
                                        repack_int4)
from executor_svc.config import ExecutorConfig
from executor_svc.cuda_graphs import BATCH_SIZES
from executor_svc.model_loader import DTYPES, ModelSourceError, load_model
from executor_svc.model_runner import ModelRunner
from executor_svc.quantization import Int4Weight
from executor_svc.quantization import config as quant_config
from pagedserve_kernels import quant, reference
from pagedserve_kernels.gemm import LinearTuner
from tests.executor_svc.helpers import (Bf16Reference, PlanDriver,
                                        compare_bf16_with_transformers, decode_all,
                                        loaded_runner, teacher_forced)
from tests.executor_svc.quant_checkpoints import (VOCAB, write_base, write_ct_fp8, write_fp8,
                                                  write_int4)
from tests.gpu import OUTER_VECTOR_CUBLASLT, gpu_ready

# head_dim 64 (4 heads): the attention kernels; down_proj's 1,024 inputs split K on decode rows.
# Weights drawn at 0.1: at the writers' 0.3, attention is near-argmax and bf16 too chaotic for
# the measured tolerance to mean anything (as test_families_gpu's bf16 shapes).
SHAPE = dict(hidden_size=256, intermediate_size=1024, initializer_range=0.1)
# kind -> (family, write_int4's keywords): AutoAWQ GEMM and GPTQ (v1) layouts, act-order or not
KINDS = {
    "awq-g128": ("qwen2", dict(method="awq", group=128)),
    "awq-g32": ("llama", dict(method="awq", group=32)),
    "gptq-g128-sym": ("qwen2", dict(method="gptq", group=128, sym=True)),
    "gptq-g32": ("llama", dict(method="gptq", group=32)),
    "gptq-g128-act-order": ("llama", dict(method="gptq", group=128, desc_act=True)),
    "gptq-g32-act-order-sym": ("qwen2", dict(method="gptq", group=32, sym=True, desc_act=True)),
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN, NUM_NEW = 16, 512, 256, 24
# One prompts' step of 246 rows (the kernel's 64-row tiles, the prefill attention kernel), then
# decode-graph replays of 3 rows (16-row tiles, split K)
LENGTHS = (37, 80, 129)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """folder(kind) -> a quantized folder (written on first use); base(family) -> its dense one."""
    bases, made = {}, {}

    def base(family):
        if family not in bases:
            bases[family] = write_base(tmp_path_factory.mktemp(family), family, **SHAPE)
        return bases[family]

    def folder(kind):
        if kind not in made:
            family, options = KINDS[kind]
            path = tmp_path_factory.mktemp("q") / kind
            write_int4(base(family), path, **options)
            made[kind] = path
        return made[kind]
    return SimpleNamespace(folder=folder, base=base)


def prompts() -> dict[int, list[int]]:
    rng = random.Random(29)
    return {s: [rng.randrange(3, VOCAB) for _ in range(n)] for s, n in enumerate(LENGTHS, 1)}


def make_runner(model, config, backend, dtype_name: str, graphs: bool = False) -> ModelRunner:
    """A runner on a cache of NUM_BLOCKS pages; `graphs`: the decode ladder captured, every step
    sampled eagerly (so a RecordingSampler sees the logits)."""
    return loaded_runner(model, config, backend, dtype_name, BLOCK_SIZE, NUM_BLOCKS,
                         MAX_MODEL_LEN, graphs=graphs)


def greedy_reference(runner: ModelRunner, fp32_runner: ModelRunner, device) -> Bf16Reference:
    """runner's greedy tokens for prompts() and its teacher-forced logits on them, and
    fp32_runner's (what measures the dtype's own error), as compare_bf16_with_transformers
    takes transformers'."""
    asked = prompts()
    driver = PlanDriver(runner)
    decode_all(driver, asked, NUM_NEW)
    tokens = {s: driver.tokens[s][len(p):len(p) + NUM_NEW] for s, p in asked.items()}
    runner.reset()
    ref = Bf16Reference(asked, tokens, {}, {})
    return Bf16Reference(asked, tokens, teacher_forced(runner, ref, device),
                         teacher_forced(fp32_runner, ref, device))


@functools.lru_cache(maxsize=None)
def cuda_backend() -> CudaBackend:
    return CudaBackend()


def cpu_runner(path, dtype_name: str) -> ModelRunner:
    """The CPU backend's dequantizing twin."""
    model, config, _, _ = load_model(str(path), dtype_name)
    return make_runner(model, config, model.backend, dtype_name)


def dense_runner(path, dtype_name: str, backend: CudaBackend) -> ModelRunner:
    """The folder on the GPU with every int4 projection dequantized to a dense weight in the
    model's dtype (in the checkpoint's input order): exactly the values the kernel multiplies,
    through cuBLAS."""
    model, config, _, _ = load_model(str(path), dtype_name, backend.device, 0, backend)
    for layer in model.layers:
        for field in PROJECTIONS:
            setattr(layer, field, dense(getattr(layer, field)).to(DTYPES[dtype_name]))
    return make_runner(model, config, backend, dtype_name)


def dense(weight: Int4Weight) -> torch.Tensor:
    """[N, K] float32 with x's input order: row k of qweight multiplies input perm[k]."""
    w = reference.dequantize_int4(weight.qweight, weight.scales, weight.zeros, weight.group_size)
    if weight.perm is None:
        return w
    out = torch.empty_like(w)
    out[:, weight.perm] = w
    return out


def references(path, dtype_name: str, backend: CudaBackend) -> tuple[Bf16Reference, ...]:
    """(the CPU twin's, the dense GPU model's) greedy references in `dtype_name`, each with the
    CPU twin's float32 logits on its tokens."""
    fp32 = cpu_runner(path, "float32")
    twin = greedy_reference(cpu_runner(path, dtype_name), fp32, backend.device)
    return twin, greedy_reference(dense_runner(path, dtype_name, backend), fp32, backend.device)


def int4_runner(path, dtype_name: str, backend: CudaBackend) -> ModelRunner:
    """The folder on the CUDA backend as the worker prepares it, decode graphs captured."""
    model, config, _, _ = load_model(str(path), dtype_name, backend.device, 0, backend)
    backend.prepare_model(model, None, 512)
    assert all(isinstance(getattr(layer, f), quant.PackedInt4)
               for layer in model.layers for f in PROJECTIONS)
    return make_runner(model, config, backend, dtype_name, graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_int4_on_the_gpu_within_tolerance_of_its_twins(folders, kind, dtype_name):
    """Ours (the kernel, decode graphs replayed) by helpers.compare_bf16_with_transformers' rule
    against the CPU twin in the same dtype, and against the dequantize-then-dense model on the
    GPU (the same attention kernels; cuBLAS multiplies the very weights the kernel does)."""
    path = folders.folder(kind)
    backend = cuda_backend()
    twin, dense_ref = references(path, dtype_name, backend)
    runner = int4_runner(path, dtype_name, backend)
    label = f"{kind} {dtype_name}"
    twin_within, twin_identical = compare_bf16_with_transformers(runner, twin, label + " twin")
    runner.reset()
    dense_within, dense_identical = compare_bf16_with_transformers(runner, dense_ref,
                                                                   label + " dense")
    del runner, twin, dense_ref
    torch.cuda.empty_cache()
    assert all(twin_within.values()), twin_within
    assert all(twin_identical.values()), twin_identical
    assert all(dense_within.values()), dense_within
    assert all(dense_identical.values()), dense_identical


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("scheme", ["dynamic", "static", "per-token"])
def test_fp8_on_the_gpu_within_tolerance_of_its_twin(folders, tmp_path, scheme):
    """AutoFP8's fp8 folder (per-tensor weight scales; dynamic per-tensor or static activation
    scales), or llm-compressor's FP8 dynamic layout (per-channel weights, per-token activations,
    quantized by the norm kernel before each product), through cuBLASLt's scaled product, decode
    graphs replayed, against the CPU twin in bf16 by compare_bf16_with_transformers' rule."""
    path = tmp_path / "fp8"
    if scheme == "per-token":
        write_ct_fp8(folders.base("llama"), path)
    else:
        write_fp8(folders.base("llama"), path, scheme == "static")
    backend = cuda_backend()
    fp32 = cpu_runner(path, "float32")
    twin = greedy_reference(cpu_runner(path, "bfloat16"), fp32, backend.device)
    model, config, _, _ = load_model(str(path), "bfloat16", backend.device, 0, backend)
    backend.prepare_model(model, None, 512)
    runner = make_runner(model, config, backend, "bfloat16", graphs=True)
    within, identical = compare_bf16_with_transformers(runner, twin, f"fp8 {scheme}")
    del runner, twin
    torch.cuda.empty_cache()
    assert all(within.values()), within
    assert all(identical.values()), identical


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_tuned_fp8_products_serve_a_per_token_folder_within_tolerance(folders, tmp_path,
                                                                     monkeypatch):
    """gemm.TUNE_FP8's path in a model: llm-compressor's FP8 dynamic layout with cuBLASLt's
    row-wise product forced at every row count the steps run (the tuned dispatch, its rungs,
    decode graphs capturing it), against the CPU twin by compare_bf16_with_transformers' rule."""
    from pagedserve_kernels import gemm

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 products need Hopper")
    path = tmp_path / "fp8"
    write_ct_fp8(folders.base("llama"), path)
    backend = cuda_backend()
    # a tuner of its own: the forced choices must not outlive the test in the shared backend
    monkeypatch.setattr(backend, "gemm", LinearTuner(backend.device))
    lt = backend.gemm._cublaslt()
    if lt.version < OUTER_VECTOR_CUBLASLT:
        pytest.skip("no outer-vector FP8 product in this cuBLASLt")
    monkeypatch.setattr(gemm, "TUNE_FP8", True)
    fp32 = cpu_runner(path, "float32")
    twin = greedy_reference(cpu_runner(path, "bfloat16"), fp32, backend.device)
    model, config, _, _ = load_model(str(path), "bfloat16", backend.device, 0, backend)
    backend.prepare_model(model, str(tmp_path / "gemm"), 512)
    groups = fp8_groups(model)
    assert set(groups) == {"qkv", "o", "gate_up", "down"}, set(groups)
    report = backend.tune_linears(groups, sorted(set(BATCH_SIZES) | {512}), force_lt=True)
    assert report and all(r["best"] is not None for r in report), report
    launches = []  # rows of each product cuBLASLt ran (a refused launch falls back unrecorded)
    product = lt.fp8_matmul
    monkeypatch.setattr(lt, "fp8_matmul",
                        lambda *a: (product(*a), launches.append(a[1].shape[0]))[0])
    runner = make_runner(model, config, backend, "bfloat16", graphs=True)
    captured = set(launches)  # the decode graphs' captures
    launches.clear()
    within, identical = compare_bf16_with_transformers(runner, twin, "fp8 per-token tuned")
    del runner, twin
    torch.cuda.empty_cache()
    assert captured and min(captured) == 1, sorted(captured)
    # eager steps at row counts no graph has (a prefill step): untuned rows through a rung
    assert set(launches) - set(BATCH_SIZES), sorted(set(launches))
    assert all(within.values()), within
    assert all(identical.values()), identical


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_the_worker_serves_an_int4_folder_through_its_graphs(folders):
    """What the executor runs: Worker repacks at load (prepare_model), profiles memory through
    the kernel, captures decode and small-step graphs that sample in the graph, warms up. Its
    greedy tokens equal the dense model's until the dense top-2 margin is within twice the
    largest logit difference a runner of ours showed at that position."""
    from executor_svc.worker import Worker

    path = folders.folder("gptq-g128-act-order")
    backend = cuda_backend()
    _, dense_ref = references(path, "bfloat16", backend)
    ours = teacher_forced(int4_runner(path, "bfloat16", backend), dense_ref, backend.device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    worker = Worker(ExecutorConfig(model=str(path), backend="cuda", dtype="bfloat16",
                                   max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512,
                                   gpu_memory_utilization=(total - free + 3 * 2**30) / total,
                                   swap_space_gib=0.01))
    limits = worker.step_limits
    assert worker.info.quantization == "gptq int4 g128 asym act-order"
    assert limits.decode_graph_sizes and limits.small_step_graph_sizes
    assert all(isinstance(getattr(layer, f), quant.PackedInt4)
               for layer in worker.model.layers for f in PROJECTIONS)
    driver = PlanDriver(worker.runner)
    decode_all(driver, dense_ref.prompts, NUM_NEW)
    del worker
    torch.cuda.empty_cache()
    for s, prompt in dense_ref.prompts.items():
        tolerance = (ours[s] - dense_ref.logits[s]).abs().max(dim=-1).values
        top2 = dense_ref.logits[s].topk(2, dim=-1).values
        near_tie = ((top2[:, 0] - top2[:, 1]) <= 2 * tolerance).nonzero()
        stop = int(near_tie[0]) if len(near_tie) else NUM_NEW
        got = driver.tokens[s][len(prompt):len(prompt) + NUM_NEW]
        print(f"worker seq {s}: identical through {stop}/{NUM_NEW} required")
        assert got[:stop] == dense_ref.tokens[s][:stop], s


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_a_group_size_the_kernel_cannot_read_is_refused_at_load(folders, tmp_path, monkeypatch):
    """Group 16: the quantization_config is refused before any tensor loads; with the parser's
    list widened (as a twin-only method could), the CUDA worker refuses it naming the layer."""
    from executor_svc.worker import Worker

    path = tmp_path / "awq-g16"
    write_int4(folders.base("llama"), path, "awq", 16)
    config = ExecutorConfig(model=str(path), backend="cuda", num_gpu_blocks=64,
                            max_model_len=MAX_MODEL_LEN, swap_space_gib=0.01)
    with pytest.raises(ModelSourceError, match="awq group_size 16 is not supported"):
        Worker(config)
    monkeypatch.setattr(quant_config, "GROUP_SIZES", (16, *quant_config.GROUP_SIZES))
    with pytest.raises(ValueError) as err:
        Worker(config)
    assert str(err.value).startswith("model.layers.0.self_attn.qkv_proj: int4 group size 16 is "
                                     "not supported by the CUDA backend's W4A16 kernel")
    assert "\n" not in str(err.value)


# -- CPU: dispatch, repack and refusals without a GPU ----------------------------------------------

class _Tuner(LinearTuner):
    """A LinearTuner on the CPU that records what tune is given and tunes nothing (so every
    product is the library's own)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.groups, self.given = [], []

    def tune(self, rows, groups, force_lt=False):
        self.groups.append(sorted(groups))
        self.given.append(groups)
        return []


def _offline_backend() -> tuple[CudaBackend, list]:
    """A CudaBackend without a device (its __init__ needs one): a recording tuner, and a quant
    module whose prepare(), tune_dequant_rows() and int4_linear record their calls."""
    backend = object.__new__(CudaBackend)
    backend.device, backend.gemm, calls = torch.device("cpu"), _Tuner(), []
    backend._quant = SimpleNamespace(
        prepare=lambda *args: calls.append(("prepare", *args)),
        tune_dequant_rows=lambda w, device, rows_list: calls.append(
            ("tune", len(w), rows_list)) or {},
        TILE_CANDIDATES=quant.TILE_CANDIDATES,
        tile_choice=lambda device, dtype: {},
        launches_programmatically=lambda device: False,
        NEVER=1 << 30,
        int4_linear=lambda x, w, bias=None: calls.append(("int4_linear", x, w, bias)) or "kernel")
    return backend, calls


@pytest.mark.parametrize("kind", ["awq-g32", "gptq-g32-act-order-sym"])
def test_prepare_model_repacks_int4_once_and_tunes_only_dense_products(folders, kind):
    path = folders.folder(kind)
    model, _, _, _ = load_model(str(path), "bfloat16")
    loaded = [[getattr(layer, f) for f in PROJECTIONS] for layer in model.layers]
    backend, calls = _offline_backend()
    backend.prepare_model(model, None, 512)
    largest = max(w.shape[0] * w.shape[1] for row in loaded for w in row)  # the scratch's size
    tuned = min(len(model.layers), _TUNING_LAYERS)  # the first layers' products
    assert calls == [("prepare", torch.device("cpu"), largest, torch.bfloat16),
                     ("tune", len(PROJECTIONS) * tuned, BATCH_SIZES + quant.TILE_CANDIDATES)]
    assert backend.gemm.groups == [["lm_head"], []]  # decode rows, then step rows (no lm_head)
    for layer, weights in zip(model.layers, loaded):
        for field, weight in zip(PROJECTIONS, weights):
            packed = getattr(layer, field)
            assert isinstance(packed, quant.PackedInt4) and packed.dtype == torch.bfloat16
            qweight, scales, zeros = quant.unpack(packed)
            assert torch.equal(qweight, weight.qweight) and torch.equal(scales, weight.scales)
            assert torch.equal(zeros, weight.zeros) if weight.zeros is not None else zeros is None
            assert (packed.perm is None) == (weight.perm is None) == ("act-order" not in kind)
            assert packed.perm is None or torch.equal(packed.perm, weight.perm)
    backend.prepare_model(model, None, 512)  # nothing left to repack: no second prepare
    assert len(calls) == 2


@pytest.mark.parametrize("scheme", ["per-token", "per-tensor"])
@pytest.mark.parametrize("tune_fp8", [True, False])
def test_prepare_model_tunes_per_token_fp8_products_as_weight_and_scale_pairs(
        folders, tmp_path, monkeypatch, scheme, tune_fp8):
    """With gemm.TUNE_FP8, llm-compressor's FP8 dynamic layout (rows quantized per token by a
    kernel): each layer product's group is its (e4m3 weight, scale a channel) pairs, beside the
    dense lm_head; AutoFP8's per-tensor activations keep torch's product, untuned; without it,
    only lm_head."""
    from pagedserve_kernels import gemm

    monkeypatch.setattr(gemm, "TUNE_FP8", tune_fp8)
    path = tmp_path / "fp8"
    if scheme == "per-token":
        write_ct_fp8(folders.base("llama"), path)
    else:
        write_fp8(folders.base("llama"), path, False)
    model, _, _, _ = load_model(str(path), "bfloat16")
    backend, _ = _offline_backend()
    backend.prepare_model(model, None, 512)
    products = ["down", "gate_up", "o", "qkv"] if scheme == "per-token" and tune_fp8 else []
    assert backend.gemm.groups == [sorted(products + ["lm_head"]), products]
    for given in backend.gemm.given:
        for name in products:
            pairs = given[name]
            weights = model.linear_groups()[name]
            assert len(pairs) == len(weights)
            for (w, scale), weight in zip(pairs, weights):
                assert w is weight.weight and scale is weight.weight_scale
                assert w.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0],)
    if scheme == "per-token" and tune_fp8:
        # a bias (sent to torch's product) or fp16 rows (which the tuned product does not
        # write): not tuned
        model.layers[1].qkv_bias = torch.zeros(model.layers[1].qkv_proj.shape[0],
                                               dtype=torch.bfloat16)
        assert sorted(fp8_groups(model)) == ["down", "gate_up", "o"]
        model.embed_tokens = model.embed_tokens.half()
        assert fp8_groups(model) == {}


def test_linear_dispatches_by_weight_kind(folders):
    """Dense: the tuner; packed: the kernel with the bias; an Int4Weight (a float32 model, which
    prepare_model leaves loaded): the twin, on the GPU too."""
    model, _, _, _ = load_model(str(folders.folder("awq-g128")), "float32")
    backend, calls = _offline_backend()
    backend.prepare_model(model, None, 512)
    layer = model.layers[0]
    assert isinstance(layer.qkv_proj, Int4Weight) and not calls
    x = torch.randn(3, model.config.hidden_size)
    w = layer.qkv_proj
    assert torch.equal(backend.linear(x, w, layer.qkv_bias), reference.int4_linear(
        x, w.qweight, w.scales, w.zeros, w.group_size, w.perm, layer.qkv_bias))
    packed = quant.repack(w.qweight, w.scales.bfloat16(), w.zeros, w.group_size, w.perm)
    bias = layer.qkv_bias.bfloat16()
    assert backend.linear(x.bfloat16(), packed, bias) == "kernel"
    assert calls[-1][2] is packed and calls[-1][3] is bias
    backend.gemm.linear = lambda x, w, bias=None, out=None: "gemm"
    assert backend.linear(x, model.lm_head) == "gemm"


def test_per_token_fp8_rows_are_quantized_by_a_kernel_where_the_kernels_run(monkeypatch):
    """FP8 dispatch without a device: a per-token dynamic weight takes SiLU-and-mul's rows from
    ops.silu_and_mul_fp8 and a plain bf16 x's from ops.quantize_fp8, into the scaled product;
    per-tensor scales, float32 rows or fused_ops off keep torch's quantization (fp8_linear), a
    shape cuBLASLt refuses the twin."""
    from executor_svc.quantization import Fp8Activation, Fp8Weight
    from pagedserve_kernels import fp8

    backend, calls = _offline_backend()
    backend.fused_ops = True

    def record(name, result):
        return lambda x, *args: calls.append((name, x)) or result
    backend._ops = SimpleNamespace(silu_and_mul_fp8=record("silu_and_mul_fp8", ("q", "s")),
                                   quantize_fp8=record("quantize_fp8", ("q", "s")),
                                   silu_and_mul=record("silu_and_mul", "act"))
    monkeypatch.setattr(fp8, "fp8_scaled_linear", record("scaled", "out"))
    monkeypatch.setattr(fp8, "fp8_linear", record("fp8_linear", "out"))
    monkeypatch.setattr(reference, "fp8_linear", record("twin", "out"))
    e4m3, ones = torch.zeros(32, 64, dtype=torch.float8_e4m3fn), torch.ones(32)
    per_token, per_tensor = Fp8Weight(e4m3, ones, None, True), Fp8Weight(e4m3, ones, None, False)
    odd = Fp8Weight(torch.zeros(32, 72, dtype=torch.float8_e4m3fn), ones, None, True)
    x, gate_up = torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(3, 128, dtype=torch.bfloat16)

    act = backend.silu_and_mul(gate_up, feeds=per_token)
    assert act == Fp8Activation("q", "s", torch.bfloat16)
    assert backend.linear(act, per_token) == backend.linear(x, per_token) == "out"
    assert calls == [("silu_and_mul_fp8", gate_up), ("scaled", "q"), ("quantize_fp8", x),
                     ("scaled", "q")]
    calls.clear()
    assert backend.silu_and_mul(gate_up) == backend.silu_and_mul(gate_up, feeds=per_tensor)
    backend.linear(x, per_tensor)
    backend.linear(x.float(), per_token)
    backend.linear(x[:, :8].repeat(1, 9), odd)
    assert [name for name, _ in calls] == ["silu_and_mul", "silu_and_mul", "fp8_linear",
                                           "fp8_linear", "twin"]
    calls.clear()
    backend.fused_ops = False
    assert torch.equal(backend.silu_and_mul(gate_up, feeds=per_token), x)  # the twin: zeros
    backend.linear(x, per_token)
    assert [name for name, _ in calls] == ["fp8_linear"]


def test_check_model_takes_int4_and_per_channel_fp8_and_refuses_block_wise_fp8(folders):
    _, config, _, _ = load_model(str(folders.folder("gptq-g32")), "float32")
    CudaBackend.check_model(config)
    CudaBackend.check_model(dataclasses.replace(config, quantization="fp8 w8a8 dynamic"))
    block = dataclasses.replace(config, quantization="fp8 w8a8 dynamic block 128x128")
    with pytest.raises(ValueError, match="fp8 w8a8 dynamic block 128x128 needs a block-wise FP8 "
                                         "product, which the CUDA backend does not have yet"):
        CudaBackend.check_model(block)


def test_repack_refuses_a_group_size_naming_the_layer_and_repacks_nothing(folders, tmp_path,
                                                                          monkeypatch):
    path = tmp_path / "awq-g16"
    write_int4(folders.base("llama"), path, "awq", 16)
    with pytest.raises(ModelSourceError, match="awq group_size 16 is not supported"):
        load_model(str(path), "bfloat16")
    monkeypatch.setattr(quant_config, "GROUP_SIZES", (16, *quant_config.GROUP_SIZES))
    model, _, _, _ = load_model(str(path), "bfloat16")  # the CPU twin serves any group size
    with pytest.raises(ValueError) as err:
        repack_int4(model)
    assert str(err.value) == (
        "model.layers.0.self_attn.qkv_proj: int4 group size 16 is not supported by the CUDA "
        "backend's W4A16 kernel (a multiple of 32, or one group per output channel); --backend "
        "cpu computes it")
    assert all(isinstance(getattr(layer, f), Int4Weight)
               for layer in model.layers for f in PROJECTIONS)
