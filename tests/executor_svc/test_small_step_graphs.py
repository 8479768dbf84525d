"""CudaGraphs' small-step ladder on the CPU (the same forward on the same static buffers, run
eagerly in place of replays): the real scheduler's plans, two steps in flight, through chunked
prefill, mixed steps, swap and recompute preemption and seeded sampling, give the same tokens
and logprobs as the eager forward, alone and beside the decode ladder on the same buffers; steps
too large for the ladders fall back to it."""
import numpy as np
import pytest
import torch

from executor_svc.cuda_graphs import DECODE, SMALL_STEP, CudaGraphs, GraphInputs, _layout
from tests.executor_svc.helpers import (
    assert_same_results,
    RunnerLink, ScheduledRun, add_workload, eager_graphs, hf_greedy, hf_model, make_runner,
    make_scheduler,
)


class CountingGraphs(CudaGraphs):
    """Counts the steps it ran (`ladders`: each one's ladder), those with input ids from an
    unfinished step, and padding."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ladders, self.num_with_device_tokens, self.num_padded = [], 0, 0

    def run(self, inputs, sampling=None, *args):
        self.ladders.append(DECODE if inputs.is_decode else SMALL_STEP)
        self.num_with_device_tokens += inputs.device_tokens is not None
        num_tokens = len(inputs.input_ids)
        self.num_padded += self.padded_size(num_tokens, inputs.is_decode) > num_tokens
        return super().run(inputs, sampling, *args)


def small_step_graphs(runner, token_sizes, max_seqs, graphs_class=CudaGraphs, batch_sizes=()):
    """A small-step ladder (and no decode graphs unless batch_sizes), replayed eagerly."""
    return eager_graphs(runner, batch_sizes, token_sizes, graphs_class, max_seqs=max_seqs)


def scheduled_run(overlap: bool, num_cpu_blocks: int, graphs: bool, batch_sizes=()):
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=12, num_cpu_blocks=num_cpu_blocks)
    if graphs:  # sizes small enough that some steps do not fit and run eagerly
        runner.graphs = small_step_graphs(runner, (2, 4, 8), 4, CountingGraphs, batch_sizes)
    sched = make_scheduler(runner.info, max_num_batched_tokens=16, max_num_seqs=6)
    prompts = add_workload(sched, seed=4)
    run = ScheduledRun(sched, RunnerLink(runner, overlap)).run()
    return run, runner, sched, prompts


# preemption by swap, then by recompute; then with decode steps through the decode ladder
@pytest.mark.parametrize("num_cpu_blocks, batch_sizes", [(16, ()), (0, ()), (16, (1, 2, 4))])
def test_small_step_path_gives_the_eager_tokens_and_logprobs(num_cpu_blocks, batch_sizes):
    eager, _, _, _ = scheduled_run(True, num_cpu_blocks, graphs=False)
    graphed, runner, sched, prompts = scheduled_run(True, num_cpu_blocks, True, batch_sizes)
    graphs = runner.graphs
    assert_same_results(graphed, eager)
    # The path was taken, padded, fed from unfinished steps, and left for larger steps.
    num_other = sum(1 for _, sampled in graphed.results if sampled) - len(graphs.ladders)
    assert graphs.ladders.count(SMALL_STEP) > (1 if batch_sizes else 5)
    assert graphs.num_padded > 0 and graphs.num_with_device_tokens > 0 and num_other > 0
    if batch_sizes:  # a small step after decode steps, on the buffers they wrote
        assert graphs.ladders.count(DECODE) > 5
        assert SMALL_STEP in graphs.ladders[graphs.ladders.index(DECODE):]
    assert (sched.num_preemptions_swap if num_cpu_blocks else sched.num_preemptions_recompute)
    hf = hf_model("tiny")
    for seq_id in range(1, 11, 2):  # the greedy ones
        out = graphed.outputs[seq_id]
        assert out == hf_greedy(hf, prompts[seq_id], len(out)), seq_id


def test_choose_bounds_tokens_seqs_and_table_width():
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=6)
    graphs = small_step_graphs(runner, (4, 16), 3)
    for decode in (False, True):  # no decode ladder: a decode step takes the small one
        assert graphs.choose(16, 3, 6, decode) == graphs.choose(1, 1, 1, decode) == SMALL_STEP
    assert graphs.choose(17, 1, 1, False) is None
    assert graphs.choose(4, 4, 1, False) is None
    assert graphs.choose(4, 1, 7, False) is None
    assert [graphs.padded_size(n, False) for n in (1, 4, 5, 16)] == [4, 4, 16, 16]
    graphs.graphs = {}  # not captured: nothing replays
    assert graphs.choose(1, 1, 1, False) is None


def test_choose_prefers_the_decode_ladder_for_one_token_steps():
    """A step of one token a seq that may sample in the graph takes the decode ladder while it
    holds the seqs, then the small-step ladder; any other step the small-step ladder."""
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=6)
    graphs = eager_graphs(runner, (1, 2), (4, 8), max_seqs=3)
    assert graphs.choose(2, 2, 6, True) == DECODE
    assert graphs.choose(3, 3, 6, True) == graphs.choose(2, 2, 6, False) == SMALL_STEP
    assert graphs.choose(4, 4, 6, True) is None
    assert graphs.choose(2, 2, 7, True) is None
    assert [graphs.padded_size(n, True) for n in (1, 2)] == [1, 2]


def test_padding_writes_no_slot_and_gives_pad_seqs_no_query_tokens():
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=12)
    graphs = small_step_graphs(runner, (8,), 3)
    # The cache starts uninitialised: it may hold NaN (unequal to its copy) or, in memory freed
    # by the test's other case, the very values this step writes (no change to see).
    for c in runner.cache_engine.kv_caches:
        c.zero_()
    before = [c.clone() for c in runner.cache_engine.kv_caches]
    tables = np.array([[3, 5], [7, 0]])
    logits, sampled = graphs.run(GraphInputs(
        np.array([11, 12, 13, 14, 15]), np.array([0, 1, 2, 0, 1]), np.array([12, 13, 14, 28, 29]),
        np.array([3, 2]), tables, np.array([0, 3, 5]), np.array([2, 4])))
    assert sampled is None
    assert logits.shape == (2, runner.model.config.vocab_size)
    assert graphs.slot_mapping[5:].tolist() == [-1] * 3
    assert graphs.cu_seqlens_q.tolist() == [0, 3, 5, 5]
    assert graphs.seq_lens.tolist() == [3, 2, 0]
    changed = {int(b) for c, c0 in zip(runner.cache_engine.kv_caches, before)
               for b in torch.nonzero((c != c0).flatten(2).any(-1).any(0)).flatten()}
    assert changed == {3, 7}  # the two seqs' first blocks (slots 12-14 and 28-29), nothing else
    assert _layout(8, 3)["tables"] == 5 * 8 + 4 + 3 + 3
