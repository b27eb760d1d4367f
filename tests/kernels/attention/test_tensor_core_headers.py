"""Where the tensor-core attention finds CUDA's crt/mma.h (boostmpi/gpu/tensor_cores.py mma_include),
for CUDA 12 and CUDA 13 alike:

  * a folder on CuPy's own NVRTC include path comes first (CUDA 13's nvidia/cu13/include, a toolkit);
  * then the wheel layout of the installed CuPy's CUDA major: nvidia/cuda_nvcc/include (CUDA 12's
    nvcc wheel), nvidia/cu13/include (CUDA 13's crt wheel), never the other major's;
  * then $CUDA_PATH, $CUDA_HOME and the toolkit of the nvcc on PATH;
  * the line that reports a missing header names the package of the installed CuPy's CUDA major;
  * in this environment, with the real CuPy (a child process), the header is found in the wheels of
    the CuPy installed here (cupy-cuda12x or cupy-cuda13x); under CI=true its absence fails.
"""

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.support import gpu_compilers
from boostmpi.gpu import tensor_cores


def _tree(root, *folders):
    """root/<folder>/include/crt/mma.h for each folder; returns {folder: root/folder}."""
    out = {}
    for folder in folders:
        (root / folder / "include" / "crt").mkdir(parents=True)
        (root / folder / "include" / "crt" / "mma.h").write_text("")
        out[folder] = root / folder
    return out


@pytest.fixture
def fake_site(monkeypatch, tmp_path):
    """Both wheel layouts under tmp_path, found through find_spec; no CuPy include path, no toolkit."""
    wheels = _tree(tmp_path, "cuda_nvcc", "cu13")
    names = {"nvidia.cuda_nvcc": wheels["cuda_nvcc"], "nvidia.cu13": wheels["cu13"]}

    def find_spec(name, *args):
        if name in names:
            return SimpleNamespace(submodule_search_locations=[str(names[name])])
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(tensor_cores.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(tensor_cores, "_cupy_include_dirs", lambda: [])
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    tensor_cores.mma_include.cache_clear()
    yield wheels
    tensor_cores.mma_include.cache_clear()


@pytest.mark.parametrize("major,folder", [(12, "cuda_nvcc"), (13, "cu13")])
def test_the_wheel_layout_of_cupys_cuda_major_is_used(monkeypatch, fake_site, major, folder):
    monkeypatch.setattr(tensor_cores, "cupy_cuda_major", lambda: major)
    assert tensor_cores.mma_include() == f"-I{fake_site[folder] / 'include'}"


def test_the_other_majors_wheel_is_never_used(monkeypatch, fake_site):
    """A CUDA 12 nvcc wheel left beside cupy-cuda13x must not give CUDA 13's NVRTC CUDA 12's header."""
    monkeypatch.setattr(tensor_cores, "cupy_cuda_major", lambda: 13)
    (fake_site["cu13"] / "include" / "crt" / "mma.h").unlink()
    assert tensor_cores.mma_include() is None


def test_cupys_own_include_path_comes_first(monkeypatch, fake_site, tmp_path):
    toolkit = _tree(tmp_path / "opt", "cuda")["cuda"]
    monkeypatch.setattr(tensor_cores, "cupy_cuda_major", lambda: 12)
    monkeypatch.setattr(tensor_cores, "_cupy_include_dirs", lambda: [tmp_path / "cupy-headers", toolkit / "include"])
    assert tensor_cores.mma_include() == f"-I{toolkit / 'include'}"


@pytest.mark.parametrize("major,package,other", [(12, "nvidia-cuda-nvcc-cu12", "nvidia-cuda-crt"),
                                                 (13, "nvidia-cuda-crt", "nvidia-cuda-nvcc-cu12")])
def test_the_missing_header_line_names_the_package_of_cupys_cuda(monkeypatch, major, package, other):
    monkeypatch.setattr(tensor_cores, "cupy_cuda_major", lambda: major)
    line = tensor_cores.header_missing()
    assert package in line and other not in line and "\n" not in line


def test_without_a_cuda_wheel_of_cupy_the_line_names_both(monkeypatch):
    monkeypatch.setattr(tensor_cores, "cupy_cuda_major", lambda: None)
    line = tensor_cores.header_missing()
    assert "nvidia-cuda-nvcc-cu12" in line and "nvidia-cuda-crt" in line


def test_the_header_of_this_environments_cuda_wheels_is_found():
    """The real CuPy (a child: the tests import the stand-in) and this environment's CUDA wheels:
    mma_include() names the header of the installed CuPy's CUDA major."""
    gpu_compilers.require("NVRTC")
    major = gpu_compilers.cuda_major()
    code = ("import json; from boostmpi.gpu import tensor_cores as t; "
            "print(json.dumps([t.cupy_cuda_major(), t.mma_include(), t._cupy_include_dirs() and 'cupy']))")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=gpu_compilers._real_cupy_env(), cwd=gpu_compilers.HERE.parent)
    assert child.returncode == 0, child.stderr[-3000:]
    found_major, include, cupy_path = json.loads(child.stdout.splitlines()[-1])
    assert found_major == major and cupy_path == "cupy", child.stdout
    spec = importlib.util.find_spec(tensor_cores.WHEEL_HEADERS[major][0])
    wheel = [f"-I{p}/include" for p in spec.submodule_search_locations]
    assert include in wheel, (include, wheel)


def test_two_cupy_wheels_in_one_environment_are_refused_in_one_line(monkeypatch):
    """[gpu] (cupy-cuda12x) installed over [gpu-cuda13] (cupy-cuda13x): a GPU run stops in one line."""
    import importlib.metadata

    from boostmpi import backend
    from boostmpi.errors import UserError

    installed = {"cupy-cuda12x", "cupy-cuda13x"}

    def version(dist):
        if dist in installed:
            return "14.2.0"
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(UserError, match="cupy-cuda12x and cupy-cuda13x are installed in one environment") as caught:
        backend.get_xp("gpu")
    assert "\n" not in str(caught.value)
    installed.discard("cupy-cuda12x")
    assert backend.cupy_wheels_problem() is None
