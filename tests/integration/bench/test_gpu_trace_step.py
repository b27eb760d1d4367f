"""bench/gpu_trace.py --gpu-step --meta: bench/gpu_step.py's model (cola d 1024, 24 layers, bf16), one step
traced whole on the CuPy stand-in in shapes-only mode, counted by kind. The counts are pinned exactly: a
change to what the GPU step launches changes them, and bench/log/gpu_step.md's stand-in trace records them.

The mutant puts the forward's residual add back as its own kernel (the down projection no longer
accumulates into the residual: btp's `output_accumulates` false), which the count must catch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gpu_setup import GPU
from tests.support.paths import BENCH, pythonpath_with

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="traces on the CuPy stand-in; a real GPU is in use")]

# one step of the GPU path at this commit (bench/log/gpu_step.md, "stand-in trace")
COUNTS = {"cuBLAS GEMMs": 723, "RawKernels": 488, "attention kernels": 72, "CuPy elementwise": 0,
          "CuPy reductions": 3, "copies, memsets, gathers": 8, "total": 1294}

SCRIPT = r'''
import sys
mutant = sys.argv[1]
sys.argv = ["gpu_trace.py", "--gpu-step", "--meta", "--json", sys.argv[2]]
import gpu_trace as gt  # imports bench/common.py before numpy
if mutant == "add-apart":
    from boostmpi.parallel.tensor_parallel import btp
    btp.BottleneckTP.output_accumulates = lambda self, h: False
gt.main()
'''


def _counts(tmp_path, mutant="none"):
    script, out = tmp_path / "step_counts.py", tmp_path / f"{mutant}.json"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), mutant, str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=pythonpath_with(BENCH)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_gpu_step_launches_what_the_log_records(tmp_path):
    got = _counts(tmp_path)
    assert got["counts"] == COUNTS, got["counts"]
    assert not any(name.startswith("elementwise add") for name in got["by_name"])  # no residual or gradient adds


def test_the_count_catches_the_residual_add_apart(tmp_path):
    got = _counts(tmp_path, "add-apart")
    assert got["counts"] != COUNTS
    assert got["by_name"]["elementwise add bfloat16"] == 24  # one forward add a layer
