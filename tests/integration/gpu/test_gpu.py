"""The GPU path end to end: whole training steps on CuPy against the CPU float64 path.

Runs on a real GPU where CuPy reaches one, else on the CuPy stand-in (testing/cupy_standin), whose
RawKernel launches run the kernels' source through the CUDA execution harness and whose NCCL is
carried out by MPI between real ranks; the pytest header says which. Nothing here is skipped.

Tolerances (relative: loss to the CPU loss, each gradient tensor's largest error to its largest
magnitude): float32 1e-4; bfloat16 2e-3 on the loss and 0.1 on gradients. bf16 keeps 8 bits of
mantissa: every GEMM output and activation is rounded to 2^-8 relative, and the gradients of a
two-layer model gather a few percent of error from that (measured on this model: up to 4%).
Multi-rank runs are held to the single-rank GPU run with the same tolerances.
"""

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.gpu_setup import need_gpus
from tests.support.gpu_steps import ARCHS, DTYPES, LAYOUTS, layout_archs, step

pytestmark = pytest.mark.gpu

TOLERANCE = {"float32": dict(loss=1e-4, grad=1e-4), "bfloat16": dict(loss=2e-3, grad=0.1)}
ROOT = Path(__file__).resolve().parents[3]
SUPPORT = ROOT / "tests" / "support"


def assert_step_close(got, want, dtype, what):
    (loss, grads), (ref_loss, ref_grads) = got, want
    tol = TOLERANCE[dtype]
    assert abs(loss - ref_loss) <= tol["loss"] * abs(ref_loss), f"{what}: loss {loss} vs {ref_loss}"
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        err = np.abs(grads[name] - g).max() / (np.abs(g).max() + 1e-30)
        assert err <= tol["grad"], f"{what}: {name} relative error {err:.3g} > {tol['grad']}"


@functools.lru_cache(maxsize=None)
def cpu_step(arch, recompute="none"):
    return step(arch, "cpu", "float64", train=dict(recompute=recompute))


@functools.lru_cache(maxsize=None)
def gpu_step(arch, dtype, recompute="none"):
    return step(arch, "gpu", dtype, train=dict(recompute=recompute))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_step_matches_cpu(arch, dtype):
    assert_step_close(gpu_step(arch, dtype), cpu_step(arch), dtype, f"{arch} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch,recompute", [("full", "layer"), ("svd", "lowrank"), ("cola", "layer"), ("cola", "lowrank"),
                                           ("full", "selective"), ("cola", "selective")])
def test_gpu_recompute_modes_match_cpu(arch, recompute, dtype):
    assert_step_close(gpu_step(arch, dtype, recompute), cpu_step(arch), dtype, f"{arch} {dtype} recompute={recompute}")


@pytest.mark.parametrize("arch,dtype", [("full", "float32"), ("cola", "bfloat16")])
def test_gpu_steps_launch_the_fused_kernels(monkeypatch, arch, dtype):
    """A step runs on CuPy arrays through the kernels of kernels/*.cu, not a fallback."""
    import cupy

    from boostmpi.backend import get_xp
    from boostmpi.gpu import kernels

    assert get_xp("gpu") is cupy
    launched = set()
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda kernel, *a, **k: (launched.add(kernel.name), launch(kernel, *a, **k)))
    step(arch, "gpu", dtype)
    suffix = "f32" if dtype == "float32" else "bf16"
    expected = {"rmsnorm_forward", "rmsnorm_projection", "rmsnorm_backward", "gate_forward", "gate_backward"}
    if arch == "cola":  # btp's bottleneck: online RMSNorm, the SiLU on the rank-R activation, the fused backward
        expected = {"rmsnorm_forward", "rmsnorm_projection", "rmsnorm_backward", "rmsnorm_online_stats",
                    "residual_online_stats", "btp_rescale_silu", "silu_forward",
                    "silu_backward", "btp_backward_pre", "btp_backward_post"}
    expected = {f"{name}_{suffix}" for name in expected} | {"softmax_xent_f32_i64"}  # the head: float32 logits
    assert expected <= launched, sorted(launched)


def _in_default_run(layout, arch):
    """The multi-rank cases of the default run: tp2 in every arch, every other layout in cola (the layouts'
    own code paths; each arch's layers are held to the CPU at tp2 and on one rank). The rest: slow."""
    return layout == "tp2" or arch == "cola"


@pytest.fixture(scope="module")
def multi_rank_results(tmp_path_factory, slow_run):
    """Every layout of gpu_steps.LAYOUTS (the default run's cases unless the slow ones run too), run once
    under `mpiexec -n 4` (through the NCCL stand-in)."""
    need_gpus(4)
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    assert mpiexec, "mpiexec not found (pip install mpich)"
    out = tmp_path_factory.mktemp("gpu_ranks") / "results.npz"
    calls = out.with_name("cupy_calls.txt")  # each rank's CuPy call signatures (the stand-in records them)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", BOOSTMPI_STANDIN_RECORD=str(calls))
    cases = [] if slow_run else [f"{n}/{a}" for n, a, _ in _layout_cases() if _in_default_run(n, a)]
    proc = subprocess.run([mpiexec, "-n", "4", sys.executable, str(SUPPORT / "gpu_steps.py"), str(out), "", "", "",
                           ",".join(cases)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, f"mpiexec -n 4 gpu_steps.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with np.load(out) as data:
        results = {k: data[k] for k in data.files}
    results["cupy calls"] = set(calls.read_text().split("\n")) - {""} if calls.exists() else set()
    return results


def _layout_cases():
    for name, _ranks, _parallel, train in LAYOUTS:
        for arch in layout_archs(name, train):
            yield name, arch, train.get("recompute", "none")


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,arch,recompute", [c if _in_default_run(*c[:2]) else pytest.param(*c, marks=pytest.mark.slow)
                                                   for c in _layout_cases()])
