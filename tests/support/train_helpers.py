"""Shared by the end-to-end tests of `boostmpi train` (test_train, test_checkpoint, test_bad_input,
test_resume_layouts): real-text token shards, the train command line, metrics, file digests and
the check that a refusal is one clear line with nothing on disk changed.

The text is the Python standard library that ships with the interpreter, byte-tokenized (the
built-in corpus, but only as much of it as a test needs, written straight to two shards, so that
no test prepares the 8 MB corpus). Every `*.py` file is preceded by the end-of-text id; the token
stream is cut into blocks of `BLOCK_TOKENS` and every `VAL_EVERY`-th block goes to the validation
shard, so that both shards hold the same kind of text whatever the size.
"""

import hashlib
import json
import os
import signal
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from boostmpi.cli import main
from boostmpi.data.corpus import builtin_files
from boostmpi.data.shards import write_shard
from boostmpi.data.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "tiny.toml"
VAL_EVERY = 10
BLOCK_TOKENS = 2048
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what the trainer takes over to checkpoint before stopping


def write_text_shards(folder, max_bytes):
    """Write `train.bin` and `val.bin` of about `max_bytes` of stdlib text into `folder`; their paths."""
    tokenizer = ByteTokenizer()
    eot = np.array([tokenizer.eot], dtype=np.uint16)
    pieces = []
    for path in builtin_files(max_bytes):
        pieces += [eot, tokenizer.encode_array(Path(path).read_text(encoding="utf-8"))]
    stream = np.concatenate(pieces)
    blocks = [stream[start:start + BLOCK_TOKENS] for start in range(0, len(stream), BLOCK_TOKENS)]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, val = folder / "train.bin", folder / "val.bin"
    write_shard(train, np.concatenate([b for i, b in enumerate(blocks) if i % VAL_EVERY != VAL_EVERY - 1]))
    write_shard(val, np.concatenate(blocks[VAL_EVERY - 1::VAL_EVERY]))
    return train, val


def train_settings(run_dir, train_shard, val_shard, *overrides):
    """`section.key=value` settings of a run: its directory, its shards, then `overrides`."""
    return [f"train.run_dir={run_dir}", f"data.train={train_shard}", f"data.val={val_shard}", *overrides]


def train_argv(run_dir, train_shard, val_shard, *overrides, config=TINY_CONFIG, resume=None):
    """The `boostmpi train` command line for the tiny config on the given shards, plus `section.key=value` overrides."""
    argv = ["train", "--config", str(config)]
    for setting in train_settings(run_dir, train_shard, val_shard, *overrides):
        argv += ["--set", setting]
    if resume is not None:
        argv += ["--resume", str(resume)]
    return argv


def run_train(*args, **kwargs):
    """`boostmpi train` in this process (arguments as for `train_argv`); its exit status."""
    return main(train_argv(*args, **kwargs))


@contextmanager
def stop_signals_restored():
    """Around a Trainer made in the test's own process: give the stop signals' handlers back after it,
    or `timeout` could no longer end the test run (the train command does this itself)."""
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def read_metrics(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def file_digests(folder):
    """{path relative to `folder`: SHA-256 of its bytes} of every file below it (an empty dict if there is no folder)."""
    folder = Path(folder)
    digests = {}
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = Path(dirpath) / name
            digests[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def assert_refused(capfd, argv, untouched, *fragments):
    """`boostmpi <argv>` exits 2 with exactly one line on stderr, `error: ...` naming every fragment,
    and changes no file below `untouched` (none added, none removed, none altered). Returns the line.

    `capfd` (pytest's fixture) rather than capsys: it also sees what is written to the file
    descriptor itself, and `train` hands stderr's descriptor to faulthandler."""
    capfd.readouterr()  # drop whatever earlier steps of the test printed
    before = file_digests(untouched)
    status = main(argv)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, f"exit status {status}, stderr: {err!r}"
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err!r}"
    line = lines[0]
    assert line.startswith("error: "), line
    for fragment in fragments:
        assert str(fragment) in line, f"{fragment!r} not in {line!r}"
    assert file_digests(untouched) == before, f"files below {untouched} changed"
    return line


def h5_datasets(path):
    """{dataset path: array} of every dataset in an HDF5 file, read with plain h5py."""
    import h5py

    tensors = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: tensors.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return tensors


# the metrics that a rerun reproduces exactly (the rest are timings and memory)
REPRODUCIBLE_METRICS = ("step", "loss", "lr", "grad_norm", "val_loss", "comm_bytes")


def reproducible(rows):
    return [{k: r.get(k) for k in REPRODUCIBLE_METRICS} for r in rows]


def run_on_a_private_tmpfs(mount_dir, options, command, timeout=150, env=None):
    """Run shell `command` (cwd REPO) in a mount namespace of its own where `mount_dir` is a fresh
    tmpfs mounted with `options` (e.g. "size=700k" for a small disk, "ro" for a read-only one):
    real full disks and read-only filesystems without touching the machine's. Skips the test
    when this machine does not allow it (not root, no unshare); fails instead under CI=true."""
    import shutil
    import subprocess

    import pytest

    # CI runs as root: there a missing unshare or mount is a failure, never a skip
    give_up = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if shutil.which("unshare") is None:
        give_up("no unshare(1) to make a private tmpfs")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k none {mount_dir}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        give_up(f"cannot mount a private tmpfs here: {probe.stderr.strip()}")
    script = f"mount -t tmpfs -o {options} none {mount_dir} && {command}"
    return subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)
