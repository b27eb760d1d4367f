"""The kernels' NumPy twins (boostmpi/gpu/twins.py) against the model's own layers
(boostmpi/model/layers.py and the btp head): the kernels are held to the twins by the GPU parity
tests, and the twins are held here to the code the CPU engine runs."""

import numpy as np
import pytest

from boostmpi.gpu import twins
from boostmpi.model import layers

TOL = {np.float64: 1e-12, np.float32: 2e-6}


@pytest.fixture(params=[np.float64, np.float32], ids=["float64", "float32"])
def dtype(request):
    return request.param


def _close(a, b, dtype):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                               rtol=TOL[dtype] * 10, atol=TOL[dtype])


def test_rmsnorm_forward_and_backward(dtype):
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal((7, 24)).astype(dtype) for _ in range(2))
    w = (1 + 0.1 * rng.standard_normal(24)).astype(dtype)
    y, rstd = layers.rmsnorm_forward(x, w, 1e-6)
    ty, trstd = twins.rmsnorm_forward(x, w, 1e-6)
    _close(ty, y, dtype)
    _close(trstd, rstd[:, 0], dtype)
    dw = np.zeros_like(w)
    dx = layers.rmsnorm_backward(dy, x, w, rstd, dw)
    tdx, tdw = twins.rmsnorm_backward(dy, x, w, trstd.astype(dtype))
    _close(tdx, dx, dtype)
    _close(tdw, dw, dtype)


@pytest.mark.parametrize("act", [True, False])
def test_silu_and_gate(dtype, act):
    rng = np.random.default_rng(2)
    a, g, u, dy = (rng.standard_normal((6, 10)).astype(dtype) for _ in range(4))
    _close(twins.silu_forward(a), layers.silu_forward(a), dtype)
    _close(twins.silu_backward(a, dy), layers.silu_backward(dy, a), dtype)
    _close(twins.gate_forward(g, u, act), layers.gate_forward(g, u, act), dtype)
    for mine, theirs in zip(layers.gate_backward(dy, g, u, act), twins.gate_backward(g, u, dy, act)):
        _close(theirs, mine, dtype)


def test_softmax_cross_entropy_matches_the_engine_head(dtype):
    from boostmpi.config import config_from_dict
    from boostmpi.parallel.grid import ProcessGrid
    from boostmpi.parallel.tensor_parallel import make_strategy

    rng = np.random.default_rng(3)
    cfg = config_from_dict({"model": {"arch": "cola", "vocab_size": 11, "d_model": 8, "n_heads": 2, "rank": 2,
                                      "n_layers": 1, "d_ff": 16, "seq_len": 4}})
    tpx = make_strategy(cfg, ProcessGrid(None))
    h = rng.standard_normal((6, 8)).astype(dtype)
    P = {"final_norm": np.ones(8, dtype=dtype), "lm_head": rng.standard_normal((8, 11)).astype(dtype)}
    Gr = {k: np.zeros_like(v) for k, v in P.items()}
    targets = rng.integers(0, 11, 6)
    loss, cache = tpx.head_forward(h, targets, P)
    logits = layers.rmsnorm_forward(h, P["final_norm"], cfg.model.norm_eps)[0] @ P["lm_head"]
    row_loss, dlogits = twins.softmax_xent(np.ascontiguousarray(logits), targets, grad_scale=1.0 / 6)
    _close(np.mean(row_loss), loss, dtype)
    dh = tpx.head_backward(cache, 1.0 / 6, P, Gr)
    n = layers.rmsnorm_forward(h, P["final_norm"], cfg.model.norm_eps)[0]
    _close(n.T @ dlogits, Gr["lm_head"], dtype)
    assert np.isfinite(dh).all()
