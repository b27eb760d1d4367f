"""The type check of the package: mypy (pinned in pyproject.toml's [test] extra, configured in its
[tool.mypy]) finds no error in boostmpi/, and `typing.Any` is written nowhere in the package but
boostmpi/arrays.py (`Array`, an array of any backend). The seams (docs/DESIGN.md) are checked with
--strict's flags, every other module with disallow_untyped_defs; no module's errors are ignored.

Mutants: an unannotated function in a seam module fails mypy (read through --shadow-file, so the real
file is never touched), and an `Any` written outside arrays.py is found. mypy keeps its incremental
cache in .mypy_cache (ignored by git): a warm run reads only what changed.

Without mypy the tests skip, except under CI=true, where a missing tool is a failure."""

import ast
import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize
import tomllib
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PACKAGE = ROOT / "boostmpi"
IN_CI = os.environ.get("CI") == "true"
# the seams and their implementations: checked with --strict's flags
SEAM_MODULES = ("boostmpi.parallel.tensor_parallel.*", "boostmpi.model.recompute", "boostmpi.parallel.comm",
                "boostmpi.parallel.nccl", "boostmpi.gpu.attention", "boostmpi.gpu.attention_cudnn",
                "boostmpi.gpu.attention_torch")
STRICT_FLAGS = ("disallow_any_generics", "disallow_subclassing_any", "disallow_untyped_calls", "disallow_untyped_defs",
                "disallow_incomplete_defs", "check_untyped_defs", "disallow_untyped_decorators", "warn_unused_ignores",
                "warn_return_any", "no_implicit_reexport", "strict_equality", "extra_checks")


def require_mypy():
    if importlib.util.find_spec("mypy") is None:
        message = "mypy is not installed (pip install -e '.[test]')"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


def run_mypy(*options):
    """mypy over boostmpi/ from the repository root, with pyproject.toml's configuration."""
    return subprocess.run([sys.executable, "-m", "mypy", *options, "boostmpi"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)


def test_mypy_finds_no_error_in_the_package():
    require_mypy()
    result = run_mypy()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_an_untyped_function_in_a_seam_module_fails_mypy(tmp_path):
    require_mypy()
    seam = "boostmpi/parallel/tensor_parallel/base.py"
    mutant = tmp_path / "base.py"
    mutant.write_text((ROOT / seam).read_text() + "\n\ndef shard_width(strategy):\n    return strategy.p\n")
    result = run_mypy("--shadow-file", seam, str(mutant))
    assert result.returncode == 1, result.stdout[-3000:]
    assert f"{seam}:" in result.stdout and "[no-untyped-def]" in result.stdout, result.stdout[-3000:]


def _config():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def test_the_seams_are_strict_and_no_module_ignores_its_errors():
    config = _config()
    assert config["disallow_untyped_defs"] is True
    overrides = config.get("overrides", [])
    strict = [o for o in overrides if all(o.get(flag) is True for flag in STRICT_FLAGS)]
    covered = {m for o in strict for m in o["module"]}
    assert set(SEAM_MODULES) <= covered, set(SEAM_MODULES) - covered
    assert not config.get("ignore_errors") and not any(o.get("ignore_errors") for o in overrides)
    # ignore_missing_imports is for third-party modules only
    assert not any(m.startswith("boostmpi") for o in overrides if o.get("ignore_missing_imports") for m in o["module"])


def any_written(source):
    """Line numbers where `source` writes `Any`: as a name (typing.Any, `from typing import Any`) or
    inside a string annotation or cast."""
    lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.NAME and tok.string == "Any"}
    for node in ast.walk(ast.parse(source)):
        texts = []
        if isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation is not None:
            texts.append(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            texts.append(node.returns)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "cast":
            texts += node.args[:1]
        for text in texts:
            lines.update(sub.lineno for sub in ast.walk(text) if isinstance(sub, ast.Constant)
                         and isinstance(sub.value, str) and "Any" in re.findall(r"\w+", sub.value))
    return sorted(lines)


def test_any_is_written_only_in_arrays_py():
    found = {str(p.relative_to(ROOT)): any_written(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(found) > 40 and found.pop("boostmpi/arrays.py")
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_the_any_check_finds_any_however_it_is_written():
    real = (PACKAGE / "model" / "recompute.py").read_text()
    assert any_written(real) == []
    mutants = [real.replace("from typing import", "from typing import Any,", 1),
               real.replace("def own_buffer(a: Array) -> Array:", "def own_buffer(a: typing.Any) -> Array:", 1),
               real.replace("def own_buffer(a: Array) -> Array:", 'def own_buffer(a: "list[Any]") -> Array:', 1),
               real.replace("        return item\n", '        return cast("Any", item)\n', 1)]
    for mutant in mutants:
        assert mutant != real and any_written(mutant)
