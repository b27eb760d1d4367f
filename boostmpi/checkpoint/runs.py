"""A run's checkpoints folder: which checkpoints are complete, `latest`, what a user may name as a
checkpoint (`resolve`), the timelines moved aside, the temporaries a killed writer leaves, and the
pruning of older checkpoints."""

import contextlib
import os
import shutil
import threading
import time

from boostmpi.checkpoint.format import MARKER, checkpoints_dir
from boostmpi.checkpoint.pins import CLAIM, claim_for_pruning, live_pins
from boostmpi.errors import CheckpointError
from boostmpi.files import fsync_dir, write_file_atomically

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
    try:  # `latest` that is not UTF-8 reads as no valid name: the newest complete checkpoint instead
        with open(os.path.join(root, "latest"), errors="replace") as f:
            name = f.read().strip()
        path = os.path.join(root, name)
        if name.startswith("step_") and is_complete(path):
            return path
    except OSError:
        pass
    done = complete_checkpoints(run_dir)  # `latest` missing or stale: the newest complete one
    return done[-1] if done else None


def resolve(path):
    """A verified-complete checkpoint folder from what a user may name: a run directory (its newest
    checkpoint), its `checkpoints/` folder or `checkpoints/latest` file (the one `latest` names),
    a step folder, or a step folder's model.h5."""
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.basename(path) == "model.h5":
        path = os.path.dirname(path) or "."
    elif os.path.isfile(path) and os.path.basename(path) == "latest":
        try:
            with open(path, errors="replace") as f:  # not UTF-8: refused below, by what it holds
                name = f.read().strip()
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if not name.startswith("step_") or os.sep in name:
            raise CheckpointError(f"{path} does not name a checkpoint folder (it holds {name[:40]!r})")
        path = os.path.join(os.path.dirname(path), name)
    elif os.path.isfile(path):
        raise CheckpointError(f"{path} is a file but not a checkpoint: name a run directory, its checkpoints/latest, "
                              f"a step_<N> folder or its model.h5")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        found = find_latest(path)
        if found is None:
            raise CheckpointError(f"{path} holds no complete checkpoint")
        return found
    if os.path.basename(os.path.normpath(path)) == "checkpoints" and os.path.isdir(path):
        found = find_latest(os.path.dirname(os.path.abspath(path)))
        if found is None:
            raise CheckpointError(f"{path} holds no complete checkpoint")
        return found
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        missing = missing_rank_files(path)
        if missing:  # a copy of model.h5 alone: HDF5 would read every tensor as NaN without a word
            raise CheckpointError(f"{os.path.join(path, 'model.h5')} is not a checkpoint by itself: its tensors are views "
                                  f"of rank files that are not beside it ({', '.join(missing[:3])}"
                                  f"{' ...' if len(missing) > 3 else ''}), and HDF5 would read them as NaN; copy the "
                                  f"whole step folder, or write one self-contained file with `boostmpi export "
                                  f"CHECKPOINT --to h5 --out FILE`")
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker): it was never finished and is not loaded")
    return path


def missing_rank_files(folder):
    """The rank files that `folder`/model.h5's virtual datasets read from but that do not exist ([] when
    there is no such model.h5, or nothing is missing)."""
    model = os.path.join(folder, "model.h5")
    if not os.path.isfile(model):
        return []
    try:
        import h5py

        sources = set()
        with h5py.File(model, "r") as f:
            def collect(_, obj):
                if isinstance(obj, h5py.Dataset) and obj.is_virtual:
                    sources.update(vs.file_name for vs in obj.virtual_sources())

            f.visititems(collect)
    except (OSError, RuntimeError, ValueError):
        return []
    return sorted(name for name in sources if name != "." and not os.path.exists(os.path.join(folder, name)))


_pruning: list[threading.Thread] = []  # the thread deleting pruned checkpoints, while one runs


def wait_for_pruning():
    """Wait until the checkpoints a save pruned in the background are deleted."""
    while _pruning:
        _pruning.pop().join()


def prune(folders, in_background, log=None):
    """Delete checkpoint folders, but none that a reader has pinned (pins.py). Each is first renamed to a hidden temporary name in one step, so no
    reader ever finds half of a complete checkpoint (a killed deleter's leftover is removed as a stale
    temporary when the next run starts); `in_background`: the deleting (unlinking gigabytes takes the
    filesystem a while) is left to a thread."""
    import threading

    wait_for_pruning()
    doomed = []
    for folder in folders:
        hidden = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.tmp-pruned")
        shutil.rmtree(hidden, ignore_errors=True)
        try:
            if not claim_for_pruning(folder):  # a reader holds it: kept, and pruned by a later save
                if log:
                    log(f"kept the older checkpoint {folder} for now: a reader holds it ({', '.join(live_pins(folder))})")
                continue
            os.rename(folder, hidden)
        except OSError as exc:  # pruning is housekeeping: the new checkpoint is published either way
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, CLAIM))
            if log:
                log(f"warning: could not remove the older checkpoint {folder} ({exc.strerror or exc}); it stays")
            continue
        doomed.append(hidden)
    if not doomed:
        return

    def delete():
        for hidden in doomed:
            shutil.rmtree(hidden, ignore_errors=True)

    if not in_background:
        delete()
        return
    thread = threading.Thread(target=delete, name="boostmpi-prune")  # not a daemon: the exit waits for it
    thread.start()
    _pruning.append(thread)
