"""Quantized folders through the real processes (CPU backend): a GPTQ act-order folder serves
greedy output token-identical to transformers on its dequantized weights, and the executor stops
on an unservable one with one line naming the option, before it serves."""
from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from tests.executor_svc.quant_checkpoints import hf_greedy, write_base, write_int4
from tests.integration.harness import free_port, generate, start_services

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 290, 400, 31, 77, 3, 250]
NUM_TOKENS = 24


def test_a_gptq_act_order_folder_serves_greedy_as_transformers(tmp_path):
    base = write_base(tmp_path / "base", "llama")
    expected = write_int4(base, tmp_path / "gptq", "gptq", 64, desc_act=True)
    services = start_services(tmp_path, ["--model", str(tmp_path / "gptq"), "--backend", "cpu"])
    try:
        with grpc.insecure_channel(services.scheduler_address) as channel:
            ids, _, _ = generate(services.stub(channel), PROMPT, max_tokens=NUM_TOKENS)
    finally:
        services.stop()
    assert ids == hf_greedy("gptq-g64-act-order", base, expected, PROMPT, NUM_TOKENS)


def test_the_executor_refuses_an_unservable_folder_in_one_line(tmp_path):
    base = write_base(tmp_path / "base", "llama")
    folder = tmp_path / "awq"
    write_int4(base, folder, "awq", 32)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "executor_svc.main", "--model", str(folder),
                           "--backend", "cpu", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"pagedserve-executor: error: --model {folder}: awq with 8-bit weights is not supported; "
        "supported: 4-bit"]
