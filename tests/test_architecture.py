"""The layering of the package, read from the source: each import rule docs/DESIGN.md states holds,
at the top of a module or inside a function (boostmpi/parallel/ imports nothing from the layers that
use it, boostmpi/train/, boostmpi/tools/ and boostmpi/sim/; boostmpi/model/ nothing from
boostmpi/parallel/; boostmpi/data/ nothing from boostmpi/model/), and the rules here are the ones
DESIGN.md lists. The mutation tests show that each check fails when its rule is broken."""

import ast
import re
from pathlib import Path

import pytest

import boostmpi

PACKAGE = Path(boostmpi.__file__).parent
KERNELS = PACKAGE.parent / "kernels"
PARALLEL = PACKAGE / "parallel"
ABOVE_PARALLEL = ("boostmpi.train", "boostmpi.tools", "boostmpi.sim")
# docs/DESIGN.md's import rules: the package below boostmpi/ -> the packages it imports nothing from
IMPORT_RULES = {"model": ("parallel",), "data": ("model",), "parallel": ("train", "tools", "sim")}
DESIGN = PACKAGE.parent / "docs" / "DESIGN.md"


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


def upward_imports(files, forbidden=ABOVE_PARALLEL):
    """[(file, imported module)] for each import in `files` ({path: text}) of a module under one of
    `forbidden` (dotted package names; by default the layers above parallel/)."""
    bad = []
    for path, source in files.items():
        module = "boostmpi." + ".".join(Path(path).relative_to(PACKAGE).with_suffix("").parts)
        for name in imported_modules(source, module):
            if any(name == top or name.startswith(top + ".") for top in forbidden):
                bad.append((str(Path(path).relative_to(PACKAGE)), name))
    return sorted(set(bad))


def package_sources(package):
    return {str(p): p.read_text() for p in sorted((PACKAGE / package).rglob("*.py"))}


def broken_rules(package, files):
    """upward_imports of `files` under `package`'s rule (IMPORT_RULES)."""
    return upward_imports(files, tuple(f"boostmpi.{other}" for other in IMPORT_RULES[package]))


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
    inner = real.replace("    def grad_norm(self) -> float:\n",
                         "    def grad_norm(self) -> float:\n        from boostmpi.sim.model import predict  # noqa\n", 1)
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


def design_rules(text):
    """{package: (packages it imports nothing from)} from the rule list of docs/DESIGN.md: lines
    "* `model/` imports nothing from `parallel/`"."""
    rules = {}
    for line in text.splitlines():
        found = re.match(r"^\* `(\w+)/` imports nothing from (.+)$", line.strip())
        if found:
            rules[found.group(1)] = tuple(re.findall(r"`(\w+)/`", found.group(2)))
    return rules


def test_the_checked_rules_are_the_rules_design_md_states():
    assert design_rules(DESIGN.read_text()) == IMPORT_RULES


@pytest.mark.parametrize("package", ["data", "model"])  # parallel/'s: the test at the top
def test_each_package_keeps_its_import_rule(package):
    files = package_sources(package)
    assert len(files) >= 4
    assert broken_rules(package, files) == []


def test_the_model_and_data_checks_find_a_forbidden_import():
    """Mutants: the model's transformer.py importing the tensor-parallel strategies (at the top, and
    inside a function, relative), data/shards.py importing the model's parameters; each is found, and
    the real files pass."""
    transformer = str(PACKAGE / "model" / "transformer.py")
    real = Path(transformer).read_text()
    assert broken_rules("model", {transformer: real}) == []
    top = real.replace("from boostmpi.model import layers\n",
                       "from boostmpi.model import layers\nfrom boostmpi.parallel.tensor_parallel import base\n", 1)
    inner = real.replace("    def recompute(self, h: Array, tape: Tape) -> BlockCache:\n",
                         "    def recompute(self, h: Array, tape: Tape) -> BlockCache:\n"
                         "        from ..parallel import mappings  # noqa\n", 1)
    for mutant, expected in ((top, "boostmpi.parallel.tensor_parallel"), (inner, "boostmpi.parallel")):
        assert mutant != real
        assert ("model/transformer.py", expected) in broken_rules("model", {transformer: mutant}), expected
    shards = str(PACKAGE / "data" / "shards.py")
    real = Path(shards).read_text()
    assert broken_rules("data", {shards: real}) == []
    mutant = real.replace("\nimport numpy as np\n", "\nimport numpy as np\n\nimport boostmpi.model.params\n", 1)
    assert mutant != real
    assert ("data/shards.py", "boostmpi.model.params") in broken_rules("data", {shards: mutant})


def test_the_rule_list_is_read_from_design_md():
    """A rule DESIGN.md adds (or drops) changes what design_rules reads, so the comparison above fails."""
    text = DESIGN.read_text()
    assert design_rules(text + "\n* `gpu/` imports nothing from `train/`\n") != IMPORT_RULES
    assert design_rules(text.replace("* `data/` imports nothing from `model/`\n", "")) != IMPORT_RULES

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