def test_multi_rank_gpu_equals_single_rank(multi_rank_results, layout, arch, recompute, dtype):
    prefix = f"{layout}/{arch}/{dtype}/"
    loss = float(multi_rank_results[prefix + "loss"])
    grads = {k[len(prefix) + 5:]: v for k, v in multi_rank_results.items() if k.startswith(prefix + "grad/")}
    assert_step_close((loss, grads), gpu_step(arch, dtype, recompute), dtype, prefix)
@pytest.mark.multirank
def test_multi_rank_gpu_steps_make_only_checked_cupy_calls(multi_rank_results):
    """Every layout's CuPy calls are in the table read against CuPy's source (test_cupy_calls.py)."""
    from tests.support.gpu_setup import GPU
    from tests.unit.gpu.test_cupy_calls import unchecked

    if not GPU.standin:  # a real CuPy checks its calls itself
        return
    calls = multi_rank_results["cupy calls"]
    assert any(c.startswith("cublas.gemm A14") for c in calls), "no call signatures recorded by the ranks"
    assert not unchecked(calls), f"CuPy calls not checked against CuPy 14.2.0's source: {unchecked(calls)}"


def test_the_gpu_benchmark_refuses_the_standin_clearly():
    """bench/gpu_step.py stays runnable; without a device it says so in one line instead of timing the CPU."""
    from tests.support.gpu_setup import GPU

    if not GPU.standin:  # on a real GPU the benchmark is for measuring, not for this suite
        return
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_step.py")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: bench/gpu_step.py measures a GPU"), proc.stderr


def run_four_ranks(script, folder):
    """`mpiexec -n 4 python tests/support/SCRIPT FOLDER`, which prints `ok` on rank 0 or one line per failed check."""
    need_gpus(4)
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([mpiexec, "-n", "4", sys.executable, str(SUPPORT / script), str(folder)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
@pytest.mark.multirank
def test_zero1_bf16_keeps_master_slices_and_equals_zero0_through_nccl(tmp_path):
    """tp=2 x dp=2 bf16 (tests/support/gpu_zero_steps.py): with zero_stage = 1 each rank holds float32 master weights
    for its dp slice only (memory asserted) and all-gathers the bf16 compute buffer; losses and weights
    equal zero_stage = 0 bit for bit over three steps (two ranks' sums do not depend on order, the update
    is elementwise), with the NCCL reduce-scatter on the side stream and blocking; its checkpoint loads
    back exactly under zero_stage 1 and as the same master weights under 0."""
    run_four_ranks("gpu_zero_steps.py", tmp_path)
@pytest.mark.multirank
def test_zero1_bf16_trains_reports_its_share_and_resumes_under_other_layouts(tmp_path):
    """`boostmpi train` at tp=2 x dp=2, zero_stage = 1, bf16 (tests/support/gpu_zero_resume.py): memory.params is the
    float32 slice plus the whole bf16 copy; its checkpoint resumes under zero_stage = 0 with the same
    losses bit for bit and under tp=2 x pp=2 within the bf16 tolerance (other accumulation order)."""
    run_four_ranks("gpu_zero_resume.py", tmp_path)


def test_single_rank_gpu_steps_at_64_lanes():
    """The single-rank float32 and bfloat16 tests above again with the stand-in device an MI250X GCD
    (`BOOSTMPI_STANDIN_GPU=mi250x`): a 64-wide wavefront, so the kernels are built with -DWARP_SIZE=64 and
    launched at the block sizes the loader picks for it (the multi-rank steps at 64 lanes:
    tests/emulators/cupy_standin/test_stream_order.py), and ROCm's BLAS: the bfloat16 products are hipBLAS's own GEMMs through
    the stand-in's libhipblas (boostmpi/gpu/hipblas.py, tests/unit/gpu/test_hipblas.py)."""
    from tests.support.gpu_setup import GPU

    if not GPU.standin:  # a real device has the warp width it has
        return
    # every arch and dtype, the launches, and lowrank's recompute (its Tape replayed, the attention's kept row
    # statistics); the layer and selective recomputes, which run the step's kernels again, at 32 lanes only
    subset = ("(test_gpu_step_matches_cpu or (test_gpu_recompute_modes_match_cpu and lowrank) or "
              "test_gpu_steps_launch_the_fused_kernels) and (float32 or bfloat16)")
    env = dict(os.environ, BOOSTMPI_STANDIN_GPU="mi250x", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(Path(__file__).resolve()),
                           "-k", subset], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert "AMD Instinct MI250X" in proc.stdout and " 12 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("device,caught", [("a100", False), ("mi250x", True)])
def test_a_reduction_made_for_32_lanes_is_caught_at_64(device, caught):
    """Mutant: the warp reduction every kernel shares (kernels/common.cuh) starts at offset 16 instead of
    WARP_SIZE / 2, changed in the text the loader hands the compiler (tests/support/gpu_order_checks.py). Single-rank
    steps against the CPU: identical at 32 lanes, so only the 64-lane run can catch it, and it does."""
    from tests.support.gpu_setup import GPU

    if not GPU.standin:
        return
    env = dict(os.environ, BOOSTMPI_STANDIN_GPU=device, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SUPPORT / "gpu_order_checks.py"), "single", "warp-32-reduction"],
                          capture_output=True, text=True, timeout=600, env=env)
    if caught:
        assert proc.returncode != 0 and "AssertionError: full float32: loss" in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
