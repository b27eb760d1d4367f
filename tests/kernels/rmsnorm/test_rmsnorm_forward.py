"""rmsnorm_forward as the GPU sees it: the bf16 row held in registers and moved in 16-byte vectors.

- NVRTC's PTX of rmsnorm_forward_bf16 (sm_80, sm_90) loads and stores x in 16-byte vectors
  (`ld.global[.nc].v4`, `st.global.v4`), and its ptxas report leaves no spills and at least 2
  resident blocks per SM at the loader's launch shape for the paper's 7B width (d 4096) and the
  widest (d 16384);
- the launch covers a row with whole warps, the launch plan's forward_vectors vectors per thread;
- the kernel equals the NumPy model (boostmpi/model/layers.py) on the held path with partly
  filled registers, on the two-pass loop of a row wider than the block holds, and on the scalar
  path (on the CUDA execution harness where no GPU is present);
- the performance model prices the engine's forward as one read and one write of x.
"""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support import gpu_compilers
from boostmpi.backend import to_numpy
from boostmpi.gpu import kernels, launch_plan
from boostmpi.model import layers
from tests.support.gpu_compilers import require

pytestmark = pytest.mark.gpu
BF16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
EPS = 1e-6
OPTIONS = kernels.compile_options("rmsnorm", 32)

_CHILD = r"""
import json, sys
from cupy.cuda import compiler
source, options, archs = json.loads(sys.stdin.read())
out = {}
for arch in archs:
    ptx = compiler._NVRTCProgram(source, "rmsnorm.cu").compile(tuple(options) + (f"-arch=compute_{arch}",))[0]
    out[arch] = ptx.decode() if isinstance(ptx, bytes) else ptx
sys.stdout.write(json.dumps(out))
"""


def _ptx(source, archs=("80", "90")):
    """{arch: PTX text} of `source` from NVRTC (the real CuPy's compiler binding, in a child)."""
    require("NVRTC")
    child = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps([source, list(OPTIONS), list(archs)]),
                           capture_output=True, text=True, env=gpu_compilers._real_cupy_env(), timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout)


def _entry(ptx, name):
    return ptx.split(f".entry {name}(")[1].split(".entry ")[0]


VECTOR_LOAD = re.compile(r"ld\.global(\.nc)?\.v4\.")
VECTOR_STORE = re.compile(r"st\.global\.v4\.")


def test_bf16_forward_moves_x_in_16_byte_vectors():
    source = kernels.kernel_source("rmsnorm")
    for arch, ptx in _ptx(source).items():
        body = _entry(ptx, "rmsnorm_forward_bf16")
        assert VECTOR_LOAD.search(body) and VECTOR_STORE.search(body), f"compute_{arch}: no 16-byte access"
    # the check itself: a kernel whose vectorised paths are gone has none
    scalar = source.replace("const bool vectorised = C % V == 0", "const bool vectorised = false && C % V == 0")
    body = _entry(_ptx(scalar, ("90",))["90"], "rmsnorm_forward_bf16")
    assert not VECTOR_LOAD.search(body) and not VECTOR_STORE.search(body)


