"""Which CuPy the tests get: the real one when it reaches a GPU, else the stand-in in testing/cupy_standin.

conftest.py's `pytest_configure` calls `GPU.choose()` before collection imports any test module (and with
it `cupy`, imported once a process); importing this module chooses nothing. With the
stand-in, its folder goes first on sys.path and on PYTHONPATH (so subprocesses and `mpiexec` runs
started by tests get it too), and BOOSTMPI_CUPY_STANDIN=1 records the choice for those children.
BOOSTMPI_CUPY_STANDIN=1 forces the stand-in; =0 forbids it (the GPU tests then need a real device).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT, TESTING, pythonpath_with

STANDIN = TESTING / "cupy_standin"
_PROBE = "import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 3)"


def _real_cupy_reaches_a_gpu():
    spec = importlib.util.find_spec("cupy")
    if spec is None or (spec.origin and Path(spec.origin).is_relative_to(STANDIN)):
        return False
    try:  # in a child process: a CuPy that cannot find a driver must not stay imported here
        return subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class _Gpu:
    """The choice, made once per process by `choose()` (the first read of `standin` makes it too)."""

    def __init__(self):
        self._standin = None

    @property
    def standin(self):
        return self.choose()

    def choose(self):
        """Probes for a GPU (in a child process) unless BOOSTMPI_CUPY_STANDIN decides, and installs the
        stand-in when it is the choice; returns whether it is."""
        if self._standin is None:
            choice = os.environ.get("BOOSTMPI_CUPY_STANDIN")
            self._standin = choice == "1" or (choice != "0" and not _real_cupy_reaches_a_gpu())
            if self._standin:
                self.install()
        return self._standin

    def install(self):
        if str(STANDIN) in sys.path:
            sys.path.remove(str(STANDIN))
        sys.path.insert(0, str(STANDIN))
        os.environ["PYTHONPATH"] = pythonpath_with(STANDIN, ROOT)
        os.environ["BOOSTMPI_CUPY_STANDIN"] = "1"
        # a real CuPy imported before the choice goes; the stand-in itself, already imported, stays one module
        for name in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if not Path(origin).is_relative_to(STANDIN):
                del sys.modules[name]

    def describe(self):
        if self.standin:
            from cupy.cuda import runtime

            name = runtime.getDeviceProperties(0)["name"].decode()
            from testing import cudaemu

            return (f"CuPy stand-in + CUDA execution harness on the CPU (no GPU used), emulating {name} "
                    f"(BOOSTMPI_STANDIN_GPU={os.environ.get('BOOSTMPI_STANDIN_GPU', 'a100')}); harness schedule: "
                    f"{cudaemu.describe_schedule()}")
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        return f"real GPU: {name}, CuPy {cupy.__version__}"


GPU = _Gpu()


def need_gpus(ranks):
    """Skips a test that starts `ranks` ranks, one GPU each, on a real node with fewer GPUs (the
    start-up check refuses two ranks on one GPU); the stand-in has as many as asked."""
    if GPU.standin:
        return
    import cupy
    import pytest

    count = cupy.cuda.runtime.getDeviceCount()
    if count < ranks:
        pytest.skip(f"{ranks} ranks need {ranks} GPUs, one each; this node has {count}")


def use_hipblas_standin(monkeypatch):
    """The stand-in's libhipblas (cupy/cuda/hipblas_lib.py) as the library on $ROCM_PATH for one test,
    loaded afresh by boostmpi.gpu.hipblas; returns the stand-in module (its `calls`). The caller clears
    `boostmpi.gpu.hipblas.library`'s cache when the test ends."""
    from cupy.cuda import hipblas_lib

    from boostmpi.gpu import hipblas

    monkeypatch.setenv("ROCM_PATH", str(hipblas_lib.build()))
    hipblas_lib.install()
    hipblas.library.cache_clear()
    return hipblas_lib


CUDNN_STANDIN = TESTING / "cudnn_standin"


def use_cudnn_frontend(monkeypatch):
    """The cuDNN frontend for one test: on the CuPy stand-in, the frontend's stand-in
    (testing/cudnn_standin/cudnn, on sys.path and PYTHONPATH for this test only) with a library named
    libcudnn.so.9 on $LD_LIBRARY_PATH for boostmpi to preload; on a real GPU, the installed
    nvidia-cudnn-frontend. Returns the `cudnn` module. boostmpi.gpu.attention_cudnn's handles and graphs
    are forgotten before and after, and the process-wide attention backend is own again afterwards
    (monkeypatch's undo)."""
    from boostmpi.gpu import attention, attention_cudnn

    def forget():
        attention_cudnn._handles.clear()
        attention_cudnn._graphs.clear()
        attention_cudnn.build_seconds.clear()
        for name in [m for m in sys.modules if m == "cudnn" or m.startswith("cudnn.")]:
            del sys.modules[name]

    forget()
    monkeypatch.setattr(attention, "_current", attention.OwnAttention())
    if GPU.standin:
        monkeypatch.syspath_prepend(str(CUDNN_STANDIN))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(CUDNN_STANDIN), os.environ.get("PYTHONPATH", "")]))
        import cudnn

        monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join([str(cudnn.build_library()),
                                                               os.environ.get("LD_LIBRARY_PATH", "")]))
        cudnn.reset()
    monkeypatch.setattr(attention_cudnn, "_loaded", [])
    attention_cudnn.frontend()
    import cudnn

    return cudnn, forget
