"""SetExecutors between folders of the same config (issue 9, item 11): an executor serving other
weights is refused while a running stream goes on untouched; an identical copy elsewhere is taken."""
from __future__ import annotations

import shutil

import grpc
import pytest

from executor_svc.model_loader import build_hf_model
from protos import generate_pb2
from tests.integration.harness import start_services_with
from tests.integration.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 290, 4000, 31]
NUM_TOKENS = 32


def stream(stub, prompt: list[int], max_tokens: int):
    """A greedy Generate call; yields token ids as they arrive."""
    req = generate_pb2.GenerateRequest()
    req.token_ids.ids.extend(prompt)
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    for msg in stub.Generate(req, timeout=300):
        yield from msg.token_ids


def test_other_weights_refused_identical_copy_taken(tmp_path):
    folder_a, folder_b, copy_a = tmp_path / "a", tmp_path / "b", tmp_path / "elsewhere" / "a2"
    build_hf_model("tiny", seed=0).save_pretrained(folder_a)
    build_hf_model("tiny", seed=1).save_pretrained(folder_b)  # same config.json, other weights
    shutil.copytree(folder_a, copy_a)
    cache = ["--fingerprint-cache-dir", str(tmp_path / "fingerprints")]
    services, [other, copy] = start_services_with(
        tmp_path, ["--model", str(folder_a), *cache],
        others={"other": ["--model", str(folder_b), *cache],
                "copy": ["--model", str(copy_a), *cache]})
    try:
        with grpc.insecure_channel(services.scheduler_address) as channel:
            tokens = stream(services.stub(channel), PROMPT, NUM_TOKENS)
            ids = [next(tokens) for _ in range(4)]
            with pytest.raises(grpc.RpcError) as err:
                services.set_executors(other)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            ids += list(tokens)
        assert ids == hf_greedy(str(folder_a), PROMPT, NUM_TOKENS)
        status = services.status()
        assert status.executor_address == services.executor_address and status.resyncs == 0
        assert "refusing executor" in services.log_of("scheduler")

        assert services.set_executors(copy).address == copy
        with grpc.insecure_channel(services.scheduler_address) as channel:
            assert list(stream(services.stub(channel), PROMPT, 8)) == ids[:8]
        assert services.status().executor_address == copy
    finally:
        services.stop()
