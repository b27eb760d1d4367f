"""Every hand-written backward against central finite differences, in float64.

Each check takes a scalar probe L = sum(output * R) with a fixed random R, so that the analytic
gradient of an input is what the backward returns for dout = R, and compares its projection on a
random direction v, <grad, v>, with (L(x + eps v) - L(x - eps v)) / (2 eps). Each input and each
parameter gets its own direction, so a wrong gradient of any one of them is caught.

Covered: the layer pairs of boostmpi/model/layers.py, and the three tensor-parallel strategies
(btp, vanilla low-rank, Megatron) at tp = 1, where each must be the single-device model. Forward
values are pinned by independent formulas: the causal mask, the RoPE convention of the torch
oracle, its GQA head mapping, and a plain NumPy composition of each linear group.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from boostmpi.config import config_from_dict  # noqa: E402
from boostmpi.model import layers  # noqa: E402
from boostmpi.model.params import FlatBuffer, init_global, param_specs  # noqa: E402
from boostmpi.parallel.grid import ProcessGrid  # noqa: E402
from boostmpi.parallel.tensor_parallel import (BottleneckTP, MegatronTP, VanillaLowRankTP,  # noqa: E402
                                               make_strategy)
from tests.support.torch_llama import apply_rope, causal_attention, rope_cos_sin  # noqa: E402

FD_STEP = 1e-6
FD_RTOL = 1e-6  # central differences in float64 at this step are good to ~1e-9 relative


# ---------------------------------------------------------------------------- the checker

def finite_difference_check(probe, inputs, analytic, rng, label=""):
    """For each name in `analytic`: <analytic[name], v> == d/de probe() along a random v of inputs[name].

    `inputs[name]` is an array that `probe()` reads; it is perturbed in place and restored.
    """
    for name, grad in analytic.items():
        x = inputs[name]
        assert grad.shape == x.shape, f"{label} {name}: gradient shape {grad.shape} != {x.shape}"
        v = rng.standard_normal(x.shape)
        original = x.copy()
        x += FD_STEP * v
        plus = probe()
        x[...] = original - FD_STEP * v
        minus = probe()
        x[...] = original
        numeric = (plus - minus) / (2 * FD_STEP)
        exact = float(np.sum(grad * v))
        assert abs(numeric - exact) <= FD_RTOL * abs(exact) + 1e-10, \
            f"{label} {name}: finite difference {numeric!r} vs backward {exact!r}"


def probe_of(forward, weights):
    """A scalar L = sum_j sum(out_j * R_j) of a forward returning an array or a list of arrays."""
    def probe():
        outs = forward()
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        return float(sum(np.sum(o * r) for o, r in zip(outs, weights)))
    return probe


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---------------------------------------------------------------------------- single layers

def test_rmsnorm_backward_and_weight_gradient_accumulate(rng):
    N, C, eps = 6, 10, 1e-6
    x = rng.standard_normal((N, C))
    w = 1.0 + 0.3 * rng.standard_normal(C)
    dy = rng.standard_normal((N, C))
    y, rstd = layers.rmsnorm_forward(x, w, eps)
    np.testing.assert_allclose(y, x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + eps) * w, rtol=1e-14)
    already = rng.standard_normal(C)  # backward must add to what the buffer holds
    dw = already.copy()
    dx = layers.rmsnorm_backward(dy, x, w, rstd, dw)
    probe = probe_of(lambda: layers.rmsnorm_forward(x, w, eps)[0], [dy])
    finite_difference_check(probe, {"x": x, "w": w}, {"x": dx, "w": dw - already}, rng, "rmsnorm")


def test_silu_backward(rng):
    a = 3.0 * rng.standard_normal((5, 7))
    dz = rng.standard_normal(a.shape)
    np.testing.assert_allclose(layers.silu_forward(a), a / (1.0 + np.exp(-a)), rtol=1e-14)
    probe = probe_of(lambda: layers.silu_forward(a), [dz])
    finite_difference_check(probe, {"a": a}, {"a": layers.silu_backward(dz, a)}, rng, "silu")


@pytest.mark.parametrize("act", [True, False])
def test_gate_backward(rng, act):
    g, u = 2.0 * rng.standard_normal((5, 6)), rng.standard_normal((5, 6))
    dy = rng.standard_normal(g.shape)
    expected = (g / (1.0 + np.exp(-g)) if act else g) * u
    np.testing.assert_allclose(layers.gate_forward(g, u, act), expected, rtol=1e-14)
    dg, du = layers.gate_backward(dy, g, u, act)
    probe = probe_of(lambda: layers.gate_forward(g, u, act), [dy])
    finite_difference_check(probe, {"g": g, "u": u}, {"g": dg, "u": du}, rng, f"gate act={act}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("act", [True, False])
def test_kept_sigmoids_give_the_same_bits(rng, dtype, act):
    """A recompute keeps the SiLU's sigmoid for the backward: forward and backward are bit for bit
    those computed without it."""
    a, g, u, dz = (rng.standard_normal((5, 6)).astype(dtype) for _ in range(4))
    z, s = layers.silu_and_sigmoid(a, keep=True)
    np.testing.assert_array_equal(z, layers.silu_forward(a))
    np.testing.assert_array_equal(layers.silu_backward(dz, a, s), layers.silu_backward(dz, a))
    y, s = layers.gate_and_sigmoid(g, u, act, keep=True)
    assert (s is None) == (not act)
    np.testing.assert_array_equal(y, layers.gate_forward(g, u, act))
    for kept, plain in zip(layers.gate_backward(dz, g, u, act, s), layers.gate_backward(dz, g, u, act)):
        np.testing.assert_array_equal(kept, plain)


def test_embedding_backward_accumulates_repeated_ids(rng):
    V, C = 9, 5
    table = rng.standard_normal((V, C))
    ids = np.array([3, 1, 3, 8, 3, 0, 1])  # repeats: their gradients must add up
    dout = rng.standard_normal((len(ids), C))
    already = rng.standard_normal((V, C))
    dtable = already.copy()
    layers.embedding_backward(dtable, ids, dout)
    probe = probe_of(lambda: layers.embedding_forward(table, ids), [dout])
    finite_difference_check(probe, {"table": table}, {"table": dtable - already}, rng, "embedding")
    untouched = np.setdiff1d(np.arange(V), ids)
    np.testing.assert_array_equal(dtable[untouched], already[untouched])


def test_rope_backward(rng):
    B, T, heads, Dh = 2, 7, 3, 8
    cos, sin = layers.rope_tables(T, Dh, 10000.0, np.float64)
    x = rng.standard_normal((B, T, heads, Dh))
    dy = rng.standard_normal(x.shape)
    probe = probe_of(lambda: layers.rope_forward(x, cos, sin), [dy])
    finite_difference_check(probe, {"x": x}, {"x": layers.rope_backward(dy, cos, sin)}, rng, "rope")


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rope_matches_torch_oracle_convention(rng, theta):
    B, T, heads, Dh = 2, 9, 2, 16
    x = rng.standard_normal((B, T, heads, Dh))
    ours = layers.rope_forward(x, *layers.rope_tables(T, Dh, theta, np.float64))
    cos, sin = rope_cos_sin(T, Dh, theta, torch.float64)
    np.testing.assert_allclose(ours, apply_rope(torch.tensor(x), cos, sin).numpy(), rtol=0, atol=1e-13)


def attention_inputs(rng, n_kv_heads, B=2, T=6, H=4, Dh=8):
    return (rng.standard_normal((B, T, H, Dh)), rng.standard_normal((B, T, n_kv_heads, Dh)),
            rng.standard_normal((B, T, n_kv_heads, Dh)))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_backward(rng, n_kv_heads):
    q, k, v = attention_inputs(rng, n_kv_heads)
    out, cache = layers.attention_forward(q, k, v)
    do = rng.standard_normal(out.shape)
    dq, dk, dv = layers.attention_backward(do, cache)
    probe = probe_of(lambda: layers.attention_forward(q, k, v)[0], [do])
    finite_difference_check(probe, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, rng,
                            f"attention Hkv={n_kv_heads}")


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_matches_torch_oracle_heads(rng, n_kv_heads):
    """Same outputs as the oracle: pins the GQA mapping (q head h reads kv head h // (H/Hkv))."""
    q, k, v = attention_inputs(rng, n_kv_heads)
    out, _ = layers.attention_forward(q, k, v)
    expected = causal_attention(*(torch.tensor(a) for a in (q, k, v))).numpy()
    B, T, H, Dh = q.shape
    np.testing.assert_allclose(out, expected.reshape(B, T, H * Dh), rtol=0, atol=1e-13)


@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_attention_is_causal(rng, n_kv_heads):
    q, k, v = attention_inputs(rng, n_kv_heads)
    t = 2
    before, _ = layers.attention_forward(q, k, v)
    q2, k2, v2 = (a.copy() for a in (q, k, v))
    for a in (q2, k2, v2):
        a[:, t + 1:] = rng.standard_normal(a[:, t + 1:].shape)
    after, _ = layers.attention_forward(q2, k2, v2)
    np.testing.assert_array_equal(after[:, :t + 1], before[:, :t + 1])
    assert np.abs(after[:, t + 1:] - before[:, t + 1:]).min() > 0


# ---------------------------------------------------------------------------- tensor-parallel strategies at tp = 1

MODEL = dict(vocab_size=13, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=24,
             attn_rank=6, mlp_rank=5, seq_len=8)

# (tp_mode, arch, parallel extras, the class make_strategy must pick)
STRATEGY_CASES = [
    ("btp", "svd", {"norm": "online", "grouped": True}, BottleneckTP),
    ("btp", "cola", {"norm": "online", "grouped": False}, BottleneckTP),
    ("btp", "cola", {"norm": "sync", "grouped": True}, BottleneckTP),
    ("btp", "svd", {"norm": "sync", "grouped": False}, BottleneckTP),
    ("vanilla", "svd", {"grouped": True}, VanillaLowRankTP),
    ("vanilla", "cola", {"grouped": False}, VanillaLowRankTP),
    ("vanilla", "full", {"grouped": True}, MegatronTP),
    ("vanilla", "full", {"grouped": False}, MegatronTP),
]
CASE_IDS = [f"{mode}-{arch}-" + "-".join(f"{k}={v}" for k, v in extra.items())
            for mode, arch, extra, _ in STRATEGY_CASES]


def strategy_at_tp1(mode, arch, extra, rng):
    cfg = config_from_dict({"model": dict(MODEL, arch=arch), "parallel": dict(extra, tp_mode=mode),
                            "train": {"dtype": "float64"}})
    specs = param_specs(cfg)
    P, grads = FlatBuffer(specs, np.float64), FlatBuffer(specs, np.float64)
    for s in specs:
        P[s.name][...] = init_global(s, seed=7)
        if s.init == "ones":  # norm weights of one would hide a missing weight factor
            P[s.name][...] += 0.2 * rng.standard_normal(s.global_shape)
    return cfg, make_strategy(cfg, ProcessGrid(None)), P, grads


def reference_linear(arch, P, name, x):
    """The documented L(x) (docs/FORMATS.md), written out here."""
    if arch == "full":
        return x @ P[name + "/W"]
    hidden = x @ P[name + "/A"]
    if arch == "cola":
        hidden = hidden / (1.0 + np.exp(-hidden))
    return hidden @ P[name + "/B"]


def weights_of(P, names):
    return [n for n in P.views if any(n.startswith(prefix + "/") for prefix in names)]


@pytest.mark.parametrize("mode,arch,extra,cls", STRATEGY_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("group", ["attention", "mlp"])
def test_in_proj_at_tp1(rng, mode, arch, extra, cls, group):
    cfg, tp_layers, P, grads = strategy_at_tp1(mode, arch, extra, rng)
    assert type(tp_layers) is cls
    norm = "layers/0/attn_norm" if group == "attention" else "layers/0/mlp_norm"
    names = [f"layers/0/{lin}" for lin in (("q", "k", "v") if group == "attention" else ("gate", "up"))]
    x = rng.standard_normal((10, MODEL["d_model"]))
    outs, cache = tp_layers.in_proj_forward(x, norm, names, P)
    normed = x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + cfg.model.norm_eps) * P[norm]
    for name, out in zip(names, outs):
        np.testing.assert_allclose(out, reference_linear(arch, P, name, normed), rtol=1e-12, atol=1e-14,
                                   err_msg=name)
    douts = [rng.standard_normal(o.shape) for o in outs]
    dx = tp_layers.in_proj_backward(douts, cache, P, grads)
    params = [norm] + weights_of(P, names)
    probe = probe_of(lambda: tp_layers.in_proj_forward(x, norm, names, P)[0], douts)
    finite_difference_check(probe, {"x": x, **{n: P[n] for n in params}}, {"x": dx, **{n: grads[n] for n in params}},
                            rng, f"{cls.__name__} in_proj {group}")


@pytest.mark.parametrize("mode,arch,extra,cls", STRATEGY_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("lin", ["o", "down"])
def test_out_proj_at_tp1(rng, mode, arch, extra, cls, lin):
    cfg, tp_layers, P, grads = strategy_at_tp1(mode, arch, extra, rng)
    name = f"layers/0/{lin}"
    x = rng.standard_normal((10, MODEL["d_model"] if lin == "o" else MODEL["d_ff"]))
    y, cache = tp_layers.out_proj_forward(x, name, P)
    np.testing.assert_allclose(y, reference_linear(arch, P, name, x), rtol=1e-12, atol=1e-14)
    dy = rng.standard_normal(y.shape)
    dx = tp_layers.out_proj_backward(dy, cache, P, grads)
    params = weights_of(P, [name])
    probe = probe_of(lambda: tp_layers.out_proj_forward(x, name, P)[0], [dy])
    finite_difference_check(probe, {"x": x, **{n: P[n] for n in params}}, {"x": dx, **{n: grads[n] for n in params}},
                            rng, f"{cls.__name__} out_proj {lin}")


@pytest.mark.parametrize("mode,arch,extra,cls", STRATEGY_CASES[::2], ids=CASE_IDS[::2])
def test_embedding_and_head_at_tp1(rng, mode, arch, extra, cls):
    cfg, tp_layers, P, grads = strategy_at_tp1(mode, arch, extra, rng)
    V, C, N = MODEL["vocab_size"], MODEL["d_model"], 12
    ids = rng.integers(0, V, N)
    targets = rng.integers(0, V, N)
    h = tp_layers.embed_forward(ids, P)
    np.testing.assert_array_equal(h, P["embed"][ids])
    dh = rng.standard_normal(h.shape)
    tp_layers.embed_backward(ids, dh, grads)
    finite_difference_check(probe_of(lambda: tp_layers.embed_forward(ids, P), [dh]), {"embed": P["embed"]},
                            {"embed": grads["embed"]}, rng, f"{cls.__name__} embedding")

    x = rng.standard_normal((N, C))
    loss, cache = tp_layers.head_forward(x, targets, P)
    logits = (x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + cfg.model.norm_eps) * P["final_norm"]) @ P["lm_head"]
    log_z = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
    assert loss == pytest.approx(np.mean(log_z - logits[np.arange(N), targets]), rel=1e-13)
    dx = tp_layers.head_backward(cache, 1.0 / N, P, grads)  # scale 1/N: the gradient of the mean loss
    finite_difference_check(lambda: tp_layers.head_forward(x, targets, P)[0],
                            {"x": x, "final_norm": P["final_norm"], "lm_head": P["lm_head"]},
                            {"x": dx, "final_norm": grads["final_norm"], "lm_head": grads["lm_head"]},
                            rng, f"{cls.__name__} head")
