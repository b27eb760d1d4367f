"""A non-editable install (`pip install .`, how a cluster user installs into a shared environment)
carries every file the package reads at run time: the CUDA kernel sources and the performance
model's machine profiles.

The wheel is built from this checkout (no build isolation, no download), installed without its
dependencies into a fresh venv outside the checkout; the dependencies (NumPy, h5py, mpi4py) come
from the test's own environment through a .pth line, so nothing is fetched. Then, from a folder
that is not the checkout: `sim` with the README's machine names, every kernel's source loaded, and
a few training steps on the built-in corpus. About 20 s.
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.mpi_skip  # one process is enough; it builds and installs


def _run(argv, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BOOSTMPI_KERNELS_DIR")}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    # an MPI library installed from PyPI (the mpich wheel) lives in this environment's lib/
    lib = Path(sys.prefix) / "lib"
    if any(lib.glob("libmpi*.so*")):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib), env.get("LD_LIBRARY_PATH")]))
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv holding the wheel, a working folder outside the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", root / "dist", REPO],
         cwd=root)
    wheel = next((root / "dist").glob("boostmpi-*.whl"))
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], cwd=root)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip())
    # the dependencies, from this environment (the line goes after the venv's own folder on sys.path)
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = root / "work"
    work.mkdir()
    shutil.copy(REPO / "configs" / "tiny.toml", work / "tiny.toml")
    where = _run([python, "-c", "import boostmpi; print(boostmpi.__file__)"], cwd=work).strip()
    assert where.startswith(str(site)), f"boostmpi imported from {where}, not from the installed wheel"
    return python, work


def test_sim_knows_the_readme_machines(installed):
    python, work = installed
    names = set(re.findall(r"--machine ([\w.-]+)", (REPO / "README.md").read_text()))
    assert "a100-80gb" in names
    for name in sorted(names | {"h100-sxm", "mi250x-gcd"}):
        out = _run([python, "-m", "boostmpi", "sim", "--config", "tiny.toml", "--machine", name, "--json"], cwd=work)
        assert '"time_s"' in out, out


def test_every_kernel_source_loads(installed):
    python, work = installed
    expected = sorted(p.name for p in (REPO / "kernels").glob("*.cu"))
    out = _run([python, "-c", "from boostmpi.gpu import kernels\n"
                "d = kernels.kernels_dir()\n"
                "names = sorted(p.name for p in d.glob('*.cu'))\n"
                "sizes = [len(kernels.kernel_source(n[:-3])) for n in names]\n"
                "print(d); print(' '.join(names)); print(min(sizes))"], cwd=work)
    directory, names, smallest = out.splitlines()
    assert "site-packages" in directory and str(REPO) not in directory, directory
    assert names.split() == expected
    assert int(smallest) > 500
    source = _run([python, "-c", "from boostmpi.gpu import kernels; print(kernels.kernel_source('rmsnorm'))"], cwd=work)
    assert not re.search(r'^#include "', source, re.MULTILINE)  # common.cuh was pasted in


def test_a_few_training_steps_on_the_built_in_corpus(installed):
    python, work = installed
    out = _run([python, "-m", "boostmpi", "train", "--config", "tiny.toml", "--set", "train.steps=2",
                "--set", "train.run_dir=run", "--set", "train.val_windows=4"], cwd=work)
    assert "done: step 2" in out, out
    assert (work / "data" / "builtin").is_dir() and (work / "run" / "checkpoints" / "step_00000002" / "COMPLETE").exists()
