"""The stand-in's shapes-only ("meta") mode traces the same GPU step as the computing stand-in.

Under `mpiexec -n 2` (tensor parallelism 2, NCCL stand-in) each rank runs bench/gpu_trace.py's
`run_steps` on the paper's 7B layout scaled down by 32 (2 layers, two steps, the second recorded),
first computing (RawKernels run on the CUDA execution harness, GEMMs and collectives carry values),
then in meta mode (arrays without values), and compares what the two recorded: every kernel launch,
GEMM (shape and cuBLAS types), copy, reduction and collective with its call site and bytes, the
host synchronisations, the named (NVTX) ranges, the engine's communication counters, and the
memory pool's high-water marks and largest allocation during forward/backward; the ranges nest and
name every layer's forward and backward and the collectives. The mutation test runs the same with the
meta mode's reduction shapes made wrong (reduced axes kept whatever `keepdims` says) and requires the
comparison to fail.

One thing depends on values and is compared by kind, name, site and dtype only: the vocabulary-
parallel cross-entropy backward selects, with a boolean mask, the targets that fall in this rank's
vocabulary shard; the meta mode counts a mask as selecting every element, the computing run
selects those targets (a few kilobytes per micro-batch, also seen in the pool's bytes held).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gpu_setup import GPU
from tests.support.mpi_helpers import MPIEXEC
from tests.support.paths import BENCH, pythonpath_with

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="checks the CuPy stand-in; a real GPU is in use")]
ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r'''
import json, sys
results = sys.argv[2]
sys.argv = ["gpu_trace.py"] + sys.argv[3:]
import gpu_trace as gt  # imports bench/common.py before numpy
import cupy
from cupy import _memory
from mpi4py import MPI

world = MPI.COMM_WORLD
rec = gt.Recorder()
gt.install(rec, run_kernels=True)
cfg = gt.config(32, 2, world.Get_size())


def summary(run):
    ops = [[op.kind, op.name, op.site, op.nbytes, op.dtype, op.gemm, op.cublas] for op in run["ops"]]
    return {"ops": ops, "host_syncs": run["host_syncs"], "pool": run["pool"], "largest_fb": run["largest_fb"],
            "counted": run["counted"], "ranges": run["ranges"]}


computing = summary(gt.run_steps(rec, cfg, world, steps=2, max_norm=0))
_memory.set_meta(True)
if "--mutant" in sys.argv:
    right = cupy._reduced_shape
    cupy._reduced_shape = lambda shape, axis, keepdims: right(shape, axis, True)
try:
    meta = summary(gt.run_steps(rec, cfg, world, steps=2, max_norm=0))
except Exception as exc:  # a mutant may fail outright: that too is a difference
    meta = {"error": f"{type(exc).__name__}: {exc}"}
out = {"rank": world.Get_rank(), "computing": computing, "meta": meta}
with open(f"{results}/rank{world.Get_rank()}.json", "w") as f:
    json.dump(out, f)
'''


def _run(tmp_path, *extra):
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    script = tmp_path / "meta_vs_computing.py"
    script.write_text(SCRIPT)
    done = subprocess.run(["timeout", "300", MPIEXEC, "-n", "2", sys.executable, str(script), str(ROOT / "bench"),
                           str(tmp_path), *extra], capture_output=True, text=True, timeout=360,
                          env=dict(os.environ, PYTHONPATH=pythonpath_with(BENCH)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1], done.stdout[-2000:]
    return results


MASKED = "parallel.vocab_parallel.cross_entropy_backward"  # ops sized by a boolean mask's selection


def _differences(result):
    a, b = result["computing"], result["meta"]
    if "error" in b:
        return [b["error"]]
    out = [key for key in a if key not in ("ops", "pool") and a[key] != b[key]]
    if len(a["ops"]) != len(b["ops"]):
        return out + [f"{len(a['ops'])} ops computing, {len(b['ops'])} meta"]
    masked = 0
    for x, y in zip(a["ops"], b["ops"]):
        if x[2] == MASKED and x[0] in ("copy", "elementwise") and x[3] != y[3] and max(x[3], y[3]) < 1 << 16:
            masked += abs(x[3] - y[3])
            x, y = x[:3] + x[4:], y[:3] + y[4:]
        if x != y:
            out.append(f"{x} (computing) != {y} (meta)")
    if a["pool"]["used"] != b["pool"]["used"] or abs(a["pool"]["total"] - b["pool"]["total"]) > max(masked, 1) * 4:
        out.append(f"pool {a['pool']} (computing) != {b['pool']} (meta)")
    return out


def test_meta_trace_equals_the_computing_trace(tmp_path):
    for result in _run(tmp_path):
        assert _differences(result) == [], f"rank {result['rank']}: meta and computing traces differ"
        ops = result["computing"]["ops"]
        kinds = {op[0] for op in ops}
        assert {"gemm", "elementwise", "reduction", "kernel", "collective"} <= kinds, kinds
        assert all(op[6] is not None for op in ops if op[0] == "gemm")  # every GEMM with its cuBLAS types
        assert result["computing"]["host_syncs"] > 0
        assert result["computing"]["pool"]["total"] >= result["computing"]["pool"]["used"] > 0
        assert result["computing"]["largest_fb"] > 0
        ranges = result["computing"]["ranges"]  # named ranges around layers and collectives, nested
        open_ = []
        for kind, name in ranges:
            if kind == "push":
                open_.append(name)
            elif kind == "pop":
                assert open_ and open_.pop() == name, ranges
        assert not open_
        names = {name for kind, name in ranges if kind == "push"}
        assert {"layer 0 forward", "layer 1 forward", "layer 0 backward", "layer 1 backward",
                "tp allreduce", "tp allgather"} <= names, names


def test_mutant_meta_shapes_are_caught(tmp_path):
    """Reductions that keep the reduced axes in meta mode whatever keepdims says (the mutant) give a
    different trace, or fail. (The step's reductions are sums without keepdims: the gradient norm's
    and the ones along the token axis; the fused kernels do the rest.)"""
    assert all(_differences(result) for result in _run(tmp_path, "--mutant"))
