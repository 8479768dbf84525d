"""Both services as real processes on localhost: greedy output token-identical to transformers,
swap and recompute preemption, concurrency, page accounting, and bad input."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import generate_pb2
from tests.integration.harness import (LoneExecutor, attach_scheduler, generate,
                                       start_lone_executor, start_services)
from tests.integration.hf_reference import hf_greedy, hf_greedy_later

pytestmark = pytest.mark.slow

TINY = "preset:tiny"


def random_prompts(n: int, seed: int, low: int = 4, high: int = 48, vocab: int = 49152):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.fixture()
def channel(tiny_services):
    with grpc.insecure_channel(tiny_services.scheduler_address) as ch:
        yield ch


def assert_pools_whole(services):
    m = services.metrics()
    assert m["pagedserve_gpu_blocks_used"] == 0, m
    assert m["pagedserve_cpu_blocks_used"] == 0, m
    assert m["pagedserve_requests_running"] == 0 and m["pagedserve_requests_waiting"] == 0


def test_greedy_matches_transformers(tiny_services, channel):
    stub = tiny_services.stub(channel)
    for prompt in random_prompts(4, seed=1):
        ids, _, final = generate(stub, prompt, max_tokens=24)
        assert ids == hf_greedy(TINY, prompt, 24)
        assert final.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert final.completion_tokens == 24 and final.prompt_tokens == len(prompt)


def test_64_concurrent_streams_all_correct(tiny_services, channel):
    stub = tiny_services.stub(channel)
    prompts = random_prompts(64, seed=2)
    lengths = [random.Random(i).randint(8, 40) for i in range(64)]
    expected = hf_greedy_later(TINY, prompts, lengths)
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda a: generate(stub, a[0], max_tokens=a[1]), zip(prompts, lengths)))
    for want, n, (ids, _, final) in zip(expected.result(timeout=300), lengths, results):
        assert ids == want
        assert final.completion_tokens == n
    assert_pools_whole(tiny_services)


def test_text_prompt_streams_decoded_text(tiny_services, channel):
    from scheduler_svc.tokenizer import load_tokenizer
    from executor_svc.model_loader import tokenizer_source

    tokenizer = load_tokenizer(tokenizer_source(TINY))
    ids, text, _ = generate(tiny_services.stub(channel), text="The quick brown fox", max_tokens=12)
    assert ids == hf_greedy(TINY, tokenizer.encode("The quick brown fox"), 12)
    assert text == tokenizer.decode(ids)


def test_seeded_sampling_is_reproducible(tiny_services, channel):
    stub = tiny_services.stub(channel)
    prompt = random_prompts(1, seed=3)[0]
    a, _, _ = generate(stub, prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    b, _, _ = generate(stub, prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    c, _, _ = generate(stub, prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=8)
    assert a == b and a != c


def _request(**fields) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest()
    req.token_ids.ids.extend([5, 6, 7])
    req.stopping.max_tokens = 4
    for path, value in fields.items():
        target = req
        *parents, leaf = path.split(".")
        for p in parents:
            target = getattr(target, p)
        if isinstance(value, list):
            getattr(target, leaf).extend(value)
        else:
            setattr(target, leaf, value)
    return req


BAD_REQUESTS = [
    ("prompt", _request(text="")),
    ("prompt.token_ids", _request(**{"token_ids.ids": [49152 + 5]})),
    ("prompt.token_ids", _request(**{"token_ids.ids": list(range(1, 2100))})),
    ("temperature", _request(**{"sampling.temperature": -0.5})),
    ("top_p", _request(**{"sampling.top_p": 1.5})),
    ("top_p", _request(**{"sampling.top_p": 0.0})),
    ("top_k", _request(**{"sampling.top_k": -2})),
    ("max_tokens", _request(**{"stopping.max_tokens": 0})),
    ("stop_token_ids", _request(**{"stopping.stop_token_ids": [10**6]})),
]


@pytest.mark.parametrize("field,request_", BAD_REQUESTS, ids=[f for f, _ in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_naming_the_field(tiny_services, channel, field, request_):
    stub = tiny_services.stub(channel)
    if field == "prompt":  # an empty text prompt: the oneof is set to ""
        request_.ClearField("token_ids")
        request_.text = ""
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    ids, _, _ = generate(stub, [5, 6, 7], max_tokens=3)  # the server keeps serving
    assert len(ids) == 3


def test_model_info(tiny_services, channel):
    info = tiny_services.stub(channel).ModelInfo(generate_pb2.ModelInfoRequest(), timeout=10)
    assert info.vocab_size == 49152 and info.max_model_len > 0 and info.num_gpu_blocks > 0


def preemption_executor_args(mode: str, executor_args: list[str] = ()) -> list[str]:
    """A 24-page GPU pool, and CPU swap space only for `mode` swap."""
    swap_space = "1" if mode == "swap" else "0"
    return ["--model", TINY, "--num-gpu-blocks", "24", "--swap-space", swap_space, *executor_args]


def check_preemption(tmp_path, mode: str, executor_args: list[str] = (),
                     device: str = "cpu", shared_prefix: int = 0,
                     scheduler_args: list[str] = (), executor: LoneExecutor | None = None,
                     max_tokens: int = 40) -> str:
    """Ten requests on a 24-page GPU pool: `mode` preemption must happen and every output stay
    identical to transformers' (weights drawn on `device`); returns the executor's log.
    With `shared_prefix` tokens common to all prompts (a request of the prefix first, so that
    all ten find its pages cached), a swap-out copies those pages only when the CPU holds them
    nowhere: once, then every other swap-out shares them there. With `executor` (started with
    preemption_executor_args(mode)) only a scheduler is started, attached to it."""
    scheduler_args = ["--max-num-seqs", "16", *scheduler_args]
    services = attach_scheduler(tmp_path, executor, scheduler_args) if executor else \
        start_services(tmp_path, preemption_executor_args(mode, executor_args), scheduler_args)
    try:
        prompts = random_prompts(10, seed=4, low=30, high=50)
        with grpc.insecure_channel(services.scheduler_address) as ch, ThreadPoolExecutor(10) as pool:
            stub = services.stub(ch)
            if shared_prefix:
                prefix = random_prompts(1, seed=6, low=shared_prefix, high=shared_prefix)[0]
                prompts = [prefix + p[:16] for p in prompts]
                generate(stub, prefix + [7], max_tokens=1)
            results = list(pool.map(lambda p: generate(stub, p, max_tokens=max_tokens), prompts))
        for prompt, (ids, _, _) in zip(prompts, results):
            assert ids == hf_greedy(TINY, prompt, max_tokens, device=device)
        m = services.metrics()
        assert m[f'pagedserve_preemptions_total{{mode="{mode}"}}'] > 0, m
        if mode == "swap":
            assert m['pagedserve_blocks_swapped_total{direction="out"}'] > 0
            assert m['pagedserve_blocks_swapped_total{direction="in"}'] > 0
        if shared_prefix:
            num_swaps = m['pagedserve_preemptions_total{mode="swap"}']
            num_prefix_pages = shared_prefix // 16
            assert m['pagedserve_blocks_swap_shared_total{direction="out"}'] >= \
                num_prefix_pages * (num_swaps - 1) > 0, m
            assert m['pagedserve_blocks_swap_shared_total{direction="in"}'] > 0, m
        assert_pools_whole(services)
        return services.log_of("executor")
    finally:
        services.stop()


@pytest.fixture(scope="module")
def preemption_executors(tmp_path_factory):
    """Each mode's executor, both started at once; every scenario of a mode attaches a scheduler
    of its own flags to it in turn (the scheduler holds all the state under test)."""
    executors = {mode: start_lone_executor(tmp_path_factory.mktemp(f"preempt-{mode}"),
                                           preemption_executor_args(mode), wait=False)
                 for mode in ("swap", "recompute")}
    try:
        for executor in executors.values():
            executor.wait()
        yield executors
    finally:
        for executor in executors.values():
            executor.stop()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_outputs_identical(tmp_path, mode, preemption_executors):
    check_preemption(tmp_path, mode, executor=preemption_executors[mode])


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_three_steps_in_flight_keep_outputs_identical(tmp_path, mode, preemption_executors):
    """--max-steps-in-flight 3: the scheduler plans two steps ahead (a seq may have two tokens
    pending; the executor launches two and holds the third plan), through preemption."""
    check_preemption(tmp_path, mode, scheduler_args=["--max-steps-in-flight", "3"],
                     executor=preemption_executors[mode])


def test_swap_preemption_copies_a_shared_prefix_once(tmp_path, preemption_executors):
    """Issue 12: ten prompts that start with the same 32 tokens (two pages, cached). Outputs
    long enough that two swap-outs (what the shared-copy check needs) happen however the ten
    arrive, also when a busy machine admits them a few steps apart."""
    check_preemption(tmp_path, "swap", shared_prefix=32, executor=preemption_executors["swap"],
                     max_tokens=72)


def test_stop_rules_through_the_api(tiny_services, channel):
    from executor_svc.model_loader import tokenizer_source
    from scheduler_svc.tokenizer import load_tokenizer

    stub = tiny_services.stub(channel)
    tokenizer = load_tokenizer(tokenizer_source(TINY))
    prompt = random_prompts(1, seed=5)[0]
    reference = hf_greedy(TINY, prompt, 24)
    # stop token ids: ends at the first occurrence (after min_tokens), the token is included
    stop_id = reference[5]
    first = reference.index(stop_id)
    req = generate_pb2.GenerateRequest()
    req.token_ids.ids.extend(prompt)
    req.stopping.max_tokens = 24
    req.stopping.stop_token_ids.append(stop_id)
    msgs = list(stub.Generate(req, timeout=60))
    assert [t for m in msgs[:-1] for t in m.token_ids] == reference[:first + 1]
    assert msgs[-1].finish_reason == generate_pb2.FINISH_REASON_STOP_TOKEN
    # min_tokens defers the stop id past its first occurrence
    req.stopping.min_tokens = first + 2
    msgs = list(stub.Generate(req, timeout=60))
    out = [t for m in msgs[:-1] for t in m.token_ids]
    assert len(out) >= first + 2 and out == reference[:len(out)]
    # a stop string: the text ends right before it, and it is not included
    full_text = tokenizer.decode(reference)
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    req = generate_pb2.GenerateRequest()
    req.token_ids.ids.extend(prompt)
    req.stopping.max_tokens = 24
    req.stopping.stop.append(stop)
    msgs = list(stub.Generate(req, timeout=60))
    text = "".join(m.text for m in msgs)
    assert msgs[-1].finish_reason == generate_pb2.FINISH_REASON_STOP_STRING
    assert text == full_text[: full_text.index(stop)]


def test_reflection_lists_the_services(tiny_services, channel):
    """What grpcurl relies on: the server describes its services and their messages."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)
    from google.protobuf.descriptor_pool import DescriptorPool

    database = ProtoReflectionDescriptorDatabase(channel)
    services = set(database.get_services())
    assert {"pagedserve.v1.Generator", "grpc.health.v1.Health"} <= services
    assert "pagedserve.v1.Admin" not in services  # it has a listener of its own
    with grpc.insecure_channel(tiny_services.admin_address) as admin_channel:
        admin_services = set(ProtoReflectionDescriptorDatabase(admin_channel).get_services())
    assert {"pagedserve.v1.Admin", "grpc.health.v1.Health"} <= admin_services
    assert "pagedserve.v1.Generator" not in admin_services
    pool = DescriptorPool(database)
    method = pool.FindServiceByName("pagedserve.v1.Generator").methods_by_name["Generate"]
    assert method.output_type.full_name == "pagedserve.v1.GenerateResponse"
