"""Parallel sampling through Generate on real processes (issue 12; slow): n = 4 greedy gives
four identical samples equal to transformers; n = 4 sampled with a seed is reproducible, its
samples distinct and each what a request of its own seeded seed + i gives; every message names
its sample; the pool is whole at the end and the copies are counted."""
from __future__ import annotations

import grpc
import pytest
import torch

from protos import generate_pb2
from tests.integration.hf_reference import hf_model

pytestmark = pytest.mark.slow

TINY = "preset:tiny"
NUM_NEW = 12
PROMPT = [11, 503, 7, 4242, 90, 17, 2048, 31, 64, 5]  # 10 tokens: the 3rd page is copied


@pytest.fixture(scope="module")
def stub(tiny_services):
    with grpc.insecure_channel(tiny_services.scheduler_address) as channel:
        yield tiny_services.stub(channel)


def _samples(stub, n: int, **sampling) -> list[list[int]]:
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=PROMPT), n=n,
        sampling=generate_pb2.SamplingParams(**sampling),
        stopping=generate_pb2.StoppingCriteria(max_tokens=NUM_NEW, ignore_eos=True))
    tokens: list[list[int]] = [[] for _ in range(n)]
    finished = []
    for msg in stub.Generate(req, timeout=300):
        if msg.finished:
            finished.append(msg.sample_index)
            assert msg.completion_tokens == NUM_NEW
        else:
            assert msg.index == len(tokens[msg.sample_index])
            tokens[msg.sample_index].extend(msg.token_ids)
    assert sorted(finished) == list(range(n))
    return tokens


@torch.inference_mode()
def _hf_greedy() -> list[int]:
    out = hf_model(TINY).generate(torch.tensor([PROMPT]), max_new_tokens=NUM_NEW,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_n4_greedy_samples_are_transformers_greedy(stub):
    assert _samples(stub, 4) == [_hf_greedy()] * 4


def test_n4_seeded_samples_are_reproducible_distinct_and_seed_plus_i(stub):
    sampling = dict(temperature=1.0, top_k=50, seed=77)
    first = _samples(stub, 4, **sampling)
    assert _samples(stub, 4, **sampling) == first
    assert len({tuple(t) for t in first}) == 4
    alone = [_samples(stub, 1, **{**sampling, "seed": 77 + i})[0] for i in range(4)]
    assert alone == first


def test_n_out_of_range_is_invalid_argument_naming_n(stub):
    with pytest.raises(grpc.RpcError) as err:
        _samples(stub, 17)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n" in err.value.details()


def test_pages_whole_and_copies_counted(tiny_services, stub):
    before = tiny_services.metrics().get("pagedserve_blocks_copied_total", 0.0)
    _samples(stub, 3)
    # the page of the 10th prompt token (it holds 9 of the prompt's) is copied for 2 samples
    assert tiny_services.metrics()["pagedserve_blocks_copied_total"] - before == 2
    assert tiny_services.status().gpu_blocks_used == 0
