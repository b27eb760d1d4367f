"""The docs say what the code does: every configuration key and default (docs/FORMATS.md), the files,
attributes and datasets a checkpoint holds (docs/FORMATS.md), the world all-reduces of a training step
(docs/COMMUNICATION.md), the paths of docs/DESIGN.md's "where is X" table, the output of docs/SIM.md's
sweep example, every package in the folder tables of README.md and docs/DESIGN.md; and no doc points
to issue numbers or outside the repository. Each check reads the doc's own table and compares it with what the
code holds or does, so it finds the code by behaviour (its schema, a checkpoint it writes, the calls it
makes), not by file; and each has a mutation test that proves it fails when either side changes."""

import dataclasses
import functools
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from boostmpi import config as config_module
from boostmpi.cli import main
from boostmpi.config import config_from_dict
from boostmpi.data.shards import write_shard
from boostmpi.parallel.comm import HostCollectives
from boostmpi.train.trainer import Trainer
from tests.support.train_helpers import TINY_CONFIG, stop_signals_restored

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


# ------------------------------------------------------------------ reading the docs' tables
def doc_text(name):
    return (DOCS / name).read_text(encoding="utf-8")


def part(text, heading):
    """The text under `heading` (a line of the doc) up to the next heading of the same level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n") + len(heading) + 1
    end = re.search(rf"^{level} ", text[start:], flags=re.M)
    return text[start:start + end.start()] if end else text[start:]


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_rows(text):
    """The body rows of the markdown tables in `text`, each a list of cells (header and rule left out)."""
    rows, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.fullmatch(r"\|[-| :]+\|", line.strip()):
            continue
        if i + 1 < len(lines) and re.fullmatch(r"\|[-| :]+\|", lines[i + 1].strip()):
            continue  # a header
        rows.append(cells(line))
    return rows


def code_names(cell):
    """The `backticked` names of a cell, in order."""
    return re.findall(r"`([^`]+)`", cell)


def tiny_shard(folder):
    """A token shard of a little repeated text, for runs that only count what they do."""
    shard = folder / "tokens.bin"
    write_shard(shard, np.frombuffer(b"the same short sentence, again and again. " * 40, dtype=np.uint8))
    return shard


# ------------------------------------------------------------------ 1. configuration keys and defaults
DERIVED = "derived"


def documented_config(text):
    """section -> key -> default, from the `[section]` tables of FORMATS.md's Configuration; DERIVED for
    a key whose default says "derived". A row may name several keys: one default for all, or one each."""
    documented, section = {}, None
    for line in part(text, "## Configuration").splitlines():
        heading = re.fullmatch(r"`\[(\w+)\]`", line.strip())
        if heading:
            section = heading.group(1)
            documented.setdefault(section, {})
            continue
        if section is None or not line.startswith("|"):
            continue
        for row in table_rows(line + "\n"):
            keys = code_names(row[0])
            if not keys or row[0].strip() == "key":
                continue
            default = row[1].replace("`", "")
            if default.startswith(DERIVED):
                values = [DERIVED] * len(keys)
            else:
                parts = [p.strip() for p in default.split(",")] if len(keys) > 1 and "," in default else [default]
                values = [tomllib.loads(f"v = {p}")["v"] for p in parts]
                values = values * len(keys) if len(values) == 1 else values
            assert len(values) == len(keys), f"[{section}] {row[0]}: {len(keys)} keys, defaults {default!r}"
            for key, value in zip(keys, values):
                assert key not in documented[section], f"[{section}] {key} is documented twice"
                documented[section][key] = value
    return documented


def config_doc_problems(text=None):
    """What differs between boostmpi.config's schema (DEFAULTS: None marks a derived key) and the doc."""
    text = doc_text("FORMATS.md") if text is None else text
    documented = documented_config(text)
    problems = []
    for section, keys in config_module.DEFAULTS.items():
        for key, default in keys.items():
            doc = documented.get(section, {}).get(key, "missing")
            if doc == "missing":
                problems.append(f"{section}.{key} is not in docs/FORMATS.md")
            elif default is None and doc != DERIVED:
                problems.append(f"{section}.{key} is derived, the doc gives {doc!r}")
            elif default is not None and (doc == DERIVED or doc != default
                                          or isinstance(doc, bool) != isinstance(default, bool)):
                problems.append(f"{section}.{key}: default {default!r} in the code, {doc!r} in the doc")
    for section, keys in documented.items():
        for key in keys:
            if key not in config_module.DEFAULTS.get(section, {}):
                problems.append(f"docs/FORMATS.md documents {section}.{key}, which the code does not have")
    return problems


