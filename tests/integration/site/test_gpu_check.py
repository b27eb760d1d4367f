"""jobs/gpu_check.sh as written, in an emulated fixed environment (a centre's module or a container:
nothing can be installed, no network):

  * a Python that is its own prefix with `python3` only (testing/site_emu/build.py real_prefix), no
    .venv in the checkout, no BOOSTMPI_VENV or BOOSTMPI_PYTHON, boostmpi not installed (the script
    puts the checkout on PYTHONPATH for itself and its ranks);
  * its packages as the environment's owner installed them (this interpreter's NumPy, mpi4py with
    MPICH, h5py, xxhash, pytest, ml_dtypes), and CuPy for CUDA 13 in CUDA 13's wheel layout: the
    suite's CuPy stand-in installed as cupy-cuda13x 14.2.0 (as testing/site_emu's stub wheels do) with
    crt/mma.h in nvidia/cu13/include (nvidia-cuda-crt), where the tensor-core attention must find it;
  * no network: its own network namespace (root and unshare), as on a compute node without one.

One GPU: the single-rank tests run, the multi-rank ones and the two-rank step each say in one line
why not, status 0. Four GPUs (BOOSTMPI_STANDIN_GPUS=4): the multi-rank tests and the two-rank NCCL
step run. Without a loadable MPI (libmpi gone) the steps that need one say so in one line.
BOOSTMPI_GPU_CHECK_TESTS picks one test of each kind and the FMA attention runs, so that the
script, not the suite, is what takes the time. tests/run.sh runs these in a step of their own
(BOOSTMPI_GPU_CHECK_EMU=1).
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from testing.site_emu.build import real_prefix

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(os.environ.get("BOOSTMPI_GPU_CHECK_EMU") != "1",
                                reason="the emulated fixed environment runs in tests/run.sh's step 'gpu_check in a fixed "
                                       "environment' (BOOSTMPI_GPU_CHECK_EMU=1)")

SINGLE = "tests/kernels/test_kernels.py::test_compile_all_compiles_every_kernel_file"
MULTI = "tests/integration/gpu/test_gpu.py::test_zero1_bf16_keeps_master_slices_and_equals_zero0_through_nccl"
EMPTY = "tests/kernels/test_kernels.py::test_empty_inputs_launch_nothing"
# what the environment's owner did not install: the real CuPy and CUDA wheels, PyTorch, and boostmpi
NOT_INSTALLED = ("cupy", "cupyx", "cupy_backends", "cupy_cuda", "nvidia", "cuda", "torch", "boostmpi",
                 "__editable__", "_boostmpi")


def _fixed_environment(root):
    """root/python: python3 with the packages above; root/repo: the checkout as cloned (no .venv)."""
    prefix = root / "python"
    real_prefix(prefix)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(prefix)}))
    ours = Path(sysconfig.get_path("purelib"))
    for entry in ours.iterdir():
        if not entry.name.startswith(NOT_INSTALLED):
            (site / entry.name).symlink_to(entry)
    for name in ("cupy", "cupyx"):
        (site / name).symlink_to(REPO / "testing" / "cupy_standin" / name)
    (site / "testing").symlink_to(REPO / "testing")  # testing.cudaemu, the harness the stand-in imports
    for dist, version in (("cupy_cuda13x", "14.2.0"), ("nvidia_cuda_crt", "13.0.88")):
        info = site / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n")
    crt = site / "nvidia" / "cu13" / "include" / "crt"
    crt.mkdir(parents=True)
    (crt / "mma.h").write_text("// CUDA 13's crt/mma.h (nvidia-cuda-crt): found, not compiled, on the stand-in\n")
    # MPICH's launcher and library, as the environment's MPI module would put them on PATH
    venv = Path(sys.executable).parent
    for tool in ("mpiexec", "mpiexec.hydra", "hydra_pmi_proxy"):
        (prefix / "bin" / tool).symlink_to(venv / tool)
    for lib in venv.parent.glob("lib/*"):  # libmpi and, in mpich/, the libraries it loads
        if lib.name.startswith(("libmpi", "mpich")):
            (prefix / "lib" / lib.name).symlink_to(lib)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.split(b"\0")
    for rel in filter(None, files):
        src, dst = REPO / rel.decode(), root / "repo" / rel.decode()
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return prefix


def _gpu_check(root, prefix, gpus, timeout, tests=f"{SINGLE} {MULTI}", **more):
    # the FMA attention: the harness runs the emulated tensor-core kernels 3.5x slower (tests/conftest.py);
    # where the header was found is in the kernels line all the same
    env = {"PATH": f"{prefix / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "TMPDIR": str(root), "BOOSTMPI_STANDIN_GPUS": str(gpus), "BOOSTMPI_GPU_CHECK_TESTS": tests,
           "BOOSTMPI_ATTENTION_TENSOR_CORES": "0", "LANG": "C.UTF-8", **more}
    for keep in ("XDG_CACHE_HOME", "BOOSTMPI_CUDAEMU_CACHE", "CI", "PYTHONPYCACHEPREFIX"):  # the compile caches
        if keep in os.environ:
            env[keep] = os.environ[keep]
    offline = ["unshare", "--net"] if os.geteuid() == 0 and shutil.which("unshare") else []
    if offline and subprocess.run([*offline, "true"], capture_output=True).returncode != 0:
        offline = []
    done = subprocess.run([*offline, "bash", "jobs/gpu_check.sh"], cwd=root / "repo", env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = {line.split(": ", 2)[1]: line.split(": ", 2)[2] for line in done.stdout.splitlines()
             if line.startswith("gpu_check: ") and line.count(": ") >= 2}
    return done, lines


@pytest.fixture(scope="module")
def fixed():
    """Built afresh at a fixed place beside the harness's compile cache: the kernels' options name
    the environment's CUDA 13 include folder, so the harness compiles them once, not every run."""
    from testing import cudaemu

    root = cudaemu.cache_dir() / "gpu-check-fixed-env"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    yield root, _fixed_environment(root)
    shutil.rmtree(root, ignore_errors=True)


