"""Where things are, and the one place that makes the repository importable for child processes.

The pytest process finds `boostmpi`, `tests.support` and `testing` through pyproject.toml's
`[tool.pytest.ini_options] pythonpath = ["."]` (the repository root on sys.path). A test that starts a
Python child (a script under mpiexec, a CLI run) passes them on through PYTHONPATH: `export_root()`,
called once from conftest.py's `pytest_configure`, puts the root first there. No other module edits
sys.path for that purpose (the CuPy and cuDNN stand-ins go first on the path only when chosen, in
gpu_setup.py; see tests/README.md).
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"
TESTING = ROOT / "testing"
BENCH = ROOT / "bench"


def pythonpath_with(*first):
    """PYTHONPATH with `first` (paths, in order) at its front and each only once."""
    heads = [str(path) for path in first]
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in heads]
    return os.pathsep.join(heads + rest)


def export_root():
    """The repository root first on PYTHONPATH (unless already there), for every child process."""
    parts = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in parts:
        os.environ["PYTHONPATH"] = pythonpath_with(ROOT)
