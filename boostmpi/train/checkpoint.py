"""Checkpoints (CONTRACT §3): layout-free HDF5 files, written atomically, verified on load.

  <run_dir>/checkpoints/step_00000010/
      model.h5     global parameter tensors (plain h5py reads them on one process)
      optim.h5     AdamW moments `m/<name>`, `v/<name>` as global tensors, attribute `t`
      state.json   step, data position, RNG seed, layout that wrote it
      COMPLETE     written last: sizes and SHA-256 of the three files above
  <run_dir>/checkpoints/latest   the name of the newest complete checkpoint
  <run_dir>/checkpoints/abandoned-<time>/   checkpoints of a timeline a run did not continue

Writing: every rank sends its shards to world rank 0 (buffer-based MPI), which checks the free
space, writes into a hidden temporary folder, fsyncs, writes COMPLETE, renames the folder into
place and then replaces `latest` atomically. A crash at any point leaves the previous checkpoint
and `latest` untouched; a folder without COMPLETE is never loaded; a write that fails (a full
disk) removes its temporary folder; a killed writer's one is removed when the next run starts.
A checkpoint folder always holds the state of the run that wrote it: one of another timeline is
moved aside, never reused. Nothing is pickled or executed on load.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import time

import numpy as np

from boostmpi.errors import CheckpointError
from boostmpi.files import FilesystemError, atomic_file, check_space, fs_error, fsync_dir, make_dirs, write_file_atomically

FORMAT = "boostmpi"
FORMAT_VERSION = 1
MARKER = "COMPLETE"
FILES = ("model.h5", "optim.h5", "state.json")


def step_dir_name(step):
    return f"step_{step:08d}"


def checkpoints_dir(run_dir):
    return os.path.join(run_dir, "checkpoints")


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_h5(path, tensors, attrs):
    import h5py

    with h5py.File(path, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        for name, arr in tensors.items():
            f.create_dataset(name, data=arr)


# HDF5 metadata beside the raw tensor bytes: object headers, group links, attributes (measured on
# the tiny config: about 1 KiB per dataset). The allowance is generous so that the check before
# writing never lets HDF5 run into a full disk: the library does not survive that cleanly (it
# can crash while closing the file).
H5_BYTES_PER_DATASET = 4 << 10
H5_BYTES_PER_FILE = 64 << 10


def h5_size_estimate(tensors, attrs_bytes=0):
    """An upper estimate of the bytes of an HDF5 file holding `tensors`."""
    return (sum(int(np.asarray(t).nbytes) for t in tensors.values()) + H5_BYTES_PER_DATASET * len(tensors)
            + H5_BYTES_PER_FILE + attrs_bytes)


def _os_error_of(exc):
    """The OSError behind a failed write, also when h5py reports it as a RuntimeError naming the errno."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, RuntimeError):
        match = re.search(r"errno = (\d+)", str(exc))
        if match:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
    return None


def save(run_dir, step, cfg, model_tensors, moments, adam_t, state, keep=0, crash_hook=None, log=None):
    """Write checkpoint `step` (world rank 0 only); returns its folder. `crash_hook(stage)` lets tests
    simulate a crash; `log(line)` receives what the save did besides writing (a folder moved aside).

    A complete folder of the same step is never reused: it belongs to another timeline (a run that
    went on from an older checkpoint) and is moved aside, not deleted. Before writing, the free
    space (and the file-size limit) is checked against what the checkpoint needs; a write that fails
    anyway removes the temporary folder and raises a FilesystemError. Either way the previous
    checkpoint and `latest` are untouched.
    """
    root = checkpoints_dir(run_dir)
    make_dirs(root, "checkpoint folder")
    name = step_dir_name(step)
    final = os.path.join(root, name)
    config_json = json.dumps(cfg.to_dict(), sort_keys=True)
    opt = {f"m/{k}": v for k, v in moments[0].items()}
    opt.update({f"v/{k}": v for k, v in moments[1].items()})
    sizes = [h5_size_estimate(model_tensors, len(config_json)), h5_size_estimate(opt), 64 << 10]
    needed = sum(sizes)
    kept = "the previous checkpoint and `latest` are unchanged"
    try:
        check_space(root, needed, f"cannot write checkpoint {name} into", largest_file=max(sizes))
    except FilesystemError as exc:
        raise FilesystemError(f"{exc}; nothing was written, {kept}") from None
    tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        write_h5(os.path.join(tmp, "model.h5"), model_tensors,
                 {"format": FORMAT, "format_version": FORMAT_VERSION, "step": int(step), "config": config_json})
        if crash_hook:
            crash_hook("model.h5")
        write_h5(os.path.join(tmp, "optim.h5"), opt, {"format": FORMAT, "step": int(step), "t": int(adam_t)})
        with atomic_file(os.path.join(tmp, "state.json")) as f:
            json.dump(dict(state, step=int(step)), f, indent=1, sort_keys=True)
        marker = {}
        for file_name in FILES:
            path = os.path.join(tmp, file_name)
            _fsync_file(path)
            marker[file_name] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
        if crash_hook:
            crash_hook("marker")
        with atomic_file(os.path.join(tmp, MARKER)) as f:
            json.dump(marker, f, indent=1)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        os_exc = _os_error_of(exc)
        if os_exc is None:
            raise
        error = fs_error(os_exc, f"cannot write checkpoint {name} into", root, needed=needed)
        raise FilesystemError(f"{error}; the partial checkpoint is removed, {kept}") from exc
    if is_complete(final):  # another timeline's checkpoint of this step: moved aside, never reused
        moved = move_aside(run_dir, [final], f"replaced by a new checkpoint of step {step}")
        if log:
            log(f"moved the earlier checkpoint {name} of another timeline to {moved}")
    elif os.path.exists(final):  # an incomplete leftover of an earlier crash: never loaded, safe to replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(root)
    write_latest(run_dir, name)
    if keep > 0:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def write_latest(run_dir, name):
    """Point `<run_dir>/checkpoints/latest` at checkpoint folder `name`, atomically."""
    write_file_atomically(os.path.join(checkpoints_dir(run_dir), "latest"), name + "\n")


