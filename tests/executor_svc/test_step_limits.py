"""The executor's step limits: vLLM's defaults by device memory and name, flags that stand, the
graph sizes they call for, and what Describe carries of them to the scheduler."""
import pytest
import torch

from executor_svc import wire
from executor_svc.config import ExecutorConfig
from executor_svc.cuda_graphs import BATCH_SIZES, TOKEN_SIZES
from executor_svc.model_loader import load_model
from executor_svc.step import ExecutorInfo, StepLimits
from executor_svc.step_limits import (Device, choose_step_limits, decode_graph_sizes,
                                      device_of, piecewise_graph_sizes, small_step_graph_sizes,
                                      vllm_batch_defaults)
from executor_svc.worker import Worker
from scheduler_svc import wire as scheduler_wire

GIB = 1 << 30


@pytest.mark.parametrize("name, total_memory, expected", [
    ("NVIDIA H100 80GB HBM3", 85_045_231_616, (8192, 1024)),  # 79.2 GiB, as torch reports it
    ("NVIDIA H200", 150_110_011_392, (8192, 1024)),
    ("AMD Instinct MI300X", 205_822_885_888, (8192, 1024)),
    ("NVIDIA GH200 480GB", 101_468_602_368, (8192, 1024)),
    ("NVIDIA A100-SXM4-80GB", 85_097_971_712, (2048, 256)),  # vLLM excludes the A100 by name
    ("nvidia a100 80gb pcie", 85_097_971_712, (2048, 256)),
    ("NVIDIA A100-SXM4-40GB", 42_505_273_344, (2048, 256)),
    ("NVIDIA L40S", 48_305_799_168, (2048, 256)),
    ("NVIDIA GeForce RTX 4090", 25_393_692_672, (2048, 256)),
    ("a GPU of exactly 70 GiB", 70 * GIB, (8192, 1024)),
    ("a GPU a byte short of 70 GiB", 70 * GIB - 1, (2048, 256)),
])
def test_vllm_rule_on_gpus(name, total_memory, expected):
    assert vllm_batch_defaults(Device("cuda", name, total_memory)) == expected


def test_vllm_rule_on_the_cpu_whatever_its_memory():
    assert vllm_batch_defaults(Device("cpu", "CPU", 2048 * GIB)) == (2048, 128)
    cpu = device_of(torch.device("cpu"))
    assert cpu.kind == "cpu" and cpu.total_memory > 0 and vllm_batch_defaults(cpu) == (2048, 128)


H100 = Device("cuda", "NVIDIA H100 80GB HBM3", 85_045_231_616)
L40S = Device("cuda", "NVIDIA L40S", 48_305_799_168)
CPU = Device("cpu", "CPU", 64 * GIB)


@pytest.mark.parametrize("device, max_model_len, tokens, seqs, expected", [
    (H100, 4096, None, None, (8192, 1024)),
    (L40S, 4096, None, None, (2048, 256)),
    (CPU, 4096, None, None, (2048, 128)),
    # defaulted: the budget at most max_num_seqs * max_model_len, the seq cap at most the budget
    (H100, 4, None, None, (4096, 1024)),
    (CPU, 8, None, None, (1024, 128)),
    (CPU, 4096, 64, None, (64, 64)),
    (L40S, 100, None, 4, (400, 4)),
    # given values stand, larger than the rule's too
    (H100, 4096, 16384, 2048, (16384, 2048)),
    (L40S, 4096, 8192, None, (8192, 256)),
    (H100, 4096, 32, 64, (32, 64)),
])
def test_choose_step_limits_as_vllm_sets_its_defaults(device, max_model_len, tokens, seqs,
                                                      expected):
    limits = choose_step_limits(device, max_model_len, tokens, seqs)
    assert (limits.max_num_batched_tokens, limits.max_num_seqs) == expected


def test_sources_and_bounds():
    rule = choose_step_limits(H100, 4096)
    assert rule.bounded and rule.source == "vLLM's rule for NVIDIA H100 80GB HBM3, 79.2 GiB"
    assert not choose_step_limits(CPU, 4096).bounded  # the CPU backend profiles nothing
    assert choose_step_limits(H100, 4096, 4096, 512).source == (
        "--max-num-batched-tokens, --max-num-seqs")
    assert choose_step_limits(H100, 4096, None, 512).source == (
        "--max-num-seqs, the other by vLLM's rule for NVIDIA H100 80GB HBM3, 79.2 GiB")


def limits(tokens: int, seqs: int) -> StepLimits:
    return StepLimits(tokens, seqs, True, "test")


@pytest.mark.parametrize("tokens, seqs, expected", [
    (8192, 1024, BATCH_SIZES),
    (8192, 4096, BATCH_SIZES),  # no decode graph above the ladder's 1,024 (eager beyond)
    (2048, 256, tuple(s for s in BATCH_SIZES if s <= 256)),
    (2048, 100, (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100)),  # the cap itself is captured
    (64, 1024, (1, 2, 4, 8, 16, 24, 32, 48, 64)),  # a decode step has a token per seq
    (1, 1, (1,)),
])
def test_decode_graph_sizes_reach_the_largest_decode_step(tokens, seqs, expected):
    assert decode_graph_sizes(limits(tokens, seqs), BATCH_SIZES) == expected


