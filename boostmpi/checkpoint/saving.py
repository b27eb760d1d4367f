"""Saving a checkpoint, collectively (docs/CHECKPOINTS.md).

Every rank writes its own file at once into a hidden temporary folder; rank 0 checks the free space
first and, once every rank reported a complete file, writes the virtual files, COMPLETE, renames the
folder into place and replaces `latest` atomically. A crash at any point leaves the previous
checkpoint and `latest` untouched; a folder without COMPLETE is never loaded; a write that fails on
any rank (a full disk) removes its temporary folder and stops every rank with one line; a killed
writer's folder is removed when the next run starts. A checkpoint folder always holds the state of
the run that wrote it: one of another timeline is moved aside, never reused.

`save` does it in one call; `PendingSave` in three phases, the middle one (this rank's files) free of
communication, so that it can run in a background thread from a snapshot (`checkpoint.async`).
The writers are called through their module (`writer.write_rank_file`), where tests replace them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias, TypeVar, cast

from boostmpi.checkpoint import writer
from boostmpi.checkpoint.format import FILES, MARKER, Checksum, checkpoints_dir, os_error_of, rank_file_name, step_dir_name
from boostmpi.checkpoint.layout import estimate_bytes
from boostmpi.checkpoint.runs import (complete_checkpoints, find_latest, is_complete, move_aside, prune,
                                      wait_for_pruning, write_latest)
from boostmpi.checkpoint.writer import SPARE_IMAGES, PhaseTimer, file_record, rank_file_image
from boostmpi.errors import CheckpointError, UserError, raised_on_all_ranks
from boostmpi.files import FilesystemError, atomic_file, check_space, fs_error, fsync_dir, make_dirs

if TYPE_CHECKING:
    import mmap

    from mpi4py import MPI

    from boostmpi.checkpoint.layout import RankState
    from boostmpi.checkpoint.writer import FileRecord
    from boostmpi.config import Config
    from boostmpi.errors import Verdict

    # a rank's report to rank 0: {file name: its COMPLETE record}, and the failure it met (None: none)
    Report: TypeAlias = tuple[dict[str, FileRecord], Verdict | None]
    # a snapshot of one rank file: its coordinates, its page-aligned image, its size in bytes
    Image: TypeAlias = tuple[tuple[int, ...], mmap.mmap, int]

T = TypeVar("T")

def _lowest_cpu_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19). Linux keeps a nice value per thread;
    elsewhere setpriority would change the whole process, so nothing is done there."""
    import sys
    import threading

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Agreement:
    """Collective verdicts of a save over `comm` (None: one process). `check(error)` raises the first
    error any rank met, on every rank, as the same one-line UserError."""

    def __init__(self, comm: MPI.Comm | None) -> None:
        from boostmpi.parallel.comm import HostCollectives

        self.comm = comm
        # watched (parallel.watchdog_s): a peer that dies or stops during a save ends the job, never hangs it
        self.host = HostCollectives(comm, axis="checkpoint")

    def bcast(self, value: T) -> T:
        return self.host.bcast(value)

    def gather(self, value: T) -> list[T] | None:
        return self.host.gather(value)

    def check(self, error: Verdict | None) -> None:
        self.host.agree(error)


def _failure(exc: BaseException, name: str, root: str, needed: int, kept: str) -> Verdict:
    """(class name, one-line message) of an exception met while writing checkpoint `name`."""
    os_exc = os_error_of(exc)
    if os_exc is None:
        return ("CheckpointError", f"cannot write checkpoint {name}: {type(exc).__name__}: {exc}; {kept}")
    error = fs_error(os_exc, f"cannot write checkpoint {name} into", root, needed=needed)
    return ("FilesystemError", f"{error}; the partial checkpoint is removed, {kept}")


