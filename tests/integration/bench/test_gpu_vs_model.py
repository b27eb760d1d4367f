"""bench/gpu_vs_model.py without a GPU: the comparison's arithmetic through --timings, the phase
wrappers on the CuPy stand-in (every phase seen, the step's result unchanged, the product's
functions restored), and its refusal without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from boostmpi.backend import to_numpy
from boostmpi.sim.machines import load_machine
from boostmpi.sim.model import predict
from tests.support.gpu_setup import GPU
from tests.integration.bench.test_gpu_calibrate import load_script

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "bench" / "gpu_vs_model.py"
PHASES = {"attention": 0.010, "gemm": 0.050, "fused": 0.008, "optimizer": 0.006, "other": 0.004, "step": 0.078}


@pytest.fixture(scope="module")
def vs():
    return load_script(SCRIPT)


def test_ratios_per_phase_from_timings(vs, tmp_path, capsys):
    timings = tmp_path / "t.json"
    timings.write_text(json.dumps({"device": "NVIDIA H200", "phases": PHASES}))
    out = tmp_path / "out.json"
    args = ["--timings", str(timings), "--profile", "h100-sxm", "--layers", "1", "--seq", "1024", "--json", str(out)]
    assert vs.main(args) == 0
    printed = capsys.readouterr().out
    assert "| gemm | 50.00 |" in printed
    result = json.loads(out.read_text())
    sim = predict(vs.config(1, 1, 1024), load_machine("h100-sxm")).breakdown
    rows = {r["phase"]: r for r in result["rows"]}
    assert rows["gemm"]["sim"] == pytest.approx(sim["gemm"])
    assert rows["gemm"]["sim_ratio"] == pytest.approx(sim["gemm"] / 0.050)
    assert rows["optimizer"]["trace_ratio"] == pytest.approx(result["trace"]["optimizer"] / 0.006)
    assert result["trace"]["gemm"] > 0 and result["trace"]["optimizer"] > 0  # the stand-in trace ran
    step_sim = sum(sim.values())
    assert rows["step"]["sim_ratio"] == pytest.approx(step_sim / 0.078)


def test_attention_is_compared_where_a_model_prices_it_apart(vs):
    measured = dict(PHASES)
    apart = {"gemm": 0.04, "elementwise": 0.01, "attention": 0.02, "optimizer": 0.005}
    inside = {"gemm": 0.04, "elementwise": 0.03, "optimizer": 0.005}
    rows = {r["phase"]: r for r in vs.comparison(measured, apart, inside)}
    assert rows["attention"]["sim_ratio"] == pytest.approx(0.02 / 0.010)
    assert rows["attention"]["trace"] == "inside" and rows["attention"]["trace_ratio"] is None
    assert rows["fused"]["measured"] == pytest.approx(0.012)  # fused kernels + CuPy's own operations
    assert rows["fused"]["sim_ratio"] == pytest.approx(0.01 / 0.012)
    assert rows["fused"]["trace_ratio"] == pytest.approx(0.03 / 0.022)  # attention folded in where it is inside
    assert "(in elementwise)" in vs.table(list(rows.values()))


@pytest.mark.skipif(not GPU.standin, reason="the stand-in's launches; a real GPU times them for real")
def test_wrappers_see_every_phase_and_change_nothing(vs):
    from boostmpi.gpu import blas, kernels
    from boostmpi.parallel.engine import Engine
    from boostmpi.train import trainer
    from boostmpi.train.optim import AdamW

    originals = (blas.matmul, kernels.rmsnorm_forward, kernels.attention_forward, trainer.optimizer_step)
    small = dict(vs.MODEL, d_model=64, n_heads=2, d_ff=128, rank=16, vocab_size=96, n_layers=1, seq_len=16)
    from boostmpi.config import config_from_dict

    cfg = config_from_dict({"model": small, "train": {"device": "gpu", "dtype": "bfloat16", "micro_batch_size": 1}})
    phases, calls, eng = vs.measure(cfg, 1, elapsed=lambda start, stop: 1e-3)
    assert (blas.matmul, kernels.rmsnorm_forward, kernels.attention_forward, trainer.optimizer_step) == originals
    assert all(calls[p] > 0 for p in ("attention", "gemm", "fused", "optimizer")), calls
    assert phases["optimizer"] == pytest.approx(1e-3)  # one outermost call: the kernels inside it not again
    assert phases["gemm"] == pytest.approx(calls["gemm"] * 1e-3)

    ref = Engine(cfg)
    opt = AdamW(ref.params, ref.specs, cfg.train, ref.xp)
    rng = np.random.default_rng(0)
    shape = (1, 16)
    batch = [(rng.integers(0, 96, shape), rng.integers(0, 96, shape))]
    for _ in range(2):
        ref.forward_backward(batch)
        trainer.optimizer_step(ref, opt, 1e-4, 1.0)
    np.testing.assert_array_equal(to_numpy(eng.params.data), to_numpy(ref.params.data))


@pytest.mark.skipif(not GPU.standin, reason="a real GPU is here: the script would time it")
def test_without_a_gpu_it_refuses_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(tmp_path / "x.json")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: bench/gpu_vs_model.py times a step on a GPU"), lines
    assert list(tmp_path.iterdir()) == []


def test_bad_timings_and_profile_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"phases": {"gemm": 1.0}}))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"phases": PHASES}))
    for args in (["--timings", str(bad)], ["--timings", str(good), "--profile", "nonesuch"], ["--layers", "0"]):
        done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)


def test_only_the_outermost_call_is_timed(vs):
    """A wrapped function called inside another (an attention backend's own kernels inside its
    `forward`) counts once, in the outer one's phase."""
    from types import SimpleNamespace

    class Clock:
        class cuda:
            Event = type("Event", (), {"record": lambda self: None})

            class Device:
                def synchronize(self):
                    pass

    ns = SimpleNamespace(inner=lambda: 1)
    ns.outer = lambda: ns.inner() + 1
    timer = vs.PhaseTimer(Clock, elapsed=lambda start, stop: 1.0)
    timer.wrap(ns, "inner", "fused")
    timer.wrap(ns, "outer", "attention")
    timer.on = True
    assert ns.outer() == 2 and ns.inner() == 1
    phases = timer.collect()
    assert (phases["attention"], phases["fused"], timer.calls["attention"], timer.calls["fused"]) == (1.0, 1.0, 1, 1)
    timer.restore()
    assert not hasattr(ns.outer, "__wrapped__") and not hasattr(ns.inner, "__wrapped__")