@pytest.mark.parametrize("tokens, seqs, expected", [
    (8192, 1024, TOKEN_SIZES),  # vLLM's largest: min(2 * 1024, 512)
    (2048, 128, (16, 32, 64, 128, 256)),  # min(2 * 128, 512)
    (2048, 100, (16, 32, 64, 128, 200)),
    (100, 256, (16, 32, 64, 100)),  # at most the token budget
    (2048, 4, (8,)),
])
def test_small_step_graph_sizes_by_vllms_capture_ceiling(tokens, seqs, expected):
    assert small_step_graph_sizes(limits(tokens, seqs), TOKEN_SIZES) == expected


@pytest.mark.parametrize("tokens, expected", [
    (8192, tuple(s for s in BATCH_SIZES if 16 <= s <= 1024)),  # to PIECEWISE_MAX_TOKENS
    (300, (16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 300)),  # the budget
    (8, (8,)),  # a budget under the ladder's start
])
def test_piecewise_graph_sizes_reach_the_token_budget_up_to_their_ceiling(tokens, expected):
    assert piecewise_graph_sizes(limits(tokens, 64), BATCH_SIZES) == expected


def test_describe_round_trip_to_the_scheduler():
    sent = StepLimits(8192, 1024, True, "vLLM's rule for NVIDIA H200, 139.8 GiB", BATCH_SIZES,
                      TOKEN_SIZES)
    info = ExecutorInfo("m", "fp", "bfloat16", 16, 100, 0, 4096, 1000, "", "cuda",
                        step_limits=sent)
    raw = wire.info_to_proto(info, instance_id=1).SerializeToString()
    got = scheduler_wire.description_from_proto(
        wire.executor_pb2.DescribeResponse.FromString(raw)).step_limits
    assert (got.max_num_batched_tokens, got.max_num_seqs, got.bounded, got.source) == (
        8192, 1024, True, sent.source)
    assert got.decode_graph_sizes == BATCH_SIZES and got.small_step_graph_sizes == TOKEN_SIZES
    unset = wire.info_to_proto(ExecutorInfo("m", "fp", "float32", 16, 100, 0, 64, 100, "", "cpu"),
                               instance_id=1)
    assert not unset.HasField("step_limits")
    assert scheduler_wire.description_from_proto(unset).step_limits is None


def test_worker_on_the_cpu_recommends_vllms_cpu_defaults_and_captures_nothing():
    info = Worker(ExecutorConfig(model="preset:tiny", num_gpu_blocks=8,
                                 swap_space_gib=0.001)).info
    assert info.step_limits.source.startswith("vLLM's rule for CPU, ")
    assert (info.step_limits.max_num_batched_tokens, info.step_limits.max_num_seqs,
            info.step_limits.bounded) == (2048, 128, False)
    assert info.step_limits.decode_graph_sizes == info.step_limits.small_step_graph_sizes == ()
    flagged = Worker(ExecutorConfig(model="preset:tiny", num_gpu_blocks=8, swap_space_gib=0.001,
                                    max_num_batched_tokens=512, max_num_seqs=300)).info
    assert (flagged.step_limits.max_num_batched_tokens, flagged.step_limits.max_num_seqs) == (
        512, 300)
    assert flagged.step_limits.source == "--max-num-batched-tokens, --max-num-seqs"


def test_a_gpu_workers_profile_and_graphs_follow_its_step_limits(monkeypatch):
    """What the worker asks of a GPU's backend, recorded on the CPU backend: the memory profile
    for the token budget and min(seqs, tokens) sampled rows, graphs of the sizes the limits call
    for (this backend builds none, so Describe names none)."""
    from executor_svc import worker as worker_module
    from executor_svc.backends.cpu import CpuBackend

    asked = {}

    class RecordingBackend(CpuBackend):
        def profile_num_blocks(self, model, block_size, block_bytes, utilization, tokens, seqs):
            asked["profile"] = (tokens, seqs)

        def build_graphs(self, model, kv_caches, max_blocks_per_seq, dtype, decode, tokens,
                         grammars=True, piece_sizes=()):
            asked["graphs"] = (decode, tokens)
            asked["grammars"] = grammars
            asked["pieces"] = piece_sizes
            return None

    monkeypatch.setattr(worker_module, "get_backend", lambda name: RecordingBackend())
    monkeypatch.setattr(worker_module, "device_of", lambda device: H100)
    info = Worker(ExecutorConfig(model="preset:tiny", swap_space_gib=0.001,
                                 max_num_seqs=100)).info
    assert asked == {"profile": (8192, 100),
                     "graphs": ((1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100),
                                (16, 32, 64, 128, 200)),
                     "grammars": bool(info.tokenizer),
                     "pieces": tuple(s for s in BATCH_SIZES if s >= 16)}  # up to 1,024 tokens
    # A model without a tokenizer takes no grammar: no masked twins of the decode graphs.
    monkeypatch.setattr(worker_module, "load_model",
                        lambda *args, **kwargs: (*load_model(*args, **kwargs)[:2], "", "x"))
    Worker(ExecutorConfig(model="preset:tiny", swap_space_gib=0.001, max_num_seqs=100))
    assert asked["grammars"] is False
    assert (info.step_limits.max_num_batched_tokens, info.step_limits.max_num_seqs,
            info.step_limits.bounded) == (8192, 100, True)
    assert info.step_limits.decode_graph_sizes == info.step_limits.small_step_graph_sizes == ()
