"""SmallStepGraphs' input path on the CPU (the same forward on the same static buffers, run
eagerly where there is no CUDA): the real scheduler's plans, two steps in flight, through chunked
prefill, mixed steps, swap and recompute preemption and seeded sampling, give the same tokens
and logprobs as the eager forward; steps too large for the ladder fall back to it."""
import numpy as np
import pytest
import torch

from executor_svc.small_step_graphs import SmallStepGraphs, _layout
from tests.executor_svc.helpers import (
    RunnerLink, ScheduledRun, add_workload, hf_greedy, hf_model, make_runner, make_scheduler,
)


class CountingGraphs(SmallStepGraphs):
    """Counts the steps it ran, those with input ids from an unfinished step, and padding."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_runs = self.num_with_device_tokens = self.num_padded = 0

    def run(self, input_ids, positions, slots, cu_seqlens_q, seq_lens, block_tables, last_rows,
            device_tokens=None):
        self.num_runs += 1
        self.num_with_device_tokens += device_tokens is not None
        self.num_padded += self.padded_size(len(input_ids)) > len(input_ids)
        return super().run(input_ids, positions, slots, cu_seqlens_q, seq_lens, block_tables,
                           last_rows, device_tokens)


def scheduled_run(overlap: bool, num_cpu_blocks: int, graphs: bool):
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=12, num_cpu_blocks=num_cpu_blocks)
    if graphs:  # sizes small enough that some steps do not fit and run eagerly
        runner.small_step_graphs = CountingGraphs(
            runner.model, runner.cache_engine.kv_caches, runner.info.num_gpu_blocks,
            token_sizes=(2, 4, 8), max_seqs=4)
    sched = make_scheduler(runner.info, max_num_batched_tokens=16, max_num_seqs=6)
    prompts = add_workload(sched, seed=4)
    run = ScheduledRun(sched, RunnerLink(runner, overlap)).run()
    return run, runner, sched, prompts


@pytest.mark.parametrize("num_cpu_blocks", [16, 0])  # preemption by swap, then by recompute
def test_small_step_path_gives_the_eager_tokens_and_logprobs(num_cpu_blocks):
    eager, _, _, _ = scheduled_run(True, num_cpu_blocks, graphs=False)
    graphed, runner, sched, prompts = scheduled_run(True, num_cpu_blocks, graphs=True)
    graphs = runner.small_step_graphs
    assert graphed.outputs == eager.outputs
    num_logprobs = 0
    for (step_a, a), (step_b, b) in zip(graphed.results, eager.results, strict=True):
        assert step_a == step_b and [x[:2] for x in a] == [x[:2] for x in b]
        got, want = ([x[2] for x in run if x[2] is not None] for run in (a, b))
        num_logprobs += len(got)
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)
    assert num_logprobs > 0
    # The path was taken, padded, fed from unfinished steps, and left for larger steps.
    num_other = sum(1 for _, sampled in graphed.results if sampled) - graphs.num_runs
    assert graphs.num_runs > 5 and graphs.num_padded > 0 and graphs.num_with_device_tokens > 0
    assert num_other > 0
    assert (sched.num_preemptions_swap if num_cpu_blocks else sched.num_preemptions_recompute)
    hf = hf_model("tiny")
    for seq_id in range(1, 11, 2):  # the greedy ones
        out = graphed.outputs[seq_id]
        assert out == hf_greedy(hf, prompts[seq_id], len(out)), seq_id


def test_can_run_bounds_tokens_seqs_and_table_width():
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=12)
    graphs = SmallStepGraphs(runner.model, runner.cache_engine.kv_caches, 6,
                             token_sizes=(4, 16), max_seqs=3)
    assert graphs.can_run(16, 3, 6) and graphs.can_run(1, 1, 1)
    assert not graphs.can_run(17, 1, 1)
    assert not graphs.can_run(4, 4, 1)
    assert not graphs.can_run(4, 1, 7)
    assert [graphs.padded_size(n) for n in (1, 4, 5, 16)] == [4, 4, 16, 16]


def test_padding_writes_no_slot_and_gives_pad_seqs_no_query_tokens():
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=12)
    graphs = SmallStepGraphs(runner.model, runner.cache_engine.kv_caches, 6,
                             token_sizes=(8,), max_seqs=3)
    # The cache starts uninitialised: it may hold NaN (unequal to its copy) or, in memory freed
    # by the test's other case, the very values this step writes (no change to see).
    for c in runner.cache_engine.kv_caches:
        c.zero_()
    before = [c.clone() for c in runner.cache_engine.kv_caches]
    tables = np.array([[3, 5], [7, 0]])
    logits = graphs.run(np.array([11, 12, 13, 14, 15]), np.array([0, 1, 2, 0, 1]),
                        np.array([12, 13, 14, 28, 29]), np.array([0, 3, 5]), np.array([3, 2]),
                        tables, np.array([2, 4]))
    assert logits.shape == (2, runner.model.config.vocab_size)
    assert graphs.slot_mapping[5:].tolist() == [-1] * 3
    assert graphs.cu_seqlens_q.tolist() == [0, 3, 5, 5]
    assert graphs.seq_lens.tolist() == [3, 2, 0]
    changed = {int(b) for c, c0 in zip(runner.cache_engine.kv_caches, before)
               for b in torch.nonzero((c != c0).flatten(2).any(-1).any(0)).flatten()}
    assert changed == {3, 7}  # the two seqs' first blocks (slots 12-14 and 28-29), nothing else
    assert _layout(8, 3)["tables"] == 5 * 8 + 4 + 3 + 3
