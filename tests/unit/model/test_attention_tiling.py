"""The tiled causal attention: several query blocks (uneven last block), GQA, forward and backward
against PyTorch autograd in float64; and nothing of size T x T is kept for the backward."""

import numpy as np
import pytest

from boostmpi.model import layers

torch = pytest.importorskip("torch")
from tests.support.torch_llama import causal_attention  # noqa: E402


@pytest.mark.parametrize("block", [3, 4, 64])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_tiled_attention_matches_torch(monkeypatch, block, n_kv_heads):
    monkeypatch.setattr(layers, "ATTENTION_BLOCK", block)
    rng = np.random.default_rng(3)
    B, T, H, Dh = 2, 10, 4, 6
    q, k, v = (rng.standard_normal((B, T, h, Dh)) for h in (H, n_kv_heads, n_kv_heads))
    do = rng.standard_normal((B, T, H * Dh))
    out, cache = layers.attention_forward(q, k, v)
    dq, dk, dv = layers.attention_backward(do, cache)

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    ref = causal_attention(tq, tk, tv).reshape(B, T, H * Dh)
    ref.backward(torch.tensor(do))
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    for mine, theirs in ((dq, tq), (dk, tk), (dv, tv)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-11, atol=1e-12)


def test_backward_keeps_nothing_quadratic_in_T(monkeypatch):
    monkeypatch.setattr(layers, "ATTENTION_BLOCK", 16)
    B, T, H, Dh = 1, 256, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, H, Dh)).astype(np.float32) for _ in range(3))
    _, cache = layers.attention_forward(q, k, v)
    kept = sum(a.nbytes for a in cache if a is not None)
    assert kept < B * H * T * T * 4 / 4, kept  # well below one T x T score matrix per head


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_kept_probabilities_give_the_same_bits(monkeypatch, dtype, n_kv_heads):
    """A recompute may hand its probability tiles to the backward: the gradients are bit for bit
    those of the backward that recomputes the tiles from the saved row statistics."""
    monkeypatch.setattr(layers, "ATTENTION_BLOCK", 4)
    rng = np.random.default_rng(5)
    B, T, H, Dh = 2, 11, 4, 6
    q, k, v = (rng.standard_normal((B, T, h, Dh)).astype(dtype) for h in (H, n_kv_heads, n_kv_heads))
    do = rng.standard_normal((B, T, H * Dh)).astype(dtype)
    out, cache = layers.attention_forward(q, k, v)
    out_kept, cache_kept = layers.attention_forward(q, k, v, keep_probs=True)
    assert cache[-1] is None and len(cache_kept[-1]) == len(layers._blocks(T))
    assert sum(t.nbytes for t in cache_kept[-1]) == layers.probability_tile_bytes(B, H, T, dtype)
    np.testing.assert_array_equal(out, out_kept)
    for a, b in zip(layers.attention_backward(do, cache), layers.attention_backward(do, cache_kept)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_given_statistics_give_the_same_bits(monkeypatch, dtype, n_kv_heads):
    """A recompute handed the forward's softmax statistics (recompute = lowrank keeps them) skips the
    row reductions: output, kept tiles and gradients are bit for bit those of the forward."""
    monkeypatch.setattr(layers, "ATTENTION_BLOCK", 4)
    rng = np.random.default_rng(6)
    B, T, H, Dh = 2, 11, 4, 6
    q, k, v = (rng.standard_normal((B, T, h, Dh)).astype(dtype) for h in (H, n_kv_heads, n_kv_heads))
    do = rng.standard_normal((B, T, H * Dh)).astype(dtype)
    out, cache = layers.attention_forward(q, k, v, keep_probs=True)
    stats = (cache[4].copy(), cache[5].copy())
    out2, cache2 = layers.attention_forward(q, k, v, keep_probs=True, stats=stats)
    np.testing.assert_array_equal(out, out2)
    assert cache2[4] is stats[0] and cache2[5] is stats[1]  # used, not computed again
    for a, b in zip(cache[6], cache2[6]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(layers.attention_backward(do, cache), layers.attention_backward(do, cache2)):
        np.testing.assert_array_equal(a, b)


def test_output_is_a_view_of_the_kept_buffer():
    """The attention output is kept once: o is a view of the buffer the backward reads."""
    q = np.random.default_rng(0).standard_normal((2, 5, 4, 3))
    o, cache = layers.attention_forward(q, q[:, :, :2], q[:, :, :2])
    assert o.base is cache[3] or o.base is cache[3].base


def test_probability_tiles_are_not_kept_above_the_limit(monkeypatch):
    monkeypatch.setattr(layers, "ATTENTION_KEEP_BYTES", 100)
    q = np.ones((1, 8, 2, 4), dtype=np.float32)
    _, cache = layers.attention_forward(q, q, q, keep_probs=True)
    assert cache[-1] is None