def test_every_config_key_and_default_is_documented_and_every_documented_key_exists():
    assert config_doc_problems() == []


def test_config_doc_check_fails_on_a_mutant(monkeypatch):
    text = doc_text("FORMATS.md")
    assert "| `keep` | 0 |" in text and "| `seed` | 1337 |" in text
    keep_row = next(line for line in text.splitlines() if line.startswith("| `keep` | 0 |"))
    assert config_doc_problems(text.replace(keep_row + "\n", "")) == ["checkpoint.keep is not in docs/FORMATS.md"]
    assert any("keep" in p for p in config_doc_problems(text.replace("| `keep` | 0 |", "| `kept` | 0 |")))
    assert any("seed" in p for p in config_doc_problems(text.replace("| `seed` | 1337 |", "| `seed` | 1338 |")))
    schema = {section: dict(keys) for section, keys in config_module.DEFAULTS.items()}
    schema["train"]["fake_key"] = 3
    monkeypatch.setattr(config_module, "DEFAULTS", schema)
    assert config_doc_problems(text) == ["train.fake_key is not in docs/FORMATS.md"]


def documented_key_tables(text):
    """FORMATS.md's Configuration from the `[model]` table to the end of the `[checkpoint]` table."""
    lines = part(text, "## Configuration").splitlines()
    start, last = lines.index("`[model]`"), lines.index("`[checkpoint]`")
    end = next(i for i in range(last + 2, len(lines) + 1) if i == len(lines) or not lines[i].startswith("|"))
    return "\n".join(lines[start:end]) + "\n"


