"""reference.apply_token_bitmask (the CPU backend's grammar mask, the twin of the GPU path)
against a per-token loop, and against llguidance's own numpy apply."""
import numpy as np
import pytest
import torch

from pagedserve_kernels import reference


def _dense(logits: torch.Tensor, bitmask: np.ndarray, indices) -> torch.Tensor:
    out = logits.clone()
    rows = range(logits.shape[0]) if indices is None else indices
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 75, 200])
@pytest.mark.parametrize("indices", [None, [2, 0]])
def test_masks_exactly_the_cleared_bits(vocab, indices):
    rng = np.random.default_rng(vocab)
    n = 3
    m = n if indices is None else len(indices)
    bitmask = rng.integers(-2**31, 2**31, size=(m, -(-vocab // 32)), dtype=np.int64)
    bitmask = bitmask.astype(np.int32)
    bitmask[0, :] = -1  # all allowed
    logits = torch.randn(n, vocab, dtype=torch.float32)
    want = _dense(logits, bitmask, indices)
    got = logits.clone()
    reference.apply_token_bitmask(got, torch.from_numpy(bitmask),
                                  None if indices is None else torch.tensor(indices))
    assert torch.equal(got, want)


def test_agrees_with_llguidance_numpy_apply():
    import llguidance.numpy as llg_numpy

    rng = np.random.default_rng(0)
    bitmask = rng.integers(-2**31, 2**31, size=(4, 7), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((4, 200)).astype(np.float32)
    want = logits.copy()
    llg_numpy.apply_token_bitmask_inplace(want, bitmask)
    got = torch.from_numpy(logits.copy())
    reference.apply_token_bitmask(got, torch.from_numpy(bitmask))
    assert np.array_equal(got.numpy(), want)


def test_a_bitmask_too_narrow_for_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="cannot cover"):
        reference.apply_token_bitmask(torch.zeros(1, 65), torch.zeros(1, 2, dtype=torch.int32))


def test_indices_outside_the_logits_mask_nothing():
    """A graph's fixed batch pads its bitmask rows with index -1 (or past the logits): those rows
    change nothing, whatever their bits, and the named rows are masked as without padding."""
    rng = np.random.default_rng(1)
    bitmask = rng.integers(-2**31, 2**31, size=(5, 3), dtype=np.int64).astype(np.int32)
    bitmask[2:] = 0  # the padding rows would mask every token
    logits = torch.randn(4, 90, dtype=torch.float32)
    want = _dense(logits, bitmask[:2], [3, 0])
    got = logits.clone()
    reference.apply_token_bitmask(got, torch.from_numpy(bitmask),
                                  torch.tensor([3, 0, -1, 4, -7]))
    assert torch.equal(got, want)
