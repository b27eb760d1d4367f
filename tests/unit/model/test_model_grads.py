"""The whole model (one process, `Engine(cfg)`) against the PyTorch autograd oracle, and the
initialisation rules of docs/FORMATS.md.

Gradients: for each arch, with and without GQA, with and without mlp_gate_act, the loss and every
parameter's gradient match tests/support/torch_llama.py, relative to the gradient's largest entry:
1e-10 in float64, 1e-4 in float32 (the oracle runs in float64 on the same float32 weights).
Initialisation: identical global tensors under any tensor-parallel layout, the CoLA scale for
low-rank factors, 0.02 for dense weights with o/down scaled by 1/sqrt(2 L), ones for norms.
"""

import numpy as np
import pytest

pytest.importorskip("torch")

from boostmpi.config import config_from_dict  # noqa: E402
from boostmpi.model.params import LINEARS, all_global_specs, init_global, param_specs  # noqa: E402
from boostmpi.parallel.engine import Engine  # noqa: E402
from tests.support.torch_llama import loss_and_grads, param_shapes  # noqa: E402

MODEL = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, d_ff=48, attn_rank=8, mlp_rank=12, seq_len=8)
TOLERANCE = {"float64": 1e-10, "float32": 1e-4}


def make_engine(arch, n_kv_heads=4, mlp_gate_act=None, dtype="float64", micro_batch_size=2, grad_accum=1, **model):
    m = dict(MODEL, arch=arch, n_kv_heads=n_kv_heads, **model)
    if mlp_gate_act is not None:
        m["mlp_gate_act"] = mlp_gate_act
    cfg = config_from_dict({"model": m, "train": {"dtype": dtype, "micro_batch_size": micro_batch_size,
                                                  "grad_accum": grad_accum, "seed": 5}})
    return Engine(cfg)


def perturb_norm_weights(engine, rng):
    """The init sets norm weights to one, which would hide a gradient that forgets the weight."""
    for s in engine.specs:
        if s.init == "ones":
            engine.params[s.name][...] += 0.2 * rng.standard_normal(s.local_shape)


def token_batch(rng, batch, T=MODEL["seq_len"], vocab=MODEL["vocab_size"]):
    tokens = rng.integers(0, vocab, (batch, T + 1))
    return tokens[:, :-1], tokens[:, 1:]


def max_relative_errors(grads, reference):
    """name -> max |g - ref| / max |ref|."""
    return {name: float(np.abs(grads[name] - ref).max() / np.abs(ref).max()) for name, ref in reference.items()}


GRAD_CASES = [(arch, kv, act) for arch in ("full", "svd", "cola") for kv in (4, 2) for act in (True, False)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch,n_kv_heads,mlp_gate_act", GRAD_CASES)
def test_engine_matches_torch_oracle(arch, n_kv_heads, mlp_gate_act, dtype):
    rng = np.random.default_rng(11)
    engine = make_engine(arch, n_kv_heads, mlp_gate_act, dtype=dtype)
    perturb_norm_weights(engine, rng)
    x, y = token_batch(rng, 2)
    loss = engine.forward_backward([(x, y)])

    params = {s.name: np.array(engine.params[s.name], dtype=np.float64) for s in engine.specs}
    assert {n: p.shape for n, p in params.items()} == param_shapes(engine.cfg.to_dict()["model"])
    ref_loss, ref_grads = loss_and_grads(engine.cfg.to_dict()["model"], params, x, y, dtype="float64")
    tol = TOLERANCE[dtype]
    assert abs(loss - ref_loss) <= tol * abs(ref_loss), (loss, ref_loss)
    errors = max_relative_errors({n: engine.grads[n] for n in ref_grads}, ref_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: relative gradient error {errors[worst]:.2e} > {tol:g}"


@pytest.mark.parametrize("arch", ["full", "cola"])
def test_two_micro_batches_equal_one_of_twice_the_size(arch):
    rng = np.random.default_rng(12)
    x, y = token_batch(rng, 4)
    split = make_engine(arch, 2, micro_batch_size=2, grad_accum=2)
    whole = make_engine(arch, 2, micro_batch_size=4, grad_accum=1)
    loss_split = split.forward_backward([(x[:2], y[:2]), (x[2:], y[2:])])
    loss_whole = whole.forward_backward([(x, y)])
    assert loss_split == pytest.approx(loss_whole, rel=1e-13)
    for s in whole.specs:
        ref = whole.grads[s.name]
        np.testing.assert_allclose(split.grads[s.name], ref, rtol=0, atol=1e-12 * np.abs(ref).max(), err_msg=s.name)


def test_gradients_are_zeroed_at_each_step():
    rng = np.random.default_rng(13)
    engine = make_engine("svd", 2)
    batch = [token_batch(rng, 2)]
    engine.forward_backward(batch)
    first = engine.grads.data.copy()
    engine.forward_backward(batch)
    np.testing.assert_array_equal(engine.grads.data, first)


# ---------------------------------------------------------------------------- initialisation

def layout_config(arch, tp_mode, tp=1, pp=1):
    return config_from_dict({"model": dict(MODEL, arch=arch, n_kv_heads=4),
                             "parallel": {"tp": tp, "pp": pp, "tp_mode": tp_mode},
                             "train": {"seed": 5, "dtype": "float64"}})


@pytest.mark.parametrize("arch,tp_mode", [("svd", "btp"), ("cola", "btp"), ("cola", "vanilla"), ("full", "vanilla")])
@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 2)])
def test_sharded_init_reassembles_the_single_rank_tensors(arch, tp_mode, tp, pp):
    single = Engine(layout_config(arch, tp_mode))
    cfg = layout_config(arch, tp_mode, tp, pp)
    assembled = {s.name: np.full(s.global_shape, np.nan) for s in all_global_specs(cfg)}
    held = {name: np.zeros(t.shape, dtype=int) for name, t in assembled.items()}  # ranks holding each element
    replicated = {}
    for stage in range(pp):
        for rank in range(tp):
            for s in param_specs(cfg, rank, stage):
                piece = init_global(s, cfg.train.seed)[s.local_slice()]
                assert piece.shape == s.local_shape, s.name
                assembled[s.name][s.local_slice()] = piece
                held[s.name][s.local_slice()] += 1
                replicated[s.name] = s.tp_replicated
    assert set(assembled) == {s.name for s in single.specs}
    assert any(not r for r in replicated.values())
    for s in single.specs:
        # a sharded tensor is partitioned among the tp ranks, a replicated one held whole by each
        np.testing.assert_array_equal(held[s.name], tp if replicated[s.name] else 1, err_msg=s.name)
        np.testing.assert_array_equal(assembled[s.name], single.params[s.name], err_msg=s.name)


