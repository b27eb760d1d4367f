"""bench/gpu_step.py `--graph`: its graph measurement (`graph_step`) on a tiny model, on the GPU path (the CuPy
stand-in's capture where no GPU is reached; the script itself refuses the stand-in, so the function is
called directly): the warm-up and capture line, then the replayed step's time, MFU and ratio to the eager
step; a configuration the graph mode refuses is one line. And its device-memory line's split."""

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest

from tests.support.paths import BENCH
from tests.unit.train.test_graph_step import small_config, step_batches

pytestmark = pytest.mark.gpu


def load_gpu_step(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as running the script would
    spec = importlib.util.spec_from_file_location("gpu_step", BENCH / "gpu_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_graph_measurement_captures_and_times_replays(monkeypatch, capsys):
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW

    bench = load_gpu_step(monkeypatch)
    cfg = small_config()
    eng = Engine(cfg)
    opt = AdamW(eng.params, eng.specs, cfg.train, eng.xp, shard=eng.shard, master=eng.master)
    launches = []
    from boostmpi.train import graph_step

    real = graph_step.GraphStep.step
    monkeypatch.setattr(graph_step.GraphStep, "step", lambda self, *a: (launches.append(self.graph), real(self, *a))[1])

    def gpu_time(fn, repeats, warmup=2):  # the stand-in has no device clock: the calls, and a time to print
        for _ in range(warmup + repeats):
            fn()
        return 0.25

    monkeypatch.setattr(bench, "gpu_time", gpu_time)
    capsys.readouterr()
    bench.graph_step(cfg, eng, opt, step_batches(cfg, 0), 0.5, 1e12, 1e14, SimpleNamespace(steps=2, profile=False))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("graph: warm-up (2 eager steps) and capture in ")
    assert out[1] == ("boostmpi graph step 250.0 ms | 4 TFLOP/s | MFU vs measured GEMM rate 4% (target >= 35%) | "
                      "eager / graph = 2.00")
    # two eager steps and the capture untimed; gpu_time's two warm-up calls and two timed ones replays
    assert [g is None for g in launches] == [True, True, True, False, False, False, False]
    assert np.isfinite(opt.master.get()).all()


def test_a_refused_configuration_is_one_line(monkeypatch, capsys):
    from boostmpi.gpu import attention

    bench = load_gpu_step(monkeypatch)
    monkeypatch.setattr(attention, "current", lambda: SimpleNamespace(name="torch"))
    grid = SimpleNamespace(world_size=1)
    capsys.readouterr()
    bench.graph_step(small_config(attention="torch"), SimpleNamespace(grid=grid), None, None, 1.0, 1e9, 1e12, None)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("graph: refused: train.cuda_graph = true cannot capture train.attention")


def test_the_device_memory_line_splits_what_the_process_holds(monkeypatch):
    """In use = total - free; the pools are boostmpi's count of both; PyTorch's allocator only where torch is
    imported and its CUDA initialised; the rest is what is left (the outside-pool allowance, measured)."""
    import sys

    import cupy

    from boostmpi.gpu import pools

    bench = load_gpu_step(monkeypatch)
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: (70 * 10**9, 80 * 10**9))
    monkeypatch.setattr(pools, "total_bytes", lambda xp: 7 * 10**9)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    m = bench.device_memory(cupy)
    assert m == {"in_use": 10**10, "pools": 7 * 10**9, "torch": 0, "rest": 3 * 10**9}
    fake = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True, memory_reserved=lambda: 2 * 10**9))
    monkeypatch.setitem(sys.modules, "torch", fake)
    m = bench.device_memory(cupy)
    assert (m["torch"], m["rest"]) == (2 * 10**9, 10**9)
    assert bench.device_memory_line("at start", m) == (
        "device memory at start: 10.00 GB in use = CuPy's pools 7.00 + PyTorch's allocator 2.00 + the rest 1.00 "
        "(context, kernel modules, library workspaces)")
