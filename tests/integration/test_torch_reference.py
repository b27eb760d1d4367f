"""Checks that the PyTorch oracle (tests/support/torch_llama.py) computes the model of docs/FORMATS.md.

Each test checks one property by a route that shares no code with the oracle's formula for it:
complex-number RoPE, repeated kv heads, changed future tokens, W = A @ B, a loop-by-loop NumPy
forward pass, finite differences."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.support.torch_llama import (TorchLlama, apply_rope, init_params_numpy, loss_and_grads,  # noqa: E402
                         param_shapes, rope_cos_sin)


def tiny_cfg(arch="svd", **overrides):
    cfg = {"arch": arch, "vocab_size": 11, "d_model": 16, "n_layers": 2, "n_heads": 4,
           "n_kv_heads": 2, "d_ff": 24, "rank": 6, "attn_rank": 6, "mlp_rank": 5,
           "seq_len": 8, "rope_theta": 10000.0, "norm_eps": 1e-6, "mlp_gate_act": arch != "cola"}
    cfg.update(overrides)
    return cfg


def random_tokens(cfg, B=2, T=None, seed=0):
    T = cfg["seq_len"] if T is None else T
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg["vocab_size"], size=(B, T)), rng.integers(0, cfg["vocab_size"], size=(B, T))


def oracle_logits(cfg, params, x, dtype=torch.float64):
    with torch.no_grad():
        return TorchLlama(cfg, params, dtype=dtype).logits(torch.as_tensor(x)).double().numpy()


def complex_rope(x, theta):
    """x [..., T, heads, Dh]: pair (x_j, x_{j+Dh/2}) as one complex number and turn it by
    position * theta^(-2j/Dh)."""
    T, Dh = x.shape[-3], x.shape[-1]
    half = Dh // 2
    z = x[..., :half] + 1j * x[..., half:]
    angle = np.arange(T)[:, None] * theta ** (-2.0 * np.arange(half) / Dh)[None, :]
    z = z * np.exp(1j * angle)[:, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def test_rope_matches_complex_rotation():
    rng = np.random.default_rng(1)
    B, T, heads, Dh, theta = 2, 7, 3, 8, 500.0
    x = rng.standard_normal((B, T, heads, Dh))
    cos, sin = rope_cos_sin(T, Dh, theta, torch.float64)
    out = apply_rope(torch.tensor(x), cos, sin).numpy()
    np.testing.assert_allclose(out, complex_rope(x, theta), rtol=0, atol=1e-12)


def repeat_kv_heads(w, n_kv_heads, group):
    """[in, Hkv*Dh] -> [in, H*Dh]: each kv head's columns repeated for its `group` q heads."""
    d_in = w.shape[0]
    heads = w.reshape(d_in, n_kv_heads, -1)
    return np.repeat(heads, group, axis=1).reshape(d_in, -1)


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_equals_repeated_kv_heads(n_kv_heads):
    cfg = tiny_cfg("full", n_kv_heads=n_kv_heads)
    params = init_params_numpy(cfg, seed=2)
    group = cfg["n_heads"] // n_kv_heads
    mha_cfg = dict(cfg, n_kv_heads=cfg["n_heads"])
    mha_params = dict(params)
    for i in range(cfg["n_layers"]):
        for lin in ("k", "v"):
            name = f"layers/{i}/{lin}/W"
            mha_params[name] = repeat_kv_heads(params[name], n_kv_heads, group)
    x, _ = random_tokens(cfg)
    np.testing.assert_allclose(oracle_logits(cfg, params, x), oracle_logits(mha_cfg, mha_params, x),
                               rtol=0, atol=1e-12)
    if n_kv_heads > 1:
        # the mapping matters: serving q head h from kv head h % Hkv instead gives other logits
        tiled = dict(mha_params)
        for i in range(cfg["n_layers"]):
            for lin in ("k", "v"):
                name = f"layers/{i}/{lin}/W"
                w = params[name].reshape(cfg["d_model"], n_kv_heads, -1)
                tiled[name] = np.tile(w, (1, group, 1)).reshape(cfg["d_model"], -1)
        assert not np.allclose(oracle_logits(mha_cfg, tiled, x), oracle_logits(cfg, params, x))


def test_causal_future_tokens_do_not_change_earlier_logits():
    cfg = tiny_cfg("svd")
    params = init_params_numpy(cfg, seed=3)
    x, _ = random_tokens(cfg)
    t = 3
    changed = x.copy()
    changed[:, t + 1:] = (x[:, t + 1:] + 1) % cfg["vocab_size"]
    before, after = oracle_logits(cfg, params, x), oracle_logits(cfg, params, changed)
    np.testing.assert_allclose(after[:, :t + 1], before[:, :t + 1], rtol=0, atol=1e-12)
    assert not np.allclose(after[:, t + 1:], before[:, t + 1:])


