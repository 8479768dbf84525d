"""Sampler: greedy, seeded determinism per position, top-k/top-p/min-p masks, temperature."""
import torch

from executor_svc.sampler import Sampler, filtered_probs
from executor_svc.step import SamplingOptions

VOCAB = 50


def _logits(n=4, seed=0):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_logprob():
    logits = _logits()
    tokens, logprobs = Sampler()(logits, [SamplingOptions()] * 4, [5, 6, 7, 8])
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs), expected)


def test_same_seed_same_position_same_token_and_positions_differ():
    logits = _logits(1).expand(64, VOCAB)
    opts = [SamplingOptions(temperature=1.0, seed=42)] * 64
    first, _ = Sampler()(logits, opts, [10] * 64)
    assert len(set(first)) == 1  # same (seed, position): same draw, whatever the batch row
    again, _ = Sampler()(logits[:1], opts[:1], [10])
    assert again == first[:1]
    by_position, _ = Sampler()(logits, opts, list(range(64)))
    assert len(set(by_position)) > 1  # different positions draw independently
    other_seed, _ = Sampler()(logits, [SamplingOptions(temperature=1.0, seed=7)] * 64, list(range(64)))
    assert other_seed != by_position


def test_top_k_1_equals_greedy():
    logits = _logits(8, seed=1)
    opts = [SamplingOptions(temperature=1.5, top_k=1, seed=s) for s in range(8)]
    tokens, _ = Sampler()(logits, opts, [3] * 8)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_mask_keeps_k_largest():
    logits = _logits(2, seed=2)
    probs = filtered_probs(logits, [SamplingOptions(temperature=1.0, top_k=5)] * 2)
    for row, p in zip(logits, probs):
        assert set(p.nonzero().squeeze(1).tolist()) == set(row.topk(5).indices.tolist())


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingOptions(temperature=1.0, top_p=0.7)])
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = filtered_probs(logits, [SamplingOptions(temperature=1.0, top_p=0.1)])
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingOptions(temperature=1.0, min_p=0.25)])
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_temperature_sharpens_and_flattens():
    logits = _logits(1, seed=3)
    cold = filtered_probs(logits, [SamplingOptions(temperature=0.1)])
    warm = filtered_probs(logits, [SamplingOptions(temperature=10.0)])
    assert cold.max() > torch.softmax(logits, -1).max() > warm.max()


def test_sampled_frequencies_follow_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).expand(2000, 3)
    tokens, _ = Sampler()(logits, [SamplingOptions(temperature=1.0, seed=1)] * 2000, list(range(2000)))
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 2000
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.04, rtol=0)


def test_mixed_greedy_and_random_rows():
    logits = _logits(4, seed=4)
    opts = [SamplingOptions(), SamplingOptions(temperature=1.0, top_k=1), SamplingOptions(),
            SamplingOptions(temperature=0.7, seed=3)]
    tokens, _ = Sampler()(logits, opts, [1, 2, 3, 4])
    argmax = logits.argmax(-1).tolist()
    assert tokens[:3] == argmax[:3]
