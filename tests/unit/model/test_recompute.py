"""Activation recomputation: `none`, `layer`, `lowrank` and `selective` give bit-identical losses and
gradients; `lowrank` and `selective` issue exactly the collectives of `none`, `layer` the extra forward ones;
the saved bytes equal docs/MEMORY.md; overlap on or off changes nothing.

Runs single-process (plain pytest) and under MPI (`mpiexec -n N python -m pytest --with-mpi -m mpi`)
with tp = N, the layout where recompute matters most.
"""

from dataclasses import replace

import numpy as np
import pytest

from boostmpi.config import config_from_dict
from tests.support.mpi_helpers import abort_on_error, assert_all_ranks

MODEL = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, attn_rank=8, mlp_rank=12, seq_len=8)
B, M = 2, 2


def _run(world, arch, mode, recompute, overlap, dtype, layout=None):
    from boostmpi.parallel.engine import Engine

    n = 1 if world is None else world.Get_size()
    layout = layout or {"tp": n}
    model = dict(MODEL, arch=arch, n_kv_heads=4 if layout.get("tp", 1) == 4 else 2)
    cfg = config_from_dict({"model": model, "parallel": dict(layout, tp_mode=mode, overlap=overlap),
                            "train": {"dtype": dtype, "micro_batch_size": B, "grad_accum": M, "recompute": recompute}},
                           world_size=n)
    eng = Engine(cfg, world)
    tokens = np.random.default_rng(7).integers(0, 61, (B * M, MODEL["seq_len"] + 1))
    micro = [(tokens[k * B:(k + 1) * B, :-1], tokens[k * B:(k + 1) * B, 1:]) for k in range(M)]
    eng.grid.counter.reset()
    loss = eng.forward_backward(micro)
    counts = np.array([eng.grid.counter.bytes["tp"], eng.grid.counter.calls["tp"]], dtype=np.int64)
    if world is not None:
        from mpi4py import MPI

        world.Allreduce(MPI.IN_PLACE, counts)
    return loss, np.array(eng.grads.data), counts, eng


def _compare_layout(world, layout, dtype):
    """Every recompute mode, overlap on and off: bit-identical to none in a pipeline/data layout."""
    base_loss, base_grads, base_counts, _ = _run(world, "cola", "btp", "none", True, dtype, layout)
    for recompute in ("layer", "lowrank", "selective"):
        for overlap in (True, False):
            loss, grads, counts, _ = _run(world, "cola", "btp", recompute, overlap, dtype, layout)
            assert_all_ranks(loss == base_loss and np.array_equal(grads, base_grads),
                             lambda: f"{layout} {recompute} overlap={overlap}: not bit-identical to none")
            if recompute == "lowrank":
                assert_all_ranks(np.array_equal(counts, base_counts), lambda: f"{layout}: lowrank traffic differs")


def _compare(world, arch, mode, dtype):
    n = 1 if world is None else world.Get_size()
    base_loss, base_grads, base_counts, base = _run(world, arch, mode, "none", True, dtype)
    e = np.dtype(dtype).itemsize
    N = B * MODEL["seq_len"]
    for recompute in ("layer", "lowrank", "selective"):
        if recompute == "lowrank" and mode == "vanilla" and n > 1:
            continue
        for overlap in (True, False):
            loss, grads, counts, eng = _run(world, arch, mode, recompute, overlap, dtype)
            same = loss == base_loss and np.array_equal(grads, base_grads)
            assert_all_ranks(same, lambda: f"{recompute} overlap={overlap}: not bit-identical to none")
            if recompute == "lowrank":
                assert_all_ranks(np.array_equal(counts, base_counts), lambda: f"lowrank traffic {counts} != none {base_counts}")
                Cl = MODEL["d_model"] // n if mode == "btp" else MODEL["d_model"]
                norm_stats = 2 if mode == "btp" else 0
                softmax_stats = 2 * MODEL["n_heads"] // (n if mode == "btp" else 1)  # fp32 or wider: e here
                per_token = Cl + 4 * MODEL["attn_rank"] + 3 * MODEL["mlp_rank"] + norm_stats + softmax_stats
                # the first layer's input is looked up again from the token ids, not kept
                want = [(per_token - Cl) * N * e] + [per_token * N * e] * (MODEL["n_layers"] - 1)
                assert_all_ranks(eng.saved_activation_bytes_per_layer == want,
                                 lambda: f"lowrank saved {eng.saved_activation_bytes_per_layer} != {want}")
            elif recompute == "selective":
                # none's cache less the core's two softmax statistics per local head and token; no
                # extra traffic (the core's recompute is local)
                softmax_stats = 2 * MODEL["n_heads"] // (n if mode == "btp" else 1)
                want = [b - softmax_stats * N * e for b in base.saved_activation_bytes_per_layer]
                assert_all_ranks(eng.saved_activation_bytes_per_layer == want,
                                 lambda: f"selective saved {eng.saved_activation_bytes_per_layer} != {want}")
                assert_all_ranks(np.array_equal(counts, base_counts), lambda: "selective traffic differs")
            elif recompute == "layer":
                Cl = MODEL["d_model"] // n if mode == "btp" else MODEL["d_model"]
                want = [Cl * N * e] * MODEL["n_layers"]
                assert_all_ranks(eng.saved_activation_bytes_per_layer == want, lambda: "layer saved bytes")
                if n > 1 and mode == "btp":
                    # the recompute re-issues each layer's forward all-reduces: N·(4Ra + 3Rm) + 2N elements, 4 calls
                    extra = MODEL["n_layers"] * M * (N * (4 * MODEL["attn_rank"] + 3 * MODEL["mlp_rank"]) + 2 * N) * e
                    assert_all_ranks(counts[0] - base_counts[0] == extra, lambda: f"layer extra bytes {counts[0] - base_counts[0]} != {extra}")
                    assert_all_ranks(counts[1] - base_counts[1] == 4 * MODEL["n_layers"] * M, lambda: "layer extra calls")
            assert_all_ranks(recompute == "none" or eng.saved_activation_bytes < base.saved_activation_bytes,
                             lambda: f"{recompute} keeps no less than none")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch,mode", [("cola", "btp"), ("svd", "btp"), ("cola", "vanilla")])
