"""PiecewiseGraphs on the CPU (the same pieces on the same static buffers, run eagerly in place
of replays, attention between them): the real scheduler's plans with two steps in flight, through
chunked prefill, mixed steps, swap and recompute preemption and seeded sampling, give the eager
forward's tokens and logprobs; every family's layers give its hidden states; pad rows write no
cache slot; steps past the ladder run eagerly."""
import random

import pytest
import torch

from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.cache_engine import CacheEngine
from executor_svc.model_loader import load_model
from executor_svc.piecewise_graphs import PiecewiseGraphs
from tests.executor_svc.helpers import (
    assert_same_results,
    RunnerLink, ScheduledRun, add_workload, eager_graphs, eager_pieces, hf_greedy, hf_model,
    make_runner, make_scheduler,
)
from tests.executor_svc.test_model_families import FAMILIES, write_family_folder


class CountingPieces(PiecewiseGraphs):
    """Counts the steps it ran and those padded."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_steps = self.num_padded = 0

    def forward(self, input_ids, positions, md):
        self.num_steps += 1
        self.num_padded += self.padded_size(len(input_ids)) > len(input_ids)
        return super().forward(input_ids, positions, md)


def scheduled_run(num_cpu_blocks: int, piece_sizes=()):
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=12, num_cpu_blocks=num_cpu_blocks)
    if piece_sizes:  # no full-step ladder: every step is the piecewise path's or eager
        runner.graphs = eager_graphs(runner, (), ())
        runner.graphs.piecewise = eager_pieces(
            CountingPieces(runner.model, runner.cache_engine.kv_caches, piece_sizes))
    sched = make_scheduler(runner.info, max_num_batched_tokens=16, max_num_seqs=6)
    prompts = add_workload(sched, seed=4)
    run = ScheduledRun(sched, RunnerLink(runner, overlap=True)).run()
    return run, runner, sched, prompts


@pytest.mark.parametrize("num_cpu_blocks", [16, 0])  # preemption by swap, then by recompute
def test_piecewise_path_gives_the_eager_tokens_and_logprobs(num_cpu_blocks):
    eager, _, _, _ = scheduled_run(num_cpu_blocks)
    # 13-16 token steps are past the ladder: eager beside the pieces
    pieced, runner, sched, prompts = scheduled_run(num_cpu_blocks, (4, 8, 12))
    assert_same_results(pieced, eager)
    pieces = runner.graphs.piecewise
    num_steps = sum(1 for _, sampled in pieced.results if sampled)
    assert pieces.num_steps > 5 and pieces.num_padded > 0 and num_steps > pieces.num_steps
    assert (sched.num_preemptions_swap if num_cpu_blocks else sched.num_preemptions_recompute)
    hf = hf_model("tiny")
    for seq_id in range(1, 11, 2):  # the greedy ones
        out = pieced.outputs[seq_id]
        assert out == hf_greedy(hf, prompts[seq_id], len(out)), seq_id


BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    made = {}

    def model(name):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            write_family_folder(name, path)
            made[name] = load_model(str(path), "float32")[:2]
        return made[name]
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_pieces_give_its_forward_and_write_only_the_steps_slots(family_models,
                                                                               family):
    """A mixed step (three one-token seqs over 20-token contexts, then a 19-token chunk over 6
    cached tokens: every family's quirks, windows included) through the pieces padded from 22
    to 32 tokens, against the eager forward on a copy of the same cache."""
    model, config = family_models(family)
    rng = random.Random(1)
    caches = []
    for _ in range(2):
        cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                            48, 1, torch.float32, model.backend)
        for c in cache.kv_caches:
            c.zero_()
        caches.append(cache.kv_caches)
    free = list(range(48))
    rng.shuffle(free)
    tables = [free[0:6], free[6:12], free[12:18], free[18:25]]
    computed, scheduled = [20, 20, 20, 6], [1, 1, 1, 19]
    ids = torch.tensor([rng.randrange(3, config.vocab_size) for _ in range(sum(scheduled))])
    positions, md = build_attention_metadata(tables, computed, scheduled, BLOCK_SIZE,
                                             torch.device("cpu"))
    assert md.num_decodes == 3 and md.prefill is not None
    pieces = eager_pieces(PiecewiseGraphs(model, caches[0], (8, 32)))
    for buffer in (pieces.input_ids, pieces.positions, pieces.slot_mapping):  # stale rows
        buffer.copy_(torch.randint(0, 48 * BLOCK_SIZE, buffer.shape))
    got = pieces.forward(ids, positions, md)
    want = model.forward(ids, positions, md, caches[1])
    assert pieces.padded_size(len(ids)) == 32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(caches[0], caches[1]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    # only the step's slots were written
    slots = set(md.slot_mapping.tolist())
    k_cache = caches[0][0]
    for block in range(48):
        for offset in range(BLOCK_SIZE):
            if block * BLOCK_SIZE + offset not in slots:
                assert not k_cache[:, block, :, offset].any(), (block, offset)


def test_holds_only_captured_token_counts():
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=6)
    pieces = PiecewiseGraphs(runner.model, runner.cache_engine.kv_caches, (16, 8))
    assert not pieces.holds(4)  # nothing captured: the eager forward
    eager_pieces(pieces)
    assert pieces.holds(1) and pieces.holds(16) and not pieces.holds(17)
    assert [pieces.padded_size(n) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]
    assert len(pieces.keys()) == 2 * (runner.model.config.num_layers + 1)
    assert pieces.keys()[0] == (0, 16)  # largest first, as the pool's peak wants


def test_the_memory_profile_reserves_what_the_buffers_take():
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=6)
    pieces = PiecewiseGraphs(runner.model, runner.cache_engine.kv_caches, (8, 24))
    buffers = (pieces.input_ids, pieces.positions, pieces.slot_mapping, pieces.residual,
               pieces.qkv, pieces.attn_out, pieces.hidden)
    taken = sum(b.numel() * b.element_size() for b in buffers)
    assert taken == PiecewiseGraphs.buffer_bytes(runner.model.config, 24,
                                                 runner.model.embed_tokens.element_size())
