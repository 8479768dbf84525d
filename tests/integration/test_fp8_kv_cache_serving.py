"""--kv-cache-dtype fp8 through the real processes (CPU backend): greedy output token-identical to
transformers in float32 with the same FP8 round trip of K and V (scales 1.0: a preset carries
none), and ModelInfo, /v1/models and the executor's ready line saying the KV dtype and the
quantization, with the swap space counted in FP8 pages."""
from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from executor_svc.cache_engine import bytes_per_block
from executor_svc.model_config import ModelConfig, preset_hf_config
from protos import generate_pb2
from tests.executor_svc.helpers import hf_greedy
from tests.executor_svc.test_fp8_kv_cache import FP8, fp8_reference
from tests.integration.harness import generate, start_services
from tests.integration.test_observability import wait_for_line

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 290, 400, 31, 77, 3, 250, 1200, 9]
NUM_TOKENS = 20
SWAP_GIB = 0.01


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    services = start_services(tmp_path_factory.mktemp("fp8-kv"), [
        "--model", "preset:tiny", "--backend", "cpu", "--kv-cache-dtype", "fp8",
        "--swap-space", str(SWAP_GIB)])
    yield services
    services.stop()


def test_a_request_is_served_from_an_fp8_cache(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        ids, _, _ = generate(services.stub(channel), PROMPT, max_tokens=NUM_TOKENS)
    assert ids == hf_greedy(fp8_reference("tiny", [(1.0, 1.0)] * 2), PROMPT, NUM_TOKENS)


def test_model_info_models_and_the_ready_line_say_the_kv_dtype(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        info = services.stub(channel).ModelInfo(generate_pb2.ModelInfoRequest(), timeout=10)
    cfg = ModelConfig.from_hf_config(preset_hf_config("tiny"))
    page = bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, info.block_size, FP8)
    assert (info.dtype, info.kv_cache_dtype, info.quantization) == ("float32", "fp8_e4m3", "")
    assert info.num_cpu_blocks == int(SWAP_GIB * 2**30) // page  # a quarter of float32's page
    with urllib.request.urlopen(services.http_url + "/v1/models", timeout=10) as response:
        model = json.load(response)["data"][0]
    assert (model["kv_cache_dtype"], model["quantization"]) == ("fp8_e4m3", "")
    assert model["max_model_len"] == info.max_model_len
    line = wait_for_line(services, "executor", "executor ready on")
    assert "(cpu, float32)," in line
    assert f"{info.num_gpu_blocks} KV pages (cpu, fp8_e4m3)" in line