class PendingSave:
    """One checkpoint on its way, in three phases: the constructor (collective: rank 0 checks the free
    space and makes the temporary folder), `write()` (this rank's files only, no communication: it can
    run in a background thread while training goes on, from a snapshot) and `finish()` (collective: rank
    0 publishes the checkpoint once every rank reported its file complete, or everyone raises the first
    failure). `save` runs the three in a row."""

    KEPT = "the previous checkpoint and `latest` are unchanged"
    NONE_KEPT = ("there is no earlier checkpoint, so this run has nothing to resume from: make room (or raise the "
                 "limit) and start it again in a new train.run_dir, or after removing this one")

    def __init__(self, run_dir: str, step: int, cfg: Config, states: Sequence[RankState], adam_t: int,
                 state: Mapping[str, object] | None, comm: MPI.Comm | None = None, keep: int = 0,
                 log: Callable[[str], None] | None = None, prune_in_background: bool = False) -> None:
        self.run_dir, self.step, self.cfg, self.states, self.adam_t, self.state = run_dir, step, cfg, states, adam_t, state
        self.comm, self.keep, self.log = comm, keep, log
        self.prune_in_background = prune_in_background
        self.dtype = states[0].params.dtype  # of the global tensors
        self.agree = Agreement(comm)
        self.is_root = comm is None or comm.Get_rank() == 0
        self.root = checkpoints_dir(run_dir)
        self.name = step_dir_name(step)
        self.final = os.path.join(self.root, self.name)
        self.needed, largest = estimate_bytes(cfg, states[0].params.itemsize)
        self.records: dict[str, FileRecord] = {}
        self.error: Verdict | None = None
        self.written = False
        self.images: list[Image] | None = None  # [(coords, page-aligned image, size)] once `snapshot` took them
        # this rank's wall seconds per phase: "write", "fsync", "checksum" of its rank file (and "snapshot"
        # of an asynchronous save); on rank 0 also "virtual files" (model.h5, optim.h5, state.json, their
        # fsync and checksum) and "publish"
        # (COMPLETE, rename, `latest`, pruning), and "wait" (finish's gather until every rank reported)
        self.phases: dict[str, float] = {}
        self._timer = PhaseTimer(self.phases)
        tmp: str | None = None
        error: Verdict | None = None
        self.kept = self.KEPT
        if self.is_root:
            wait_for_pruning()  # the space an earlier save's pruning frees counts
            if find_latest(run_dir) is None:  # the first save: never claim a previous checkpoint
                self.kept = self.NONE_KEPT
            try:
                make_dirs(self.root, "checkpoint folder")
                try:
                    check_space(self.root, self.needed, f"cannot write checkpoint {self.name} into", largest_file=largest)
                except FilesystemError as exc:
                    raise FilesystemError(f"{exc}; nothing was written, {self.kept}") from None
                tmp = os.path.join(self.root, f".{self.name}.tmp-{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            except UserError as exc:
                error = (type(exc).__name__, str(exc))
        # the root's folder on every rank (None only with an error, which `check` raises)
        self.tmp, error, self.kept = cast("tuple[str, Verdict | None, str]", self.agree.bcast((tmp, error, self.kept)))
        self.agree.check(error)

    @property
    def nbytes(self) -> int:
        """Bytes of what this save writes from: its snapshot's memory once `snapshot` took one, else the
        arrays it was handed."""
        if self.images is not None:
            return sum(len(image) for _, image, _ in self.images)
        return sum(st.nbytes for st in self.states)

    def snapshot(self) -> None:
        """Copy what this rank writes into the bytes of its files (page-aligned, for direct I/O): from here
        on training may change the arrays the save was handed. A failure is kept for `finish`."""
        try:
            self.images = []
            for st in self.states:
                path = os.path.join(self.tmp, rank_file_name(*st.coords))
                with self._timer("snapshot"):
                    self.images.append((st.coords, *rank_file_image(path, self.cfg, st)))
        except Exception as exc:  # noqa: BLE001 -- reported on every rank by finish()
            self.error = _failure(exc, self.name, self.root, self.needed, self.kept)
            self.images = []
        self.states = ()  # training owns those arrays again

    def write(self) -> None:
        """This rank's files: written (their checksum taken from the bytes as they go out), fsynced, size
        and checksum recorded; a failure is kept for `finish`."""
        if self.images is not None:
            return self._write_images(self.images)
        try:
            for st in self.states:
                path = os.path.join(self.tmp, rank_file_name(*st.coords))
                digest = Checksum()
                with self._timer("write"):
                    writer.write_rank_file(path, self.cfg, st, digest=digest)
                self.records[os.path.basename(path)] = file_record(path, self.phases, digest)
        except Exception as exc:  # noqa: BLE001 -- reported on every rank by finish()
            self.error = _failure(exc, self.name, self.root, self.needed, self.kept)
        self.written = True

    def _write_images(self, images: list[Image]) -> None:
        """`write` from the snapshot: each image written with direct I/O, hashed from memory, fsynced."""
        try:
            if self.error is None:
                for coords, image, size in images:
                    path = os.path.join(self.tmp, rank_file_name(*coords))
                    with self._timer("write"):
                        writer.write_file_image(path, image, size)
                    with self._timer("checksum"):
                        digest = Checksum(memoryview(image)[:size])
                    self.records[os.path.basename(path)] = file_record(path, self.phases, digest)
        except Exception as exc:  # noqa: BLE001 -- reported on every rank by finish()
            self.error = _failure(exc, self.name, self.root, self.needed, self.kept)
        for _, image, _ in images:  # the snapshot's memory, for the next save
            SPARE_IMAGES.give_back(image)
        self.images = []
        self.written = True

    def write_in_background(self) -> None:
        """`write` for a thread of its own, at the lowest CPU priority: where training keeps every core
        busy (CPU runs) the writer takes what the training threads leave and the steps keep their pace,
        the save taking longer; on a host with idle cores (a GPU node) it runs at full speed. Its heavy
        parts (writes, checksum, fsync) release the GIL, and the checksum is taken from memory (no reading back:
        every CPU second here is one the training may miss). Call `snapshot` first."""
        _lowest_cpu_priority()
        self.write()

    def finish(self) -> str:
        """Publish the checkpoint (collective); returns its folder, or raises on every rank."""
        with self._timer("wait"):
            gathered = self.agree.gather((self.records, self.error))
        verdict = None
        if self.is_root:
            try:
                self._publish_on_root(cast("list[Report]", gathered))  # every rank's, on the root
            except BaseException as exc:
                shutil.rmtree(self.tmp, ignore_errors=True)
                failure = _failure(exc, self.name, self.root, self.needed, self.kept)
                if isinstance(exc, UserError):
                    verdict = (type(exc).__name__, str(exc))
                elif isinstance(exc, Exception) and (self.comm is not None or os_error_of(exc) is not None):
                    verdict = failure
                else:  # an interrupt (or, on one process, any other BaseException) goes up as it is
                    if self.comm is not None:
                        self.agree.bcast(failure)  # the others stop too
                    raise
        self.agree.check(self.agree.bcast(verdict))
        return self.final

    def _publish_on_root(self, gathered: list[Report]) -> None:
        cfg, tmp, name = self.cfg, self.tmp, self.name
        errors = [e for _, e in gathered if e is not None]
        if errors:
            raise raised_on_all_ranks(errors[0])
        marker: dict[str, FileRecord] = {}
        for r, _ in gathered:
            marker.update(r)
        expected = {rank_file_name(t, st, d) for t in range(cfg.parallel.tp) for st in range(cfg.parallel.pp)
                    for d in range(cfg.parallel.dp)}
        if set(marker) != expected:
            raise CheckpointError(f"cannot write checkpoint {name}: rank files {sorted(expected - set(marker))} "
                                  f"were not reported; {self.kept}")
        for file_name, record in marker.items():  # every rank's file is there, as its writer recorded it
            if os.path.getsize(os.path.join(tmp, file_name)) != record["bytes"]:
                raise CheckpointError(f"cannot write checkpoint {name}: {file_name} is not the size its rank "
                                      f"wrote; {self.kept}")
        with self._timer("virtual files"):
            writer.write_virtual_files(tmp, cfg, self.step, self.adam_t, self.dtype)
            with atomic_file(os.path.join(tmp, "state.json")) as f:
                state = cast("Mapping[str, object]", self.state)  # rank 0 is handed the state; the others None
                json.dump(dict(state, step=int(self.step)), f, indent=1, sort_keys=True)
            for file_name in FILES:
                marker[file_name] = file_record(os.path.join(tmp, file_name))
        with self._timer("publish"):
            with atomic_file(os.path.join(tmp, MARKER)) as f:
                json.dump(marker, f, indent=1, sort_keys=True)
            _publish(self.run_dir, tmp, self.final, self.step, self.keep, self.log, self.prune_in_background)


def save(run_dir: str, step: int, cfg: Config, states: Sequence[RankState], adam_t: int, state: Mapping[str, object] | None,
         comm: MPI.Comm | None = None, keep: int = 0, log: Callable[[str], None] | None = None,
         prune_in_background: bool = False) -> str:
    """Write checkpoint `step`, collectively over `comm` (every rank calls it; None: one process, which
    writes every RankState in `states`). Returns the folder on every rank.

    Every rank writes its own file `rank-tp<t>-pp<s>-dp<d>.h5` into a hidden temporary folder, at the
    same time as the others, fsyncs it and records its size and checksum. Rank 0 then writes model.h5 and
    optim.h5 (virtual datasets over the rank files) and state.json, and only when every rank reported a
    complete file writes COMPLETE (every file's size and checksum), renames the folder into place and
    replaces `latest`. A failure on any rank (a full disk, an exception) removes the temporary folder and
    raises the same one-line error on every rank; the previous checkpoint and `latest` are untouched.
    A complete folder of the same step belongs to another timeline and is moved aside, never reused.
    `log(line)` receives what
    the save did besides writing. `keep > 0` removes the oldest complete checkpoints beyond `keep`, once
    the new one is published (`prune_in_background`: renamed aside at once, deleted by a thread of rank 0
    that the next save or `wait_for_pruning` joins).
    """
    pending = PendingSave(run_dir, step, cfg, states, adam_t, state, comm, keep, log, prune_in_background)
    pending.write()
    return pending.finish()


def _publish(run_dir: str, tmp: str, final: str, step: int, keep: int, log: Callable[[str], None] | None,
             prune_in_background: bool = False) -> None:
    """Rename a complete temporary folder into place, point `latest` at it, prune to `keep`."""
    root, name = checkpoints_dir(run_dir), os.path.basename(final)
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
        prune(complete_checkpoints(run_dir)[:-keep], prune_in_background, log)