ABANDONED_PREFIX = "abandoned-"


def move_aside(run_dir, folders, reason, extra_files=None):
    """Move checkpoint `folders` of an abandoned timeline into a new `checkpoints/abandoned-<time>/`
    (never loaded, never deleted) with a README line saying why; returns that folder.
    `extra_files` ({name: text}) are written beside them (the abandoned metrics rows)."""
    root = checkpoints_dir(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = os.path.join(root, ABANDONED_PREFIX + stamp)
    suffix = 1
    while os.path.exists(dest):
        suffix += 1
        dest = os.path.join(root, f"{ABANDONED_PREFIX}{stamp}-{suffix}")
    os.makedirs(dest)
    for folder in folders:
        os.rename(folder, os.path.join(dest, os.path.basename(folder)))
    for file_name, text in (extra_files or {}).items():
        write_file_atomically(os.path.join(dest, file_name), text)
    write_file_atomically(os.path.join(dest, "README"), f"{reason}\n")
    fsync_dir(root)
    return dest


def is_stale_temporary(name):
    """A temporary name a writer leaves behind when it is killed: `.step_N.tmp-PID`, `.latest.tmp-...`,
    or an atomic file's `.<name>.<random>.tmp`."""
    return name.startswith(".") and (".tmp-" in name or name.endswith(".tmp"))


def stale_temporaries(run_dir):
    """Temporary files and folders left in the run directory and its checkpoints/ by a killed writer."""
    found = []
    for folder in (run_dir, checkpoints_dir(run_dir)):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        found += [os.path.join(folder, n) for n in names if is_stale_temporary(n)]
    return found


def remove_stale_temporaries(run_dir):
    """Remove what `stale_temporaries` finds (call on one rank, before anything writes); their paths."""
    removed = stale_temporaries(run_dir)
    for path in removed:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    return removed


def checkpoint_step(path):
    """The step of a checkpoint folder, from its name step_<8 digits>."""
    return int(os.path.basename(os.path.normpath(path))[len("step_"):])


def is_complete(path):
    return os.path.isfile(os.path.join(path, MARKER))


def complete_checkpoints(run_dir):
    """Complete checkpoint folders of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_") and is_complete(os.path.join(root, n)))
    return [os.path.join(root, n) for n in names]


def find_latest(run_dir):
    """The newest complete checkpoint of a run (following `latest`), or None."""
    root = checkpoints_dir(run_dir)
    try:
        with open(os.path.join(root, "latest")) as f:
            name = f.read().strip()
        path = os.path.join(root, name)
        if name.startswith("step_") and is_complete(path):
            return path
    except OSError:
        pass
    done = complete_checkpoints(run_dir)  # `latest` missing or stale: the newest complete one
    return done[-1] if done else None


def resolve(path):
    """A checkpoint folder from a folder, a run directory, or a model.h5 path; verified complete."""
    if os.path.isfile(path) and os.path.basename(path) == "model.h5":
        path = os.path.dirname(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        found = find_latest(path)
        if found is None:
            raise CheckpointError(f"{path} holds no complete checkpoint")
        return found
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker): it was never finished and is not loaded")
    return path


def verify(ckpt_dir, files=FILES):
    """Check sizes and SHA-256 against the COMPLETE marker; a truncated or altered file is refused by name."""
    try:
        with open(os.path.join(ckpt_dir, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint marker {os.path.join(ckpt_dir, MARKER)} is unreadable: {exc}") from exc
    for name in files:
        path = os.path.join(ckpt_dir, name)
        if name not in marker:
            continue
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing")
        size = os.path.getsize(path)
        if size != marker[name]["bytes"]:
            raise CheckpointError(f"{path} is truncated or altered: {size} bytes, the checkpoint recorded {marker[name]['bytes']}")
        if _sha256(path) != marker[name]["sha256"]:
            raise CheckpointError(f"{path} is corrupted: its SHA-256 does not match the one recorded when it was written")


def open_model(ckpt_dir, check=True):
    """(h5py.File of model.h5, its step, its config dict), verified unless check=False."""
    import h5py

    path = os.path.join(ckpt_dir, "model.h5")
    if check:
        verify(ckpt_dir, files=("model.h5",))
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"{path} is not a readable HDF5 file: {exc}") from exc
    if f.attrs.get("format") != FORMAT:
        f.close()
        raise CheckpointError(f"{path} is not a boostmpi checkpoint (format attribute {f.attrs.get('format')!r})")
    try:
        config = json.loads(f.attrs["config"])
    except (KeyError, ValueError) as exc:
        f.close()
        raise CheckpointError(f"{path} has no readable config attribute: {exc}") from exc
    return f, int(f.attrs["step"]), config


def read_state(ckpt_dir):
    with open(os.path.join(ckpt_dir, "state.json")) as f:
        return json.load(f)


def model_mismatch(saved_model, model):
    """The first model key whose value differs, as a message, or None."""
    for k, v in model.items():
        if saved_model.get(k) != v:
            return f"model.{k} is {v!r} in the configuration but {saved_model.get(k)!r} in the checkpoint"
    return None


def as_numpy(group, name):
    return np.asarray(group[name])