def test_init_is_seeded_and_differs_between_tensors():
    cfg = layout_config("cola", "btp")
    specs = {s.name: s for s in all_global_specs(cfg)}
    q, k = specs["layers/0/q/A"], specs["layers/0/k/A"]
    np.testing.assert_array_equal(init_global(q, 1), init_global(q, 1))
    assert not np.allclose(init_global(q, 1), init_global(q, 2))
    assert not np.allclose(init_global(q, 1), init_global(k, 1))


BIG_MODEL = dict(vocab_size=512, d_model=256, n_layers=3, n_heads=4, d_ff=688, attn_rank=64, mlp_rank=96, seq_len=8)


@pytest.mark.parametrize("arch", ["svd", "cola"])
def test_lowrank_factors_use_the_cola_scale(arch):
    cfg = config_from_dict({"model": dict(BIG_MODEL, arch=arch, n_kv_heads=2)})
    dims = {"q": (256, 256), "k": (256, 128), "v": (256, 128), "o": (256, 256),
            "gate": (256, 688), "up": (256, 688), "down": (688, 256)}
    checked = 0
    for s in all_global_specs(cfg):
        parts = s.name.split("/")
        if len(parts) == 4 and parts[2] in LINEARS:
            d_in, d_out = dims[parts[2]]
            r = 64 if parts[2] in ("q", "k", "v", "o") else 96
            std = r ** -0.25 * (d_in + d_out) ** -0.25
            assert s.global_shape == ((d_in, r) if parts[3] == "A" else (r, d_out)), s.name
            assert s.init_std == pytest.approx(std, rel=1e-12), s.name
            assert_normal(init_global(s, 3), std, s.name)
            checked += 1
    assert checked == 2 * 7 * 3
    check_embedding_head_and_norms(cfg)


def test_dense_weights_use_0_02_and_scaled_output_projections():
    cfg = config_from_dict({"model": dict(BIG_MODEL, arch="full", n_kv_heads=4)})
    out_std = 0.02 / np.sqrt(2 * BIG_MODEL["n_layers"])
    checked = 0
    for s in all_global_specs(cfg):
        if s.name.endswith("/W"):
            std = out_std if s.name.split("/")[2] in ("o", "down") else 0.02
            assert s.init_std == pytest.approx(std, rel=1e-12), s.name
            assert_normal(init_global(s, 3), std, s.name)
            checked += 1
    assert checked == 7 * 3
    check_embedding_head_and_norms(cfg)


def check_embedding_head_and_norms(cfg):
    specs = {s.name: s for s in all_global_specs(cfg)}
    for name in ("embed", "lm_head"):
        assert_normal(init_global(specs[name], 3), 0.02, name)
    norms = [n for n in specs if n.endswith("norm")]
    assert len(norms) == 2 * cfg.model.n_layers + 1
    for name in norms:
        np.testing.assert_array_equal(init_global(specs[name], 3), 1.0)


def assert_normal(sample, std, name):
    """Empirical std within 5% and mean near zero (all our tensors here hold >= 8000 values)."""
    assert sample.size >= 8000, name
    assert np.std(sample) == pytest.approx(std, rel=0.05), name
    assert abs(np.mean(sample)) < 5 * std / np.sqrt(sample.size), name
