"""What a lowrank forward keeps lives in a pool of its own on a GPU (boostmpi.gpu.pools), so CuPy's
best fit cannot split the transients' chunks with it: the device's free bytes stay flat layer after
layer, and a second step asks the device for nothing new.

Runs bench/gpu_trace.py's engine step in the stand-in's shapes-only mode (the paper's 7B layout
scaled down by 8, 8 layers, one rank, two steps), sampling the device's bytes in use and held over
every pool (the stand-in's `standin_device_peaks` counters) after each layer's forward. The mutation
test puts the kept arrays back in the default pool and requires the check to fail: there the free
bytes move from layer to layer as kept arrays split what the previous layer's transients freed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gpu_setup import GPU
from tests.support.paths import BENCH, pythonpath_with

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="samples the CuPy stand-in's pool; a real GPU is in use")]
ROOT = Path(__file__).resolve().parents[3]
LAYERS = 8

SCRIPT = r'''
import json, sys
mutant = "--mutant" in sys.argv
policy = sys.argv[2]
sys.argv = ["gpu_trace.py"]
from dataclasses import replace
import gpu_trace as gt  # imports bench/common.py before numpy
import cupy
from cupy import _memory
from boostmpi.gpu import pools
from boostmpi.model import recompute

_memory.set_meta(True)
gt._meta_init()
if mutant:  # the kept arrays made in the default pool
    pools.kept_empty = lambda shape, dtype: cupy.empty(shape, dtype=dtype)
samples = []
Policy = recompute.POLICIES[policy]
forward = Policy.forward


def sampled(self, block, h, *args):
    out = forward(self, block, h, *args)
    samples.append([_memory._DEVICE.used, _memory._DEVICE.total])
    return out


Policy.forward = sampled
rec = gt.Recorder()
gt.install(rec, run_kernels=True)
cfg = gt.config(8, %d)
gt.run_steps(rec, replace(cfg, train=replace(cfg.train, recompute=policy)), None, steps=2)
print(json.dumps({"samples": samples, "kept_pool": pools.kept_pool().total_bytes()}))
''' % LAYERS


def _run(tmp_path, policy, *extra):
    script = tmp_path / "kept_pool.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(ROOT / "bench"), policy, *extra], capture_output=True,
                          env=dict(os.environ, PYTHONPATH=pythonpath_with(BENCH)),
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(result):
    samples = result["samples"]
    assert len(samples) == 2 * LAYERS
    first, second = samples[:LAYERS], samples[LAYERS:]
    free = [total - used for used, total in first[1:]]  # after the first layer, whose transients set the pattern
    assert len(set(free)) == 1, f"free device bytes after each layer's forward move: {free}"
    held = [total for _, total in second]
    assert len(set(held)) == 1, f"the second step's forward asked the device for more: {held}"
    assert result["kept_pool"] > 0, "nothing was allocated from the kept pool"


@pytest.mark.parametrize("policy", ["lowrank", "layer"])
def test_kept_arrays_leave_the_transients_chunks_whole(policy, tmp_path):
    """lowrank keeps its rank-R activations, statistics and output; layer keeps each layer's input,
    the previous layer's output."""
    check(_run(tmp_path, policy))


@pytest.mark.parametrize("policy", ["lowrank", "layer"])
def test_mutant_kept_arrays_in_the_default_pool_fail_the_check(policy, tmp_path):
    """Under lowrank the mutant's free bytes move from layer to layer. Under layer the one kept array a
    layer (its output) is made before the MLP's transients on a GPU (the down projection's GEMM
    accumulates into it), and in the default pool they move too; were they flat, the empty kept pool
    would catch the mutant. The effect is measured at full size by `bench/gpu_trace.py --paper 7b --meta
    --recompute layer` (docs/MEMORY.md)."""
    with pytest.raises(AssertionError, match="free device bytes" if policy == "lowrank" else "free device bytes|kept pool"):
        check(_run(tmp_path, policy, "--mutant"))
