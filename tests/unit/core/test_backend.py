"""boostmpi/backend.py imports CuPy only when a GPU is asked for: a CPU training run, start to end, never
imports it (CuPy's import is 0.15-0.3 s in every rank), and asking about a NumPy array does not either."""

import os
import subprocess
import sys
import textwrap

from tests.support.paths import ROOT

CPU_RUN = textwrap.dedent('''
    import sys
    import numpy as np
    from boostmpi import backend
    from boostmpi.cli import main
    assert backend.get_array_module(np.zeros(2)) is np and backend.to_numpy(np.zeros(2)).shape == (2,)
    status = main(["train", "--config", "configs/tiny.toml", "--set", "train.steps=1",
                   "--set", f"train.run_dir={sys.argv[1]}"])
    print("status", status, "cupy imported", "cupy" in sys.modules)
''')


def test_a_cpu_run_never_imports_cupy(tmp_path):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", CPU_RUN, str(tmp_path / "run")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == "status 0 cupy imported False", p.stdout[-2000:]


def test_asking_for_the_gpu_imports_cupy_once():
    """The GPU's module is CuPy (the real one or the tests' stand-in), imported on that first call."""
    p = subprocess.run([sys.executable, "-c", "import sys; from boostmpi import backend; "
                        "before = 'cupy' in sys.modules; backend.gpu_unavailable_reason(); "
                        "print(before, backend._cupy is sys.modules.get('cupy') is not None)"],
                       cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["False", "True"], p.stdout
