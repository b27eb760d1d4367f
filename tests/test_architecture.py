"""The layering of the package, read from the source: boostmpi/parallel/ (the grid, communication,
the engine) imports nothing from the layers that use it, boostmpi/train/, boostmpi/tools/ and
boostmpi/sim/ — at the top of a module or inside a function. The mutation test shows that the check
fails when the rule is broken."""

import ast
from pathlib import Path

import boostmpi

PACKAGE = Path(boostmpi.__file__).parent
KERNELS = PACKAGE.parent / "kernels"
PARALLEL = PACKAGE / "parallel"
ABOVE_PARALLEL = ("boostmpi.train", "boostmpi.tools", "boostmpi.sim")


def imported_modules(source, module):
    """Every module `source` (the text of module `module`, dotted) imports, anywhere in it, relative
    imports resolved; for `from X import Y` both X and X.Y (Y may be a submodule)."""
    found = []
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]
    return found


def upward_imports(files):
    """[(file, imported module)] for each import of a layer above parallel/ in `files` ({path: text})."""
    bad = []
    for path, source in files.items():
        module = "boostmpi." + ".".join(Path(path).relative_to(PACKAGE).with_suffix("").parts)
        for name in imported_modules(source, module):
            if any(name == top or name.startswith(top + ".") for top in ABOVE_PARALLEL):
                bad.append((str(Path(path).relative_to(PACKAGE)), name))
    return sorted(set(bad))


def parallel_sources():
    return {str(p): p.read_text() for p in sorted(PARALLEL.rglob("*.py"))}


def test_parallel_imports_nothing_from_train_tools_or_sim():
    files = parallel_sources()
    assert len(files) >= 10 and str(PARALLEL / "engine.py") in files
    assert upward_imports(files) == []


def test_the_import_check_finds_an_upward_import_anywhere():
    """Mutants of the real engine.py: an import of train/ at the top, one of sim/ inside a function,
    a relative one (`from ..tools import x`) and `import boostmpi.train.optim`; each is found, and the
    real file passes."""
    path = str(PARALLEL / "engine.py")
    real = Path(path).read_text()
    assert upward_imports({path: real}) == []
    top = real.replace("import numpy as np\n", "import numpy as np\n\nfrom boostmpi.train.optim import clip_coefficient\n", 1)
    inner = real.replace("    def grad_norm(self):\n",
                         "    def grad_norm(self):\n        from boostmpi.sim.model import predict  # noqa\n", 1)
    relative = real.replace("import numpy as np\n", "import numpy as np\n\nfrom ..tools import inspect\n", 1)
    plain = real.replace("import numpy as np\n", "import numpy as np\nimport boostmpi.train.optim\n", 1)
    for mutant, expected in ((top, "boostmpi.train.optim"), (inner, "boostmpi.sim.model"),
                             (relative, "boostmpi.tools"), (plain, "boostmpi.train.optim")):
        assert mutant != real
        assert ("parallel/engine.py", expected) in upward_imports({path: mutant}), expected


MAX_LINES = 600  # a module a reader takes in at one sitting


def modules_too_long(files, limit=MAX_LINES):
    """[(file, lines)] of the modules in `files` ({path: text}) longer than `limit` lines."""
    return [(path, text.count("\n")) for path, text in sorted(files.items()) if text.count("\n") > limit]


def test_no_module_of_the_package_is_longer_than_600_lines():
    files = {str(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert len(files) > 40
    assert modules_too_long(files) == []
    # mutant: one module grown past the limit is named
    path = str(PACKAGE / "parallel" / "engine.py")
    grown = dict(files, **{path: files[path] + "\n" * (MAX_LINES + 1)})
    assert [p for p, _ in modules_too_long(grown)] == [path]


def test_no_kernel_source_is_longer_than_600_lines():
    """kernels/*.cu and *.cuh too: a kernel file keeps one concern (attention.cu: the FMA kernels,
    attention.cuh what they share with attention_wmma.cuh, rope.cu), so a reader takes it in at once."""
    files = {str(p): p.read_text() for p in KERNELS.iterdir() if p.suffix in (".cu", ".cuh")}
    assert {"attention.cu", "attention.cuh", "attention_wmma.cuh", "rope.cu"} <= {Path(p).name for p in files}
    assert modules_too_long(files) == []
    # mutant: the attention kernels in one file again (865 lines before the split) are named
    together = str(KERNELS / "attention.cu")
    merged = dict(files, **{together: "".join(files[str(KERNELS / name)] for name in
                                              ("attention.cuh", "attention.cu", "attention_wmma.cuh", "rope.cu"))})
    assert [p for p, _ in modules_too_long(merged)] == [together]
