"""New families served by the real services on the CPU backend, from the random-weight folders of
tests/executor_svc/test_model_families.py: greedy output token-identical to transformers (n > 1,
a prefix-cache hit), the generation config's EOS ids stopping as transformers stops, and its
sampling defaults applied to a request that sets nothing, as transformers' generate applies them."""
from __future__ import annotations

import json
import random

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from protos import generate_pb2, generate_pb2_grpc
from tests.executor_svc.test_model_families import VOCAB, write_family_folder
from tests.integration.harness import generate, start_services

pytestmark = pytest.mark.slow

SERVED = ("qwen3", "glm4", "gemma3")
NUM_NEW = 24


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(11)
    first = [rng.randrange(3, VOCAB) for _ in range(40)]
    return {"first": first,
            "shared": first[:32] + [rng.randrange(3, VOCAB) for _ in range(9)],  # 2 pages hit
            "eos": [rng.randrange(3, VOCAB) for _ in range(21)],
            "defaults": [rng.randrange(3, VOCAB) for _ in range(30)]}


def _hf_generate(model, prompt: list[int], config: GenerationConfig) -> list[int]:
    """What transformers' generate gives with `config` as the model's own generation config."""
    model.generation_config = config
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def _greedy(**kwargs) -> GenerationConfig:
    return GenerationConfig(do_sample=False, pad_token_id=0, **kwargs)


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    """(family, the services, the references): the folder gets a generation_config.json whose
    second EOS id is a token greedy decoding of the "eos" prompt reaches, and sampling defaults
    that keep decoding deterministic (top_k 1) but change it (a repetition penalty)."""
    family, folder = request.param, tmp_path_factory.mktemp(request.param)
    write_family_folder(family, folder)
    prompts = _prompts()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    refs = {name: _hf_generate(hf, prompts[name], _greedy(max_new_tokens=NUM_NEW))
            for name in ("first", "shared", "eos")}
    eos = [2, refs["eos"][4]]
    file = dict(eos_token_id=eos, pad_token_id=0, do_sample=True, temperature=0.7, top_k=1,
                repetition_penalty=1.3, max_new_tokens=NUM_NEW - 4)
    (folder / "generation_config.json").write_text(json.dumps(file))
    refs["stopped"] = _hf_generate(hf, prompts["eos"], _greedy(max_new_tokens=NUM_NEW,
                                                               eos_token_id=eos))
    refs["defaults"] = _hf_generate(hf, prompts["defaults"],
                                    GenerationConfig.from_pretrained(folder))
    services = start_services(tmp_path_factory.mktemp(f"{family}-run"),
                              ["--model", str(folder), "--dtype", "float32"])
    yield family, services, prompts, refs
    services.stop()


def _stub(services):
    return generate_pb2_grpc.GeneratorStub(grpc.insecure_channel(services.scheduler_address))


# Greedy, and without the folder's repetition penalty, which a request that leaves it unset gets.
GREEDY = dict(temperature=0.0, repetition_penalty=1.0)


def _samples(stub, prompt: list[int], n: int) -> list[list[int]]:
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), n=n,
                                       sampling=generate_pb2.SamplingParams(**GREEDY))
    req.stopping.max_tokens, req.stopping.ignore_eos = NUM_NEW, True
    out = [[] for _ in range(n)]
    for msg in stub.Generate(req, timeout=120):
        out[msg.sample_index].extend(msg.token_ids)
    return out


def test_greedy_samples_and_a_prefix_cache_hit_match_transformers(served):
    family, services, prompts, refs = served
    stub = _stub(services)
    assert _samples(stub, prompts["first"], 2) == [refs["first"]] * 2, family
    hits = services.metrics().get("pagedserve_prefix_cache_hits_total", 0)
    ids, _, final = generate(stub, prompts["shared"], max_tokens=NUM_NEW, **GREEDY)
    assert ids == refs["shared"], family
    assert services.metrics()["pagedserve_prefix_cache_hits_total"] - hits >= 32


def test_the_generation_configs_eos_ids_stop_as_transformers_stops(served):
    family, services, prompts, refs = served
    assert len(refs["stopped"]) == 5 < NUM_NEW  # the guard: the second EOS id ends it early
    ids, _, final = generate(_stub(services), prompts["eos"], max_tokens=NUM_NEW,
                             ignore_eos=False, **GREEDY)
    assert ids == refs["stopped"], family
    assert final.finish_reason == generate_pb2.FINISH_REASON_STOP_TOKEN
    ids, _, _ = generate(_stub(services), prompts["eos"], max_tokens=NUM_NEW, **GREEDY)
    assert ids == refs["eos"]  # ignore_eos: none of them stops it


def test_a_request_that_sets_nothing_takes_the_models_defaults(served):
    """Temperature, top_k, repetition penalty and max_new_tokens from generation_config.json,
    as transformers' generate takes them from the same file."""
    family, services, prompts, refs = served
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompts["defaults"]))
    ids = [t for msg in _stub(services).Generate(req, timeout=120) for t in msg.token_ids]
    assert ids == refs["defaults"], family
    greedy, _, _ = generate(_stub(services), prompts["defaults"], max_tokens=NUM_NEW,
                            **GREEDY)
    assert greedy != ids  # the defaults changed the output: the test can tell them apply