def test_recompute_modes_single_process(arch, mode, dtype):
    _compare(None, arch, mode, dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch,mode", [("cola", "btp"), ("svd", "btp"), ("cola", "vanilla")])
def test_recompute_modes_tensor_parallel(arch, mode, dtype):
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == 3:
        pytest.skip("tp = 3 does not divide the test model")
    with abort_on_error():
        _compare(MPI.COMM_WORLD, arch, mode, dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_recompute_modes_with_pipeline_and_data_parallelism(dtype):
    from mpi4py import MPI

    n = MPI.COMM_WORLD.Get_size()
    layouts = {2: [{"pp": 2}, {"dp": 2}], 3: [{"dp": 3}], 4: [{"tp": 2, "pp": 2}, {"pp": 2, "dp": 2}, {"tp": 2, "dp": 2}]}
    if n not in layouts:
        pytest.skip(f"no layout listed for {n} ranks")
    with abort_on_error():
        for layout in layouts[n]:
            _compare_layout(MPI.COMM_WORLD, layout, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["full", "cola"])
def test_selective_on_the_gpu_path_is_bit_identical_to_none(arch, dtype):
    """The GPU path (a real GPU or the CuPy stand-in): the core's forward again before its backward
    gives the loss and every gradient of `none`, bit for bit."""
    from tests.support.gpu_steps import step

    loss, grads = step(arch, "gpu", dtype, train={"recompute": "none"})
    sel_loss, sel_grads = step(arch, "gpu", dtype, train={"recompute": "selective"})
    assert sel_loss == loss
    assert all(np.array_equal(sel_grads[name], g) for name, g in grads.items())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lowrank_on_the_gpu_path_keeps_one_log_sum_exp_per_head_and_token(dtype):
    """The fused attention kernels' cache has one float32 statistic per head and token (the
    log-sum-exp), where the CPU path's tiled softmax has two (maximum and sum): lowrank on the GPU
    path keeps docs/MEMORY.md's `(Cl + 4·Ra + 3·Rm)·e + 2·4 + Hl·4` bytes per token, and boostmpi sim
    prices one statistic per row for its `flash` attention, two for `matmul`."""
    from boostmpi.parallel.engine import Engine
    from boostmpi.sim import operations, plans

    cfg = config_from_dict({"model": dict(MODEL, arch="cola"), "train": {"dtype": dtype, "micro_batch_size": B,
                                                                         "recompute": "lowrank", "device": "gpu"}})
    eng = Engine(cfg)
    x = np.zeros((B, MODEL["seq_len"]), dtype=np.int64)
    eng.forward_backward([(x, x)])
    e, N, Cl = 4 if dtype == "float32" else 2, B * MODEL["seq_len"], MODEL["d_model"]
    # the two RMSNorm statistics and the log-sum-exp are float32 in both dtypes
    per_token = (Cl + 4 * MODEL["attn_rank"] + 3 * MODEL["mlp_rank"]) * e + 2 * 4 + 4 * MODEL["n_heads"]
    want = [(per_token - Cl * e) * N] + [per_token * N] * (MODEL["n_layers"] - 1)  # the first input looked up again
    assert eng.saved_activation_bytes_per_layer == want

    s = operations.shape_of(cfg, "matmul")
    flash = replace(s, attention="flash")
    assert plans.kept_by_lowrank(plans.layer_plan(s, "btp"), s) - \
        plans.kept_by_lowrank(plans.layer_plan(flash, "btp"), flash) == s.B * s.H * s.T


@pytest.mark.mpi(min_size=2)
def test_the_selective_checks_can_fail(monkeypatch):
    """Keeping v as a view of the grouped projection's output (vanilla tp: q | k | v in one
    all-reduced buffer) keeps the rest of that buffer: the saved bytes check fails on every rank;
    a recompute that skips the core fails the backward."""
    from mpi4py import MPI

    from boostmpi.model import recompute, transformer

    if MPI.COMM_WORLD.Get_size() == 3:
        pytest.skip("tp = 3 does not divide the test model")
    monkeypatch.setattr(transformer, "own_buffer", lambda a: a)
    with pytest.raises(AssertionError, match="selective saved"):
        _compare(MPI.COMM_WORLD, "cola", "vanilla", "float64")
    monkeypatch.undo()
    monkeypatch.setattr(recompute.SelectiveRecompute, "cache", lambda self, block, saved, look_up: saved.cache)
    with pytest.raises(ValueError):  # a tuple of q, k, v where the backward needs the core's cache
        _run(None, "cola", "btp", "selective", True, "float64")


def test_sim_prices_selective_as_the_engine_keeps_it():
    """boostmpi sim: selective keeps what the engine keeps per layer (none's set less the core's softmax
    statistics), runs the core's forward again in the backward, and for a framework that keeps the
    probabilities (T per row) saves them."""
    from boostmpi.parallel.engine import Engine
    from boostmpi.sim import model, operations, plans
    from boostmpi.sim.machines import load_machine

    cfg = config_from_dict({"model": dict(MODEL, arch="cola"), "train": {"recompute": "selective", "dtype": "float32",
                                                                         "micro_batch_size": B}})
    s = operations.shape_of(cfg, "matmul")  # the engine's tiled attention
    layer = plans.layer_plan(s, "btp")
    kept = plans.saved_elements(layer) - plans.core_statistics(layer)
    eng = Engine(cfg)
    x = np.zeros((B, MODEL["seq_len"]), dtype=np.int64)
    eng.forward_backward([(x, x)])
    assert eng.saved_activation_bytes_per_layer == [kept * 4] * MODEL["n_layers"]
    assert [op.name for op in plans.recompute_plan(layer, "selective")] == ["scores", "softmax", "probs@v"]
    probs = replace(s, softmax_saved_per_row=s.T)  # a framework keeping the probabilities
    assert plans.core_statistics(plans.layer_plan(probs, "btp")) == s.B * s.H * s.T * s.T

    machine = load_machine("a100-80gb")
    big = {"model": dict(MODEL, arch="cola", d_model=1024, n_heads=16, n_kv_heads=16, d_ff=2816, attn_rank=256,
                         mlp_rank=256, seq_len=2048, n_layers=16), "train": {"micro_batch_size": 4, "dtype": "bfloat16",
                                                                            "device": "gpu"}}
    def predicted(rc, keeps_probs):
        w = model.workload_of(config_from_dict({**big, "train": dict(big["train"], recompute=rc)}))
        if keeps_probs:  # materialised scores whose probabilities the backward reads (T per row)
            w = replace(w, shape=replace(w.shape, softmax_saved_per_row=w.shape.T, attention="matmul"), attention="matmul")
        return model.predict_workload(w, machine)

    # the engine's GPU attention (flash on this machine, kernels/attention.cu) keeps one log-sum-exp per
    # row: selective saves it, less the core it rebuilds for the layer in its backward; a framework
    # keeping the probabilities saves T per row and layer
    for keeps_probs in (False, True):
        runs = {rc: predicted(rc, keeps_probs) for rc in ("none", "selective", "layer")}
        act = {rc: p.memory_bytes["activations"] for rc, p in runs.items()}
        assert runs["none"].time_s < runs["selective"].time_s < runs["layer"].time_s
        if keeps_probs:
            w = model.workload_of(config_from_dict(big))
            probs = w.shape.B * w.shape.H * w.shape.T ** 2 * 2  # bf16
            assert act["layer"] < act["selective"] < act["none"] - 0.9 * (big["model"]["n_layers"] - 1) * probs
        else:
            assert abs(act["selective"] - act["none"]) < 0.02 * act["none"]
