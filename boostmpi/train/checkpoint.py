"""Checkpoints (CONTRACT §3): layout-free HDF5 files, written atomically, verified on load.

  <run_dir>/checkpoints/step_00000010/
      model.h5     global parameter tensors (plain h5py reads them on one process)
      optim.h5     AdamW moments `m/<name>`, `v/<name>` as global tensors, attribute `t`
      state.json   step, data position, RNG seed, layout that wrote it
      COMPLETE     written last: sizes and SHA-256 of the three files above
  <run_dir>/checkpoints/latest   the name of the newest complete checkpoint

Writing: every rank sends its shards to world rank 0 (buffer-based MPI), which writes into a
hidden temporary folder, fsyncs, writes COMPLETE, renames the folder into place and then
replaces `latest` atomically. A crash at any point leaves the previous checkpoint and `latest`
untouched; a folder without COMPLETE is never loaded. Nothing is pickled or executed on load.
"""

import hashlib
import json
import os
import shutil

import numpy as np

from boostmpi.errors import CheckpointError

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


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_h5(path, tensors, attrs):
    import h5py

    with h5py.File(path, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        for name, arr in tensors.items():
            f.create_dataset(name, data=arr)


def save(run_dir, step, cfg, model_tensors, moments, adam_t, state, keep=0, crash_hook=None):
    """Write checkpoint `step` (world rank 0 only). `crash_hook(stage)` lets tests simulate a crash."""
    root = checkpoints_dir(run_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, step_dir_name(step))
    if is_complete(final):
        return final  # the same step is already saved (a resumed run reached it again)
    tmp = os.path.join(root, f".{step_dir_name(step)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config_json = json.dumps(cfg.to_dict(), sort_keys=True)
    write_h5(os.path.join(tmp, "model.h5"), model_tensors,
             {"format": FORMAT, "format_version": FORMAT_VERSION, "step": int(step), "config": config_json})
    if crash_hook:
        crash_hook("model.h5")
    opt = {f"m/{k}": v for k, v in moments[0].items()}
    opt.update({f"v/{k}": v for k, v in moments[1].items()})
    write_h5(os.path.join(tmp, "optim.h5"), opt, {"format": FORMAT, "step": int(step), "t": int(adam_t)})
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump(dict(state, step=int(step)), f, indent=1, sort_keys=True)
    marker = {}
    for name in FILES:
        path = os.path.join(tmp, name)
        _fsync_file(path)
        marker[name] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    if crash_hook:
        crash_hook("marker")
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final):  # an incomplete leftover of an earlier crash: never loaded, safe to replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    latest_tmp = os.path.join(root, f".latest.tmp-{os.getpid()}")
    with open(latest_tmp, "w") as f:
        f.write(step_dir_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root, "latest"))
    _fsync_dir(root)
    if keep > 0:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


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