def test_formats_md_key_tables_are_the_ones_printed_from_the_declarations():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    printed = subprocess.run([sys.executable, "-m", "boostmpi.config"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout
    assert printed == config_module.key_tables()
    assert documented_key_tables(doc_text("FORMATS.md")) == printed, "run python -m boostmpi.config"


def test_key_tables_check_fails_on_a_mutant(monkeypatch):
    text = doc_text("FORMATS.md")
    row = "| `keep` | 0 | 0 = keep every complete checkpoint, N = only the newest N |"
    assert documented_key_tables(text) == config_module.key_tables() and row in text
    assert documented_key_tables(text.replace(row, row.replace("newest", "oldest"))) != config_module.key_tables()
    keep = config_module._FIELDS["checkpoint"]["keep"]
    schema = {section: dict(keys) for section, keys in config_module._FIELDS.items()}
    schema["checkpoint"]["keep"] = dataclasses.field(default=0, metadata={**keep.metadata, "doc": "the oldest N"})
    monkeypatch.setattr(config_module, "_FIELDS", schema)
    assert documented_key_tables(text) != config_module.key_tables()


CONFIG_REFERENCE = re.compile(r"\[(model|parallel|train|data|checkpoint)\] ([a-z_]\w*)"
                              r"|(?<![\w./-])(model|parallel|train|data|checkpoint)\.([a-z_]\w*) ?=")


def config_references(text):
    """(section, key) of every `[section] key` and `section.key = value` in a text."""
    return {(m[1] or m[3], m[2] or m[4]) for m in CONFIG_REFERENCE.finditer(text)}


def doc_files():
    return sorted(DOCS.glob("*.md")) + [REPO / "README.md"] + sorted((REPO / "bench").glob("*.md"))


def test_every_key_the_docs_name_exists():
    unknown = {f"{path.relative_to(REPO)}: {section}.{key}" for path in doc_files()
               for section, key in config_references(path.read_text(encoding="utf-8"))
               if key not in config_module.DEFAULTS[section]}
    assert not unknown, sorted(unknown)
    assert config_references("set `[train] recompute` or `--set parallel.tp=2`; model.h5") == {
        ("train", "recompute"), ("parallel", "tp")}
    assert ("train", "recomputed") in config_references("`[train] recomputed`")  # the mutant would be refused


# ------------------------------------------------------------------ 2. what a checkpoint holds
PLACEHOLDERS = {"<step, 8 digits>": r"\d{8}", "<lin>": "(q|k|v|o|gate|up|down)", "<name>": ".+",
                "<i>": r"\d+", "<j>": r"\d+", "<t>": r"\d+", "<s>": r"\d+", "<d>": r"\d+"}


def name_pattern(documented, params=None):
    """A regex for a documented name: <i>, <j>, <t>, <s>, <d> are numbers, <lin> a linear, <name> a
    parameter name (one of `params`, model.h5's datasets, when given)."""
    placeholders = dict(PLACEHOLDERS)
    if params:
        placeholders["<name>"] = "(" + "|".join(map(re.escape, params)) + ")"
    pieces = re.split(r"(<[^>]+>)", documented)
    for placeholder in pieces[1::2]:
        assert placeholder in placeholders, f"an unknown placeholder {placeholder} in {documented!r}"
    return re.compile("".join(placeholders[p] if i % 2 else re.escape(p) for i, p in enumerate(pieces)))


def documented_checkpoint(text):
    """From FORMATS.md's Checkpoints: the files of a checkpoint folder (from the tree) and, per file, its
    attributes and its datasets or JSON keys (from the table); a name followed by "(archs)" only for
    those archs, `key` (`a`, `b`) a JSON object with those keys, "each with the attribute `x`" the
    attributes of the datasets of that row."""
    section = part(text, "## Checkpoints")
    tree = re.search(r"```\n(.*?)```", section, flags=re.S).group(1).splitlines()
    def path(line):  # the name, up to the gap before its description
        return re.split(r"\s{2,}", line.strip())[0]

    folder = {"inside": [path(line) for line in tree if line.startswith("    ")],
              "outside": [path(line) for line in tree if line.strip() and not line.startswith("    ")]}
    files = {}
    for row in table_rows(section):
        (file_name,) = code_names(row[0])
        content = row[2]
        dataset_attrs = set()
        each = re.search(r",? each with the attributes? (.*)$", content)
        if each:
            dataset_attrs = set(code_names(each.group(1)))
            content = content[:each.start()]
        entries, objects = {}, {}
        # `key` (`a`, `b`): an object's keys; `name` (full): only under those archs
        for m in re.finditer(r"`([^`]+)`(?: \(([^)]*)\))?", content):
            name, after = m.group(1), m.group(2)
            if after and "`" in after:
                objects[name] = set(code_names(after))
                entries[name] = None
            else:
                entries[name] = set(re.findall(r"full|svd|cola", after)) if after else None
        files[file_name] = {"attrs": set(code_names(row[1])), "entries": entries, "objects": objects,
                            "dataset_attrs": dataset_attrs, "each other file": "every other file" in content}
    return folder, files


def datasets_of(path):
    """name -> set of attribute names, for every dataset of an HDF5 file."""
    found = {}

    def note(name, obj):  # returns None: visititems stops at the first other value
        if isinstance(obj, h5py.Dataset):
            found[name] = set(obj.attrs)

    with h5py.File(path, "r") as f:
        f.visititems(note)
        return found, set(f.attrs)


def checkpoint_doc_problems(folder_path, arch, text=None):
    """What differs between the checkpoint folder written at `folder_path` (by arch `arch`) and FORMATS.md."""
    text = doc_text("FORMATS.md") if text is None else text
    folder, files = documented_checkpoint(text)
    problems = []
    run_dir = folder_path.parent.parent
    for documented in folder["outside"]:  # <run_dir>/checkpoints/step_<step, 8 digits>/ and .../latest
        inside_run_dir = documented.removeprefix("<run_dir>/")
        if documented.endswith("/"):
            if not name_pattern(inside_run_dir.rstrip("/")).fullmatch(str(folder_path.relative_to(run_dir))):
                problems.append(f"{folder_path.relative_to(run_dir)} is not named as {documented}")
        elif (run_dir / inside_run_dir).read_text().strip() != folder_path.name:
            problems.append(f"{documented} does not name the newest checkpoint")
    present = sorted(p.name for p in folder_path.iterdir())
    patterns = {documented: name_pattern(documented) for documented in folder["inside"]}
    for name in present:
        if not any(p.fullmatch(name) for p in patterns.values()):
            problems.append(f"{name} is in the checkpoint, not in the doc's tree")
    for documented, p in patterns.items():
        if not any(p.fullmatch(name) for name in present):
            problems.append(f"{documented} is in the doc's tree, not in the checkpoint")
    for documented, spec in files.items():
        matching = [name for name in present if name_pattern(documented).fullmatch(name)]
        if not matching:
            problems.append(f"the doc's table describes {documented}, which the checkpoint does not have")
        wanted = {n for n, archs in spec["entries"].items() if archs is None or arch in archs}
        for name in matching:
            check = h5_problems if name.endswith(".h5") else json_problems
            problems += [f"{name}: {p}" for p in check(folder_path / name, spec, wanted, arch, present)]
    return problems


def h5_problems(path, spec, wanted, arch, present):
    """An HDF5 file against its row: attributes, every dataset documented (a <name> being one of model.h5's
    datasets) with its attributes, and every documented name there (a <name> pattern for each parameter)."""
    datasets, attrs = datasets_of(path)
    params = sorted(datasets_of(path.parent / "model.h5")[0])
    problems = [] if attrs == spec["attrs"] else [f"attributes {sorted(attrs)}, documented {sorted(spec['attrs'])}"]
    for dataset, dataset_attrs in datasets.items():
        if not any(name_pattern(n, params).fullmatch(dataset) for n in wanted):
            problems.append(f"dataset {dataset} is not documented")
        elif dataset_attrs != spec["dataset_attrs"]:
            problems.append(f"{dataset} has attributes {sorted(dataset_attrs)}, "
                            f"documented {sorted(spec['dataset_attrs'])}")
    for n in sorted(wanted):
        for instance in ([n.replace("<name>", p) for p in params] if "<name>" in n else [n]):
            if not any(name_pattern(instance).fullmatch(dataset) for dataset in datasets):
                problems.append(f"documented {instance} (arch {arch}) is not there")
    return problems


def json_problems(path, spec, wanted, arch, present):
    content = json.loads(path.read_text())
    if spec["each other file"]:  # COMPLETE: a record per file
        others = set(present) - {path.name}
        problems = [] if set(content) == others else [f"records {sorted(content)}, not every other file"]
        return problems + [f"a record has {sorted(record)}, documented {sorted(wanted)}"
                           for record in content.values() if set(record) != wanted]
    problems = [] if set(content) == wanted else [f"keys {sorted(content)}, documented {sorted(wanted)}"]
    return problems + [f"{key} has {sorted(content.get(key, {}))}, documented {sorted(keys)}"
                       for key, keys in spec["objects"].items() if set(content.get(key, {})) != keys]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> the folder of a one-step checkpoint of the tiny model (one layer): cola written
    synchronously, full asynchronously."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    shard = tiny_shard(tmp)
    folders = {}
    for arch, asynchronous in (("cola", "false"), ("full", "true")):
        run_dir = tmp / arch
        argv = ["train", "--config", str(TINY_CONFIG)]
        for setting in (f"train.run_dir={run_dir}", f"data.train={shard}", f"data.val={shard}", "train.steps=1",
                        "train.val_windows=2", "model.n_layers=1", f"model.arch={arch}",
                        f"checkpoint.async={asynchronous}"):
            argv += ["--set", setting]
        with stop_signals_restored():
            assert main(argv) == 0
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        folders[arch] = run_dir / "checkpoints" / latest
    return folders


@pytest.mark.parametrize("arch", ["cola", "full"])
def test_a_checkpoint_holds_what_formats_md_documents(arch, checkpoints):
    folder = checkpoints[arch]
    assert folder.name == "step_00000001"
    assert checkpoint_doc_problems(folder, arch) == []


def test_checkpoint_doc_check_fails_on_a_mutant(checkpoints, tmp_path):
    text, folder = doc_text("FORMATS.md"), checkpoints["cola"]
    assert checkpoint_doc_problems(folder, "cola", text) == []
    # the doc loses an attribute, a state.json key, a file; a documented name is misspelt
    for old, new in (("`format`, `format_version`, `step`, `config`", "`format`, `format_version`, `step`"),
                     ("`tp_mode`, `zero_stage`)", "`tp_mode`)"),
                     ("    state.json ", "    status.json "),
                     ("`m/<name>`, `v/<name>`", "`m/<name>`, `w/<name>`")):
        assert old in text
        assert checkpoint_doc_problems(folder, "cola", text.replace(old, new)), old
    # the writer writes one more file, one more attribute
    shutil.copytree(folder.parent, tmp_path / "checkpoints")
    mutant = tmp_path / "checkpoints" / folder.name
    (mutant / "extra.json").write_text("{}")
    assert checkpoint_doc_problems(mutant, "cola", text) == [
        "extra.json is in the checkpoint, not in the doc's tree",
        "COMPLETE: records ['model.h5', 'optim.h5', 'rank-tp0-pp0-dp0.h5', 'state.json'], not every other file"]
    (mutant / "extra.json").unlink()
    with h5py.File(mutant / "optim.h5", "a") as f:
        f.attrs["zero_stage"] = 0
    assert checkpoint_doc_problems(mutant, "cola", text) == [
        "optim.h5: attributes ['format', 'step', 't', 'zero_stage'], documented ['format', 'step', 't']"]
    (mutant.parent / "latest").write_text("step_00000002\n")
    assert checkpoint_doc_problems(mutant, "cola", text)[0] == (
        "<run_dir>/checkpoints/latest does not name the newest checkpoint")
    with h5py.File(mutant / "optim.h5", "a") as f:
        del f.attrs["zero_stage"]
        del f["v/final_norm"]
    assert checkpoint_doc_problems(mutant, "cola", text)[1:] == ["optim.h5: documented v/final_norm (arch cola) is not there"]
    renamed = mutant.rename(mutant.parent / "step_1")
    assert checkpoint_doc_problems(renamed, "cola", text)[0] == (
        "checkpoints/step_1 is not named as <run_dir>/checkpoints/step_<step, 8 digits>/")


# ------------------------------------------------------------------ 3. world all-reduces per step
class CountingComm:
    """A world communicator of one rank that notes, for each all-reduce, the step the trainer is in
    (a step runs from the start of its forward_backward to the start of the next one's)."""

    def __init__(self):
        self.step = 0
        self.per_step = {}

    def Allreduce(self, sendbuf, recvbuf, op):
        assert sendbuf is MPI.IN_PLACE
        self.per_step[self.step] = self.per_step.get(self.step, 0) + 1

    def bcast(self, obj, root=0):
        return obj

    def Barrier(self):
        pass


# the rows of COMMUNICATION.md's table: when each applies to step k (1-based) of a run of `cfg`
def _logged(k, cfg):
    return k == 1 or k % cfg.train.log_every == 0 or k == cfg.train.steps


def _validating(k, cfg):
    return bool(cfg.train.val_every and k % cfg.train.val_every == 0) or k == cfg.train.steps


def _saving(k, cfg):
    return bool(cfg.checkpoint.every and k % cfg.checkpoint.every == 0) or k == cfg.train.steps


def _validation_batches(cfg):
    per_batch = cfg.train.micro_batch_size * cfg.parallel.dp
    return -(-cfg.train.val_windows // per_batch)


STEP_ROWS = {
    "every step": lambda k, cfg: 1,
    "a logged step": lambda k, cfg: int(_logged(k, cfg)),
    "a validation step": lambda k, cfg: int(_validating(k, cfg)),
    "a validation or checkpoint step": lambda k, cfg: int(_validating(k, cfg) or _saving(k, cfg)),
    # a save started at step k is in flight at its boundary (the runs below save at the last step only,
    # which waits for its writers, so exactly there)
    "an asynchronous save in flight": lambda k, cfg: int(cfg.checkpoint.async_ and _saving(k, cfg)),
}


def documented_world_allreduces(cfg, text=None):
    """step -> world all-reduces, as COMMUNICATION.md's table adds them up for a run of `cfg`."""
    text = doc_text("COMMUNICATION.md") if text is None else text
    rows = table_rows(part(text, "## Host bookkeeping: world all-reduces per step"))
    expected = {k: 0 for k in range(1, cfg.train.steps + 1)}
    for when, count, _ in rows:
        assert when in STEP_ROWS, f"COMMUNICATION.md: a row this test does not know: {when!r}"
        m = re.fullmatch(r"(\d+)( per validation batch)?", count)
        assert m, f"COMMUNICATION.md: cannot read the count {count!r}"
        per = int(m[1]) * (_validation_batches(cfg) if m[2] else 1)
        for k in expected:
            expected[k] += per * STEP_ROWS[when](k, cfg)
    return expected


def counted_world_allreduces(tmp_path, asynchronous, trainer_hook=None):
    tmp_path.mkdir(exist_ok=True)
    shard = tiny_shard(tmp_path)
    cfg = config_from_dict({
        "model": {"arch": "cola", "vocab_size": 256, "d_model": 16, "n_layers": 1, "n_heads": 2,
                  "n_kv_heads": 2, "rank": 4, "d_ff": 32, "seq_len": 8},
        "train": {"run_dir": str(tmp_path / "run"), "steps": 5, "micro_batch_size": 2, "log_every": 2,
                  "val_every": 3, "val_windows": 4},
        "data": {"train": str(shard), "val": str(shard)},
        "checkpoint": {"every": 0 if asynchronous else 4, "async": asynchronous}})
    assert _validation_batches(cfg) == 2
    with stop_signals_restored():
        trainer = Trainer(cfg, out=io.StringIO())
        comm = CountingComm()
        trainer.engine.grid.host = HostCollectives(comm)
        forward_backward = trainer.engine.forward_backward

        def step_marked(*args, **kwargs):
            comm.step += 1
            return forward_backward(*args, **kwargs)

        trainer.engine.forward_backward = step_marked
        if trainer_hook:
            trainer_hook(trainer)
        trainer.train()
    return cfg, {k: comm.per_step.get(k, 0) for k in range(1, cfg.train.steps + 1)}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_world_allreduces_per_step_are_the_documented_ones(asynchronous, tmp_path):
    cfg, counted = counted_world_allreduces(tmp_path, asynchronous)
    assert counted == documented_world_allreduces(cfg)
    assert counted[2] == 2  # an ordinary step that logs: two, not one


def test_world_allreduce_check_fails_on_a_mutant(tmp_path):
    text = doc_text("COMMUNICATION.md")
    row = "| a logged step | 1 |"
    assert row in text
    cfg, counted = counted_world_allreduces(tmp_path / "a", False)
    assert counted == documented_world_allreduces(cfg, text)
    assert counted != documented_world_allreduces(cfg, text.replace(row, "| a logged step | 0 |"))

    def one_more_sum_per_validation(trainer):  # the code makes an extra all-reduce when it validates
        validate = trainer.validate

        def validate_and_sum():
            trainer.engine.grid.host.sum([0.0])
            return validate()
        trainer.validate = validate_and_sum

    cfg, counted = counted_world_allreduces(tmp_path / "b", False, one_more_sum_per_validation)
    assert counted != documented_world_allreduces(cfg, text)


# ------------------------------------------------------------------ 3b. tensor-parallel calls per step
def layout_overrides(layout):
    """`--set` overrides of a layout cell of COMMUNICATION.md's calls table, e.g. "`btp`, sync norm, grouped"."""
    (mode,) = code_names(layout)
    arch = "full" if "full rank" in layout else "cola"
    norm = "sync" if "sync norm" in layout else "online"
    return [f"parallel.tp_mode={mode}", f"model.arch={arch}", f"parallel.norm={norm}",
            f"parallel.grouped={'false' if 'ungrouped' in layout else 'true'}"]


def documented_tp_calls(text=None):
    """[(overrides of the layout, forward, backward, embedding and head)] of COMMUNICATION.md's calls table."""
    text = doc_text("COMMUNICATION.md") if text is None else text
    rows = table_rows(part(text, "## Calls per step"))
    assert len(rows) >= 8
    return [(layout_overrides(layout), int(fwd), int(bwd), int(ends)) for layout, fwd, bwd, ends in rows]


def tp_calls_per_step(cfg, forward, backward, ends):
    """The per-step total COMMUNICATION.md gives: dp · M · (L · (f · forward + backward) + ends)."""
    f = 2 if cfg.train.recompute == "layer" else 1
    return cfg.parallel.dp * cfg.train.grad_accum * (cfg.model.n_layers * (f * forward + backward) + ends)


def tp2_config(overrides, *more):
    from boostmpi.config import load_config
    return load_config(TINY_CONFIG, overrides=["parallel.tp=2", "train.dtype=float64", *overrides, *more])


def test_documented_tp_calls_are_the_performance_models():
    """The model's tp_calls equal the engine's counters for every layout (tests/integration/test_sim_vs_engine.py, under
    MPI); here the table against it, for layer counts, micro-batches, dp and recompute modes."""
    from boostmpi.sim.model import tp_calls

    for overrides, fwd, bwd, ends in documented_tp_calls():
        for more in ([], ["model.n_layers=4", "train.grad_accum=3"], ["parallel.dp=2", "train.recompute=layer"],
                     ["train.recompute=selective"]):
            cfg = tp2_config(overrides, *more)
            assert tp_calls(cfg) == tp_calls_per_step(cfg, fwd, bwd, ends), (overrides, more)


def test_tp_calls_check_fails_on_a_mutant():
    text = doc_text("COMMUNICATION.md")
    row = "| `btp`, sync norm, grouped | 6 | 4 | 4 |"
    assert row in text
    mutant = documented_tp_calls(text.replace(row, "| `btp`, sync norm, grouped | 4 | 4 | 4 |"))
    from boostmpi.sim.model import tp_calls

    cfg = tp2_config(mutant[2][0])
    assert tp_calls(cfg) != tp_calls_per_step(cfg, *mutant[2][1:])


@pytest.mark.mpi(min_size=2)
def test_documented_tp_calls_are_what_the_engine_counts():
    from boostmpi.parallel.engine import Engine
    from tests.support.mpi_helpers import abort_on_error, assert_all_ranks, world
    from tests.integration.test_parallel import free_communicators
    from tests.integration.test_sim_vs_engine import counted, random_micro_batches

    comm = world()
    if comm.Get_size() != 2:
        pytest.skip("tp = 2 on two ranks")
    for overrides, fwd, bwd, ends in documented_tp_calls():
        for recompute in ("none", "layer"):
            cfg = tp2_config(overrides, f"train.recompute={recompute}", "train.grad_accum=2")
            with abort_on_error():
                engine = Engine(cfg, comm)
                _, calls = counted(engine, random_micro_batches(cfg), comm)  # summed: each group's calls once
            expected = tp_calls_per_step(cfg, fwd, bwd, ends)
            assert_all_ranks(calls == expected, f"{overrides} recompute={recompute}: the engine made {calls} tp calls, "
                             f"docs/COMMUNICATION.md says {expected}")
            free_communicators(engine)


# ------------------------------------------------------------------ 5. DESIGN.md's "where is X" table
PATH = re.compile(r"(?<![\w.])(?:[\w.-]+/)+[\w.-]*")


def where_paths(text=None):
    """Every path in the "where" column of DESIGN.md's Where is X table."""
    text = doc_text("DESIGN.md") if text is None else text
    rows = table_rows(part(text, "## Where is X"))
    assert len(rows) >= 10
    return [p for _, where in rows for p in PATH.findall(where)]


def missing_paths(paths):
    return [p for p in paths if not (REPO / p).exists()]


def test_every_path_of_the_where_table_exists():
    paths = where_paths()
    assert "boostmpi/model/layers.py" in paths and "docs/FORMATS.md" in paths and "kernels/" in paths
    assert missing_paths(paths) == []


def test_where_table_check_fails_on_a_mutant():
    text = doc_text("DESIGN.md")
    assert "`boostmpi/model/layers.py`" in text
    mutant = text.replace("`boostmpi/model/layers.py`", "`boostmpi/model/layer.py`")
    assert missing_paths(where_paths(mutant)) == ["boostmpi/model/layer.py"]


def packages():
    """boostmpi and every package in it, as folders (`boostmpi/`, `boostmpi/model/`, ...)."""
    return {f"{init.parent.relative_to(REPO).as_posix()}/" for init in (REPO / "boostmpi").glob("*/__init__.py")} | {
        "boostmpi/"}


def unlisted_packages(text, heading):
    """The packages that no row of the folder table (the first table under `heading`) names."""
    table = next(block for block in part(text, heading).split("\n\n") if block.lstrip().startswith("|"))
    listed = {name for first, *_ in table_rows(table) for name in code_names(first)}
    return sorted(packages() - listed)


@pytest.mark.parametrize("doc, heading", [("README.md", "## Layout"), ("docs/DESIGN.md", "# boostmpi design")])
def test_every_package_is_in_the_folder_tables(doc, heading):
    assert {"boostmpi/checkpoint/", "boostmpi/train/"} <= packages()
    assert unlisted_packages((REPO / doc).read_text(encoding="utf-8"), heading) == []


def test_folder_table_check_fails_on_a_mutant():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `boostmpi/checkpoint/` |"))
    assert unlisted_packages(text.replace(row + "\n", ""), "## Layout") == ["boostmpi/checkpoint/"]


REPO_PATH = re.compile(r"(?<![\w./-])((?:boostmpi|tests|bench|docs|jobs|kernels|configs)/[\w./-]*[\w/])(?![\w<*])")
OTHER_PROJECTS = {"docs/performance.md"}  # torchtitan's, cited in docs/SIM_VALIDATION.md


def named_paths(text):
    """The repository paths a text names (a path ending in a <placeholder> or a glob is not one)."""
    return {p for p in REPO_PATH.findall(text) if p not in OTHER_PROJECTS}


def test_every_path_a_doc_names_exists():
    missing = {f"{path.relative_to(REPO)}: {p}" for path in doc_files()
               for p in named_paths(path.read_text(encoding="utf-8")) if not (REPO / p).exists()}
    assert not missing, sorted(missing)
    assert named_paths("see boostmpi/train/trainer.py, `jobs/setup_<site>.sh`, kernels/*.cu") == {
        "boostmpi/train/trainer.py"}
    assert missing_paths(named_paths("moved to boostmpi/train/trainers.py.")) == ["boostmpi/train/trainers.py"]


# ------------------------------------------------------------------ 6. SIM.md's sweep example
def sweep_example(text=None):
    """The `boostmpi sim` command of docs/SIM.md's sweep example (its arguments) and the lines the doc says
    it ends with (the fenced block after it)."""
    text = doc_text("SIM.md") if text is None else text
    blocks = re.findall(r"^```\n(.*?)^```", text, re.S | re.M)
    command = next(i for i, b in enumerate(blocks) if b.startswith("boostmpi sim --config configs/"))
    return shlex.split(blocks[command].replace("\\\n", " "))[1:], blocks[command + 1].splitlines()


def sweep_mismatch(text, capsys):
    """The doc's lines against the last lines the command prints, or None when they are the same."""
    argv, shown = sweep_example(text)
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()[-len(shown):]
    return None if printed == shown else (printed, shown)


def test_the_sweep_example_prints_what_sim_md_shows(capsys):
    argv, shown = sweep_example()
    assert "--sweep" in argv and shown[0].startswith("fastest: ")
    assert sweep_mismatch(None, capsys) is None


def test_sweep_example_check_fails_on_a_mutant(capsys):
    text = doc_text("SIM.md")
    line = next(line for line in sweep_example(text)[1] if line.startswith("fastest: "))
    seconds = re.search(r": (\d\.\d+) s ", line).group(1)
    mutant = text.replace(line, line.replace(f": {seconds} s ", f": {float(seconds) * 1.03:.4f} s "))
    assert sweep_mismatch(mutant, capsys) is not None


# ------------------------------------------------------------------ 4. no issue numbers, nothing outside
# What counts as a citation of the tracker or a pointer out of the repository: the word for a
# tracker entry with a number (also "#" and a number alone); a relative path that climbs above the
# repository's root from the file it is in; a document name in capitals (NAME.md) that no file of
# the repository has, which can only be a document kept elsewhere. The tracker's word is assembled
# from parts so that this file cites nothing.
_ENTRY = "iss" + "ue"
ISSUE_CITATION = re.compile(rf"\b{_ENTRY}\s*#?\s*\d+|\b{_ENTRY}s\s*#\d+|\b{_ENTRY}s\s+\d+(?:\s*(?:,|and)\s*#?\d+)+"
                            r"|(?<![\w&/])#\d+\b", re.I)
CLIMB = re.compile(r"(?<![\w.])((?:\.\./)+)")
CAPITAL_DOC = re.compile(r"\b[A-Z][A-Z0-9_]+\.md\b")


@functools.lru_cache(maxsize=None)
def repository_names():
    """The names of the repository's files (hidden folders, virtual environments and caches aside)."""
    names = set()
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [d for d in subfolders if not d.startswith((".", "__")) and d != "build"]
        names.update(files)
    return frozenset(names)


def citations(text, markdown, depth=1):
    """Issue numbers and pointers outside the repository in a text of a file `depth` folders below the
    repository's root; a markdown file's fenced blocks (program output, where a hash and a number
    name a rank) are read for issue words and paths only."""
    found = []
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if markdown and line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        for m in ISSUE_CITATION.finditer(line):
            if in_fence and m.group().startswith("#"):
                continue
            found.append(f"{number}: {m.group()}")
        found += [f"{number}: {m.group()}" for m in CLIMB.finditer(line) if m.group(1).count("../") > depth]
        found += [f"{number}: {m.group()}" for m in CAPITAL_DOC.finditer(line) if m.group() not in repository_names()]
    return found


def cited_files():
    bench = REPO / "bench"
    return doc_files() + sorted((bench / "log").glob("*.md")) + sorted(bench.glob("*.py"))


def test_no_doc_or_bench_file_cites_an_issue_or_points_outside_the_repository():
    hits = {str(path.relative_to(REPO)): found for path in cited_files()
            if (found := citations(path.read_text(encoding="utf-8"), path.suffix == ".md",
                                   depth=len(path.relative_to(REPO).parts) - 1))}
    assert not hits, hits


# mutants: a tracker entry cited by word, by "#", two at once, a path above the root, a document kept elsewhere
@pytest.mark.parametrize("text", [f"as {_ENTRY} 24 asks", f"({_ENTRY} " + "#" + "3)", "fixed in #" + "24.",
                                  "see ../../notes/plan.md", f"{_ENTRY.title()}s 7 and 8", "as PLANNING.md says"])
def test_citation_check_fails_on_a_mutant(text):
    assert citations(f"Some prose.\n{text}\n", markdown=True)


def test_citation_check_passes_what_is_not_a_citation():
    h = "#"  # a hash before a number that is no tracker entry: an HTML entity, a path, a rank in program output
    assert citations(f"step 24, a 2-issue queue, `&{h}24;`, x/{h}3, the engine issues 2 calls, ../README.md, "
                     f"DESIGN.md\n```\nmargin over {h}2\n```\n", markdown=True) == []
