"""Sampler: greedy, seeded determinism per position, top-k/top-p/min-p masks, temperature; logit
bias, penalties against transformers' processors, and raw logprobs."""
import torch

from executor_svc import sampler
from executor_svc.sampler import (Sampler, SamplingTensors, controlled_logits, copy_to_host,
                                  filtered_logits, filtered_probs, from_host, top_from_host)
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


def test_a_batch_filtered_in_parts_drops_what_each_row_drops_alone(monkeypatch):
    """Past FILTER_ROWS rows the filters run a part at a time, each row with its own top-k,
    top-p, min-p and temperature: every row comes out as it does filtered on its own."""
    n = 2 * sampler.FILTER_ROWS + 37  # three parts, the last one short
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    options = [SamplingOptions(temperature=0.5 + (i % 7) / 4, top_k=(i * 13) % VOCAB,
                               top_p=0.3 + (i % 5) / 8, min_p=(i % 3) / 20, seed=i)
               for i in range(n)]
    whole = filtered_logits(logits, SamplingTensors.build(options, [0] * n, VOCAB, logits.device))
    for i in (0, sampler.FILTER_ROWS - 1, sampler.FILTER_ROWS, n - 1, *range(5, n, 41)):
        alone = filtered_logits(logits[i:i + 1], SamplingTensors.build(
            options[i:i + 1], [0], VOCAB, logits.device))
        assert torch.equal(whole[i:i + 1], alone), i
    assert (whole == float("-inf")).any(dim=1).all()  # every row dropped something
    monkeypatch.setattr(sampler, "FILTER_ROWS", n)  # all at once: the same values
    params = SamplingTensors.build(options, [0] * n, VOCAB, logits.device)
    assert torch.equal(filtered_logits(logits, params), whole)


def test_sampling_with_controls_and_filters_leaves_the_callers_logits_alone():
    """The controls' copy is filtered in place, never the logits the caller passed (the raw
    logprobs come from them): with and without a control, the input is unchanged and the draws
    are those of a fresh copy."""
    logits = _logits(6, seed=5)
    kept = logits.clone()
    plain = [SamplingOptions(temperature=0.7, top_p=0.8, top_k=9, seed=s) for s in range(6)]
    biased = [SamplingOptions(temperature=0.7, top_p=0.8, top_k=9, seed=s,
                              logit_bias=((3, 2.0),)) for s in range(6)]
    for options in (plain, biased):
        tokens, logprobs = Sampler()(logits, options, [4] * 6)
        assert torch.equal(logits, kept)
        assert (tokens, logprobs) == Sampler()(kept.clone(), options, [4] * 6)


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