def test_forward_launch_covers_the_row_with_whole_warps():
    assert kernels.rmsnorm_forward_threads(4096, 2, 32) == 128  # 7B width, bf16: 512 vectors, 4 per thread
    assert kernels.rmsnorm_forward_threads(4096, 4, 32) == 256
    assert kernels.rmsnorm_forward_threads(16384, 2, 32) == 512  # held, 4 vectors per thread
    assert kernels.rmsnorm_forward_threads(16384, 4, 32) == 512  # wider than held: the two-pass loop
    assert kernels.rmsnorm_forward_threads(37, 2, 64) == 64
    for C in (8, 1000, 4096, 5120, 16384):
        for itemsize in (2, 4):
            threads = kernels.rmsnorm_forward_threads(C, itemsize, 32)
            vectors = -(-C // (16 // itemsize))
            assert threads % 32 == 0 and threads <= launch_plan.RMSNORM.forward_max_threads
            assert threads * 4 >= vectors or threads == launch_plan.RMSNORM.forward_max_threads


def test_bf16_forward_keeps_two_blocks_per_sm_at_the_7b_and_widest_rows():
    require("NVRTC")
    from tests.kernels.test_kernel_resources import nvidia_resident_blocks

    jobs = [(kernels.kernel_source("rmsnorm"), OPTIONS, arch) for arch in ("80", "90")]
    for report in gpu_compilers.nvrtc(jobs):
        assert report["ok"], report["log"]
        table = gpu_compilers.ptxas_table(report["log"])
        for (entry, arch), info in table.items():
            if not entry.startswith("rmsnorm_forward"):
                continue
            assert info["spills"] == 0 and info["stack"] == 0, (entry, arch, info)
            itemsize = 2 if entry.endswith("bf16") else 4
            for C in (4096, 16384):
                threads = kernels.rmsnorm_forward_threads(C, itemsize, 32)
                blocks = nvidia_resident_blocks(arch, info["registers"], threads, info["smem"])
                assert blocks >= 2, f"{entry} {arch} C={C}: {blocks} blocks ({info['registers']} registers x {threads})"


# (dtype, C, vectors per thread, max threads): held with the last register vector partly used,
# held at 4 per thread, the two-pass loop (C past 4 x 32 threads x V), the scalar path
CASES = [(BF16, 1000, 4, 512), (np.float32, 4096, 2, 512), (np.float32, 1028, 4, 32), (BF16, 2056, 1, 32),
         (BF16, 1003, 2, 512)]


@pytest.mark.parametrize("dtype,C,per_thread,max_threads", CASES)
def test_forward_equals_the_model_on_each_path(monkeypatch, dtype, C, per_thread, max_threads):
    import cupy

    monkeypatch.setattr(launch_plan, "RMSNORM", dataclasses.replace(launch_plan.RMSNORM, forward_vectors=per_thread,
                                                                     forward_max_threads=max_threads))
    rng = np.random.default_rng(3)
    x = (2 * rng.standard_normal((3, C))).astype(dtype)
    w = rng.standard_normal(C).astype(dtype)
    y, rstd = kernels.rmsnorm_forward(cupy.asarray(x), cupy.asarray(w), EPS)
    y_ref, rstd_ref = layers.rmsnorm_forward(x.astype(np.float32), w.astype(np.float32), EPS)
    np.testing.assert_allclose(to_numpy(rstd), rstd_ref[:, 0], rtol=1e-5)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(to_numpy(y).astype(np.float32), y_ref.astype(dtype).astype(np.float32),
                               rtol=tol, atol=tol)


def test_the_model_prices_the_forward_as_one_read_and_one_write():
    from types import SimpleNamespace

    from boostmpi.sim import plans

    op = plans.norm(SimpleNamespace(engine_kernels=True, gpu=True), "attn_norm", 16384, 4096)
    assert (op.fwd_passes, op.elements) == (2, 16384 * 4096)


def test_the_trace_counts_one_read_and_one_write_of_x():
    """bench/gpu_trace.py's bytes of the final norm's rmsnorm_forward (the 7B width, shapes only):
    x read and y written once, w and rstd beside them."""
    from boostmpi.config import config_from_dict
    from tests.integration.bench.test_gpu_calibrate import load_script

    B, T, C = 2, 64, 4096
    model = {"arch": "cola", "d_model": C, "n_heads": 32, "d_ff": 11008, "rank": 1024, "n_layers": 1,
             "vocab_size": 512, "seq_len": T}
    cfg = config_from_dict({"model": model, "train": {"device": "gpu", "dtype": "bfloat16", "micro_batch_size": B}})
    vs_model = load_script(Path(__file__).resolve().parents[3] / "bench" / "gpu_vs_model.py")
    recorded = vs_model.trace(cfg, "h100-sxm")["kernels"]
    N = B * T
    assert "rmsnorm_forward_f32" not in recorded
    assert set(recorded["rmsnorm_forward_bf16"]) == {2 * N * C * 2 + C * 2 + 4 * N}