def test_svd_equals_full_with_product_weights():
    svd_cfg = tiny_cfg("svd")
    svd_params = init_params_numpy(svd_cfg, seed=4)
    full_cfg = dict(svd_cfg, arch="full")
    full_params = {}
    for name in param_shapes(full_cfg):
        if name.endswith("/W"):
            prefix = name[:-2]
            full_params[name] = svd_params[prefix + "/A"] @ svd_params[prefix + "/B"]
        else:
            full_params[name] = svd_params[name]
    x, _ = random_tokens(svd_cfg)
    np.testing.assert_allclose(oracle_logits(svd_cfg, svd_params, x), oracle_logits(full_cfg, full_params, x),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_zero_lm_head_gives_log_vocab(dtype):
    cfg = tiny_cfg("cola")
    params = init_params_numpy(cfg, seed=5)
    params["lm_head"] = np.zeros_like(params["lm_head"])
    x, y = random_tokens(cfg)
    loss, _ = loss_and_grads(cfg, params, x, y, dtype=dtype)
    assert loss == pytest.approx(math.log(cfg["vocab_size"]), rel=1e-6 if dtype == "float32" else 1e-13)


def naive_forward_logits(cfg, params, x):
    """The model's formulas (docs/FORMATS.md) one batch row, token and head at a time, in NumPy."""
    C, H, Hkv = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
    Dh, eps = C // H, cfg["norm_eps"]

    def silu(z):
        return z / (1.0 + np.exp(-z))

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v) + eps) * w

    def lin(i, name, v):
        p = f"layers/{i}/{name}/"
        if cfg["arch"] == "full":
            return v @ params[p + "W"]
        hidden = v @ params[p + "A"]
        return (silu(hidden) if cfg["arch"] == "cola" else hidden) @ params[p + "B"]

    B, T = x.shape
    logits = np.zeros((B, T, cfg["vocab_size"]))
    for b in range(B):
        h = [params["embed"][x[b, t]].copy() for t in range(T)]
        for i in range(cfg["n_layers"]):
            a = [norm(h[t], params[f"layers/{i}/attn_norm"]) for t in range(T)]
            q = complex_rope(np.stack([lin(i, "q", a[t]).reshape(H, Dh) for t in range(T)]), cfg["rope_theta"])
            k = complex_rope(np.stack([lin(i, "k", a[t]).reshape(Hkv, Dh) for t in range(T)]), cfg["rope_theta"])
            v = [lin(i, "v", a[t]).reshape(Hkv, Dh) for t in range(T)]
            for t in range(T):
                o = np.zeros((H, Dh))
                for head in range(H):
                    kv = head // (H // Hkv)
                    scores = np.array([q[t, head] @ k[s, kv] / math.sqrt(Dh) for s in range(t + 1)])
                    weights = np.exp(scores - scores.max())
                    weights /= weights.sum()
                    o[head] = sum(weights[s] * v[s][kv] for s in range(t + 1))
                h[t] = h[t] + lin(i, "o", o.reshape(C))
            for t in range(T):
                m = norm(h[t], params[f"layers/{i}/mlp_norm"])
                g, u = lin(i, "gate", m), lin(i, "up", m)
                if cfg["mlp_gate_act"]:
                    g = silu(g)
                h[t] = h[t] + lin(i, "down", g * u)
        for t in range(T):
            logits[b, t] = norm(h[t], params["final_norm"]) @ params["lm_head"]
    return logits


@pytest.mark.parametrize("arch", ["full", "svd", "cola"])
def test_logits_match_naive_loop_forward(arch):
    cfg = tiny_cfg(arch, seq_len=6)
    params = init_params_numpy(cfg, seed=6)
    x, y = random_tokens(cfg, B=2)
    expected = naive_forward_logits(cfg, params, x)
    np.testing.assert_allclose(oracle_logits(cfg, params, x), expected, rtol=1e-10, atol=1e-12)
    # and the loss is the mean cross-entropy of those logits
    shifted = expected - expected.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    expected_loss = -np.mean(np.take_along_axis(log_probs, y[..., None], axis=-1))
    loss, _ = loss_and_grads(cfg, params, x, y)
    assert loss == pytest.approx(expected_loss, rel=1e-12)


@pytest.mark.parametrize("arch", ["full", "svd", "cola"])
def test_gradients_match_finite_differences(arch):
    cfg = tiny_cfg(arch, seq_len=5)
    params = init_params_numpy(cfg, seed=7)
    x, y = random_tokens(cfg, B=2, seed=8)
    _, grads = loss_and_grads(cfg, params, x, y)
    assert {name: g.shape for name, g in grads.items()} == param_shapes(cfg)

    model = TorchLlama(cfg, params, dtype=torch.float64)
    x_t, y_t = torch.as_tensor(x), torch.as_tensor(y)
    rng = np.random.default_rng(9)
    step = 1e-5
    with torch.no_grad():
        for name, p in model.weights.items():
            # embed rows of tokens absent from x have zero gradient; pick a used row
            flat_choices = [np.ravel_multi_index((x[0, 0], rng.integers(p.shape[1])), p.shape)] \
                if name == "embed" else rng.integers(p.numel(), size=2)
            for flat in flat_choices:
                index = np.unravel_index(int(flat), tuple(p.shape))
                original = p[index].item()
                p[index] = original + step
                loss_plus = model(x_t, y_t).item()
                p[index] = original - step
                loss_minus = model(x_t, y_t).item()
                p[index] = original
                numeric = (loss_plus - loss_minus) / (2 * step)
                assert grads[name][index] == pytest.approx(numeric, rel=1e-5, abs=1e-9), name


def test_float32_agrees_with_float64():
    cfg = tiny_cfg("svd")
    params = init_params_numpy(cfg, seed=10)
    x, y = random_tokens(cfg)
    loss64, grads64 = loss_and_grads(cfg, params, x, y, dtype="float64")
    loss32, grads32 = loss_and_grads(cfg, params, x, y, dtype="float32")
    assert loss32 == pytest.approx(loss64, rel=1e-5)
    for name, g in grads64.items():
        np.testing.assert_allclose(grads32[name], g, rtol=1e-3, atol=1e-5 * np.abs(g).max(), err_msg=name)