def test_one_gpu_in_a_fixed_offline_cuda13_environment(fixed):
    root, prefix = fixed
    done, lines = _gpu_check(root, prefix, 1, 900)
    report = f"{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert done.returncode == 0, report
    assert lines["environment"].startswith("ok Python") and "(this checkout on PYTHONPATH)" in lines["environment"], report
    assert str(prefix / "bin") in lines["environment"], report  # python3 from PATH, nothing else
    assert lines["mpi"].startswith("ok "), report
    assert lines["cupy"].startswith("ok CuPy 14.2.0") and "(cupy-cuda13x)" in lines["cupy"], report
    assert lines["gpu"].startswith("ok 1 visible"), report
    # the tensor-core attention found crt/mma.h in CUDA 13's wheel layout
    site = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert lines["kernels"].startswith("ok ") and lines["kernels"].endswith(
        f"; crt/mma.h in {site / 'nvidia' / 'cu13' / 'include'}"), report
    assert lines["gpu tests, 1 rank"].startswith("ok 1 passed, 1 deselected"), report
    assert lines["gpu tests, 4 ranks"] == ("skip the multi-rank GPU tests start 4 ranks, one GPU each; "
                                           "this node has 1"), report
    assert lines["bf16 steps, 1 GPU"].startswith("ok done: "), report
    assert lines["2 ranks, nccl"] == "skip two ranks need two GPUs; this node has 1", report


def test_four_gpus_run_the_multi_rank_tests_and_two_ranks_through_nccl(fixed):
    root, prefix = fixed
    done, lines = _gpu_check(root, prefix, 4, 1500, tests=f"{EMPTY} {MULTI}")
    report = f"{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert done.returncode == 0, report
    assert lines["gpu tests, 4 ranks"].startswith("ok 1 passed, 1 deselected"), report
    assert lines["2 ranks, nccl"].startswith("ok comm: "), report


def test_without_a_loadable_mpi_the_steps_that_need_one_say_so(fixed):
    """The same environment with mpi4py's MPI library gone (as where no MPI module is loaded)."""
    root, prefix = fixed
    libraries = sorted((prefix / "lib").glob("libmpi*"))
    for lib in libraries:
        lib.rename(lib.with_name(f"hidden-{lib.name}"))
    try:
        done, lines = _gpu_check(root, prefix, 4, 600, tests=EMPTY, BOOSTMPI_PYTHON="python3")  # as OPERATIONS.md shows
    finally:
        for lib in libraries:
            lib.with_name(f"hidden-{lib.name}").rename(lib)
    report = f"{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert done.returncode == 1, report
    assert f"({prefix / 'bin' / 'python3'})" in lines["environment"], report
    assert lines["mpi"].startswith("FAIL mpi4py loads no MPI library (one GPU needs one too): "), report
    for step in ("gpu tests, 4 ranks", "bf16 steps, 1 GPU", "2 ranks, nccl"):
        assert lines[step] == "skip needs a loadable MPI library (see the mpi line)", (step, report)