def test_filtered_frequencies_follow_the_filtered_distribution():
    """top-k 2 of [0.5, 0.3, 0.2]: the race samples the renormalised [0.625, 0.375, 0]."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(2000, 3)
    opts = [SamplingOptions(temperature=1.0, top_k=2, seed=1)] * 2000
    tokens, _ = Sampler()(logits, opts, list(range(2000)))
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 2000
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0]), atol=0.04, rtol=0)


def test_filters_that_drop_nothing_draw_what_the_unfiltered_path_draws():
    """A batch with a filter sorts (the filtering path); one without skips it. Where the filter
    drops nothing (top-k over the vocabulary, top-p 1 beside a row that sorts), every row draws
    the same token either way: one race, whichever path."""
    logits = _logits(64, seed=9)
    plain = [SamplingOptions(temperature=0.9, seed=s) for s in range(64)]
    wide = [SamplingOptions(temperature=0.9, top_k=VOCAB + 5, seed=s) for s in range(64)]
    assert not any(o.uses_filters for o in plain) and all(o.uses_filters for o in wide)
    positions = list(range(100, 164))
    fast, _ = Sampler()(logits, plain, positions)
    sorted_path, _ = Sampler()(logits, wide, positions)
    assert fast == sorted_path
    # one row with a real filter sends the whole batch down the sorting path: the others still
    # draw what they draw alone
    mixed = plain[:-1] + [SamplingOptions(temperature=0.9, top_p=0.5, seed=63)]
    beside, _ = Sampler()(logits, mixed, positions)
    assert beside[:-1] == fast[:-1]


def test_a_grammar_masked_token_is_never_drawn():
    """-inf logits (a grammar's mask) never win the race, with or without filters."""
    logits = _logits(32, seed=5)
    logits[:, ::2] = float("-inf")
    for extra in ({}, {"top_p": 0.95}):
        opts = [SamplingOptions(temperature=2.0, seed=s, **extra) for s in range(32)]
        tokens, _ = Sampler()(logits, opts, list(range(32)))
        assert all(t % 2 == 1 for t in tokens)


def test_mixed_greedy_and_random_rows():
    logits = _logits(4, seed=4)
    opts = [SamplingOptions(), SamplingOptions(temperature=1.0, top_k=1), SamplingOptions(),
            SamplingOptions(temperature=0.7, seed=3)]
    tokens, _ = Sampler()(logits, opts, [1, 2, 3, 4])
    argmax = logits.argmax(-1).tolist()
    assert tokens[:3] == argmax[:3]


# --- logit bias, penalties, logprobs (issue 13) -----------------------------------------------

def _counts(prompts, outputs, vocab=VOCAB):
    from executor_svc.token_counts import TokenCounts
    counts = TokenCounts(vocab, torch.device("cpu"))
    return counts, [counts.add(p, o) for p, o in zip(prompts, outputs)]


def test_repetition_penalty_matches_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor
    logits = _logits(3, seed=3)
    prompts, outputs = [[1, 2, 3, 3], [7], [4, 9]], [[5, 1], [7, 7, 8], []]
    counts, rows = _counts(prompts, outputs)
    opts = [SamplingOptions(repetition_penalty=1.7)] * 3
    params = SamplingTensors.build(opts, [0] * 3, VOCAB, logits.device, counts, rows)
    got = controlled_logits(logits, params)
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[i:i + 1].clone())
        assert torch.equal(got[i:i + 1], want), i  # the same float ops: bit-identical
    assert torch.equal(logits, _logits(3, seed=3))  # the model's logits stay unmodified


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = _logits(2, seed=4)
    counts, rows = _counts([[1, 2], [3]], [[2, 2, 5], []])
    opts = [SamplingOptions(presence_penalty=0.5, frequency_penalty=0.25),
            SamplingOptions(presence_penalty=-1.0)]
    got = controlled_logits(logits, SamplingTensors.build(opts, [0, 0], VOCAB, logits.device,
                                                          counts, rows))
    want = logits.clone()
    want[0, 2] -= 0.25 * 2 + 0.5  # token 1 is in the prompt only: untouched
    want[0, 5] -= 0.25 * 1 + 0.5
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # row 1 generated nothing


def test_a_batch_penalised_in_parts_equals_each_row_penalised_alone(monkeypatch):
    """Past FILTER_ROWS penalised rows the penalties run a part at a time (every third row
    unpenalised, so parts hold rows far apart): each row comes out as it does alone, and as
    the whole batch at once."""
    n = 2 * sampler.FILTER_ROWS + 37
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(8)) * 3
    prompts = [[(i * 7 + j) % VOCAB for j in range(i % 5)] for i in range(n)]
    outputs = [[(i * 11 + j * j) % VOCAB for j in range(i % 6)] for i in range(n)]
    counts, rows = _counts(prompts, outputs)
    options = [SamplingOptions() if i % 3 == 2 else
               SamplingOptions(repetition_penalty=0.8 + (i % 4) / 5, presence_penalty=(i % 5) / 4,
                               frequency_penalty=-(i % 3) / 3) for i in range(n)]
    count_rows = [None if i % 3 == 2 else rows[i] for i in range(n)]
    whole = controlled_logits(logits, SamplingTensors.build(options, [0] * n, VOCAB,
                                                            logits.device, counts, count_rows))
    for i in (0, 1, 2, sampler.FILTER_ROWS, n - 1, *range(4, n, 37)):
        alone = controlled_logits(logits[i:i + 1], SamplingTensors.build(
            options[i:i + 1], [0], VOCAB, logits.device, counts, count_rows[i:i + 1]))
        assert torch.equal(whole[i:i + 1], alone), i
    assert not torch.equal(whole, logits) and torch.equal(whole[2::3], logits[2::3])
    monkeypatch.setattr(sampler, "FILTER_ROWS", n)  # all at once: the same values
    assert torch.equal(controlled_logits(logits, SamplingTensors.build(
        options, [0] * n, VOCAB, logits.device, counts, count_rows)), whole)


def test_counts_follow_sampled_tokens_on_the_device():
    counts, rows = _counts([[1]], [[]])
    counts.count(torch.tensor([rows[0], rows[0]]), torch.tensor([4, 4]))
    assert counts.output_counts[rows[0], 4].item() == 2
    many = [counts.add([i], []) for i in range(20)]  # grows past its first rows, keeping them
    assert counts.output_counts[rows[0], 4].item() == 2 and len(set(many + rows)) == 21


def test_logit_bias_is_added_before_penalties_and_sampling():
    logits = _logits(2, seed=5)
    opts = [SamplingOptions(logit_bias=((3, 100.0), (4, -2.5))), SamplingOptions()]
    tokens, _ = Sampler()(logits, opts, [0, 0])
    assert tokens[0] == 3 and tokens[1] == logits[1].argmax().item()
    got = controlled_logits(logits, SamplingTensors.build(opts, [0, 0], VOCAB, logits.device))
    want = logits.clone()
    want[0, 3] += 100.0
    want[0, 4] -= 2.5
    assert torch.equal(got, want)
    # bias then repetition penalty (vLLM's order): a biased seen token is divided after biasing
    counts, rows = _counts([[3]], [[]])
    both = SamplingOptions(logit_bias=((3, 1.0),), repetition_penalty=2.0)
    got = controlled_logits(logits[:1], SamplingTensors.build([both], [0], VOCAB, logits.device,
                                                              counts, rows))
    biased = logits[0, 3] + 1.0
    assert got[0, 3].item() == (biased / 2 if biased > 0 else biased * 2).item()


def test_logprobs_are_the_raw_distribution_and_top_k_sorted():
    logits = _logits(2, seed=6)
    opts = [SamplingOptions(logit_bias=((0, 50.0),), logprobs=5), SamplingOptions(logprobs=0)]
    params = SamplingTensors.build(opts, [0, 0], VOCAB, logits.device)
    assert params.num_top_logprobs == 5
    token_ids, logprobs = Sampler().sample(logits, params)
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logprobs, raw.gather(1, token_ids[:, None]).squeeze(1))
    ids, values = Sampler().top_logprobs(logits, 5)
    torch.testing.assert_close(values, raw.topk(5).values)
    assert torch.equal(ids, raw.topk(5).indices)
    host = copy_to_host(token_ids, logprobs, (ids, values))
    assert from_host(host)[0] == token_ids.tolist()
    top_ids, top_values = top_from_host(host)
    assert top_ids == ids.tolist()
    torch.testing.assert_close(torch.tensor(top_values, dtype=torch.float32), values)


def test_plain_batch_builds_no_control_tensors():
    params = SamplingTensors.build([SamplingOptions()] * 4, [0] * 4, VOCAB, torch.device("cpu"))
    assert params.logit_bias is None and params.penalties is None
    assert params.num_top_logprobs == 0


def test_uniform_noise_is_the_splitmix64_stream_bit_for_bit():
    """The in-place noise equals splitmix64 written out with fresh tensors (the form it had
    before), bit for bit: seeded samples stay what they were, recomputed or not."""
    from executor_svc.sampler import _GOLDEN, _MIX1, _MIX2, _shr, uniform_noise

    def reference(row_seeds, vocab):
        index = torch.arange(1, vocab + 1, dtype=torch.int64)
        z = row_seeds.unsqueeze(1) + index.unsqueeze(0) * _GOLDEN
        z = (z ^ _shr(z, 30)) * _MIX1
        z = (z ^ _shr(z, 27)) * _MIX2
        z = z ^ _shr(z, 31)
        return (_shr(z, 40).float() + 0.5) * (1.0 / (1 << 24))

    gen = torch.Generator().manual_seed(5)
    seeds = torch.randint(-2**63, 2**63 - 1, (9,), dtype=torch.int64, generator=gen)
    seeds[:3] = torch.tensor([0, -1, 2**63 - 1])
    got = uniform_noise(seeds, 1000)
    assert torch.equal(got, reference(seeds, 1000))
    assert got.dtype == torch.float32 and bool(((got > 0) & (got < 1)).all())
