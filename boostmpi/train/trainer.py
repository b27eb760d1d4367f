"""The training loop: data, engine, optimizer, validation, metrics, checkpoints, preemption."""

import math
import os
import resource
import sys
import threading
import time
from types import ModuleType
from typing import TYPE_CHECKING, Callable, TextIO, TypeVar, cast, overload

import numpy as np

from boostmpi import checkpoint as ckpt
from boostmpi.config import Config
from boostmpi.data.progress import format_duration
from boostmpi.data.shards import TrainLoader, eval_windows, open_shard, resolve_shards
from boostmpi.data.tokenizer import check_complete_set
from boostmpi import preemption
from boostmpi.errors import CheckpointError, DataError, TrainingDiverged, UserError, verdict_of
from boostmpi.files import FilesystemError, format_bytes, fs_error, is_out_of_space
from boostmpi.parallel.engine import Engine
from boostmpi.parallel.startup import process_grid
from boostmpi.preemption import FINAL_RECORD, STOPPED_EARLY_EXIT, STOPPED_MARKER  # noqa: F401 - job scripts read them
from boostmpi.train import graph_step, metrics
from boostmpi.train.optim import AdamW, clip_coefficient, learning_rate
from boostmpi.train.resume import check_resume
from boostmpi.train.rundir import RunDirectory

if TYPE_CHECKING:  # the communicator `train` is handed (mpi4py's); the loader's state
    from mpi4py import MPI

    from boostmpi.data.shards import LoaderState

T = TypeVar("T")
TrainResult = dict[str, int | float | bool | None]  # what `Trainer.train` returns: step, loss, val_loss, preempted


def resolve_data(cfg: Config) -> tuple[list[str], list[str]]:
    """(train shard paths, val shard paths); `builtin` means the built-in corpus (prepared once, by rank 0)."""
    d = cfg.data

    def paths(spec: str, which: int) -> list[str]:
        if spec == "builtin":
            from boostmpi.data.corpus import shard_globs

            return resolve_shards(shard_globs(d.builtin_dir)[which])
        return resolve_shards(spec)

    train, val = paths(d.train, 0), paths(d.val, 1)
    check_complete_set(train + val)
    return train, val


def prepare_builtin(cfg: Config, is_root: bool) -> None:
    if "builtin" in (cfg.data.train, cfg.data.val) and is_root:
        from boostmpi.data.corpus import ensure_builtin

        ensure_builtin(cfg.data.builtin_dir)


def optimizer_step(engine: Engine, optimizer: AdamW, lr: float, max_norm: float) -> float:
    """What follows `engine.forward_backward`: the exact global gradient norm, clipping to `max_norm`
    (0 = off), the AdamW update of this rank's slice and, under ZeRO-1, the all-gather of the updated
    slices over dp (`DataParallel.gather_update`). Returns the norm."""
    norm = engine.grad_norm()
    optimizer.step(engine.data_parallel.grad_shard, lr, clip_coefficient(norm, max_norm))
    engine.data_parallel.gather_update(engine.params, engine.master, engine.master_separate)
    return norm


def peak_memory_bytes(xp: ModuleType) -> int:
    if xp is not np:  # CuPy's pools never give memory back unasked: what they hold is their high-water mark
        from boostmpi.gpu.pools import total_bytes

        return total_bytes(xp)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_peak_flops(xp: ModuleType, dtype: str) -> float | None:
    """Peak FLOP/s at `dtype` of this rank's GPU by its built-in machine profile
    (`boostmpi.sim.machines.profile_for_device`), or None on the CPU or a GPU without a profile."""
    if xp is np:
        return None
    from boostmpi.sim.machines import load_machine, profile_for_device

    props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    profile = profile_for_device(name, int(props["totalGlobalMem"]))
    if profile is None:
        return None
    machine = load_machine(profile)
    return machine.peak_flops.get(dtype)  # None for a dtype the profile gives no peak for


class Trainer:
    """A training run. Everything that can refuse the run (the process grid, the run directory, the
    data, the checkpoint to resume and its fit to this configuration) is checked before the engine
    draws a weight."""

    def __init__(self, cfg: Config, world: "MPI.Comm | None" = None, resume: str | None = None,
                 config_path: str | None = None, out: TextIO | None = None, local_rank: int = 0) -> None:
        self.cfg, self.world, self.out = cfg, world, out
        self.grid = process_grid(cfg, world, local_rank)
        graph_step.check(cfg, self.grid)  # train.cuda_graph where it cannot run: one line, before anything is touched
        self.graph: graph_step.GraphStep | None = None
        self.rank = self.grid.world_rank
        self.is_root = self.rank == 0
        tr = cfg.train
        self.run_dir = tr.run_dir
        self.run = RunDirectory(tr.run_dir, self.log)  # its lock, the resume choice, `latest`, abandoned timelines
        self.step = 0
        self._in_flight: tuple[ckpt.PendingSave, threading.Thread] | None = None  # an asynchronous checkpoint
        self._write_failure: FilesystemError | None = None  # rank 0: the FilesystemError of a metrics or log write (see _write_failed)
        self.snapshot_bytes = 0  # memory of the last asynchronous checkpoint's snapshot
        self._root_decides(self.run.check_creatable)
        V, T = cfg.model.vocab_size, cfg.model.seq_len

        def open_data(vocab_size: int | None) -> tuple[TrainLoader, tuple[np.ndarray, np.ndarray]]:
            train_paths, val_paths = resolve_data(cfg)
            loader = TrainLoader(train_paths, T, tr.micro_batch_size, rank=self.grid.coords.dp, world=cfg.parallel.dp,
                                 seed=tr.seed, vocab_size=vocab_size, shuffle=cfg.data.shuffle)
            return loader, eval_windows(open_shard(val_paths[0], vocab_size), T, tr.val_windows, name=val_paths[0])

        # rank 0 reads every token once to check the vocabulary; the others trust its verdict
        self.loader, (self.val_x, self.val_y) = self._root_decides(lambda: open_data(V), lambda: open_data(None))
        preemption.stage("data")
        self.preemption = preemption.watch()  # keeps a stop signal that arrived during start-up
        self.config_path = config_path
        self._root_decides(self.run.lock)  # from here until close(): one run per run directory
        try:
            path = self._check_resume(resume)
            self.engine = Engine(cfg, self.grid)  # the weights are drawn here, after every check
            e = self.engine
            self.optimizer = AdamW(e.params, e.specs, tr, e.xp, shard=e.shard, master=e.master)
            preemption.stage("engine")
            self.peak_flops = device_peak_flops(e.xp, tr.dtype)  # all ranks' GPUs: the MFU's denominator
            if path is not None:
                self._resume(path)
                self.grid.host.barrier()  # every rank has read it: another run may prune it again
                self.run.release_resume_pin()
            if tr.cuda_graph:  # captured in the run's first steps, after any checkpoint is loaded
                self.graph = graph_step.GraphStep(e, self.optimizer, tr.grad_clip)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run directory (also done when `train` returns or raises)."""
        preemption.release()  # this run's stop signal (if any) is acted on; a later run starts afresh
        self.run.release()

    # ------------------------------------------------------------------ helpers
    def log(self, msg: str, live: bool = False) -> None:
        """A line on rank 0. On a terminal, `live` lines overwrite each other (one progress line
        with ETA); in batch logs every line stays."""
        if not self.is_root:
            return
        out = self.out if self.out is not None else sys.stdout
        tty = getattr(out, "isatty", lambda: False)()
        if tty and live:
            print("\r" + msg + "\x1b[K", end="", file=out, flush=True)
            self._live = True
            return
        if tty and getattr(self, "_live", False):
            print("\r\x1b[K", end="", file=out)
            self._live = False
        try:
            print(msg, file=out, flush=True)  # out None: sys.stdout as it is now, not at import
        except BrokenPipeError:  # whoever read the log went away (`| head`): keep training, quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        except OSError as exc:
            if not is_out_of_space(exc):
                raise
            # the log's disk is full: nothing more can go there; the run stops at the next agreement
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
            self._write_failed(fs_error(exc, "cannot write the log (standard output)", getattr(out, "name", None)))

    def _write_failed(self, error: FilesystemError) -> None:
        """Rank 0 could not write its metrics or log: remembered here, and every rank stops together with
        this one line (exit status 2) at the next step's all-reduce or before the next checkpoint."""
        if self._write_failure is None:
            self._write_failure = error

    def _stop_if_a_write_failed(self, failed: bool | None = None) -> None:
        """Raise, on every rank, the write failure rank 0 met. `failed`: the agreed flag of the step's
        all-reduce; None: agree here (a broadcast from rank 0)."""
        if failed is None:
            failed = self._root_decides(lambda: self._write_failure is not None) if self.world is not None \
                else self._write_failure is not None
        if not failed:
            return
        error = self._write_failure or FilesystemError("rank 0 could not write the run's metrics or log")
        error.all_ranks = True  # rank 0 prints it; every rank exits 2, none waits in a collective
        raise error

    @overload
    def _root_decides(self, on_root: Callable[[], T], elsewhere: Callable[[], T]) -> T: ...
    @overload
    def _root_decides(self, on_root: Callable[[], T]) -> T | None: ...

    def _root_decides(self, on_root: Callable[[], T], elsewhere: Callable[[], T] | None = None) -> T | None:
        """Run `on_root()` on rank 0 and `elsewhere()` (default: nothing) on the others; bad input
        found by rank 0 is raised on every rank, so each exits 2 and the message is printed once."""
        verdict, value = None, None
        if self.is_root:
            try:
                value = on_root()
            except UserError as exc:
                verdict = verdict_of(exc)
        self.grid.host.agree(verdict, root=0)
        return value if self.is_root else (elsewhere() if elsewhere else None)

    def _check_resume(self, resume: str | None) -> str | None:
        """The checkpoint to continue from (`resume`, a path, or the run's latest complete one), verified
        and checked against this configuration and data before any weight exists; None for a fresh run."""
        path = self._root_decides(lambda: self.run.choose_resume(resume))
        path = self.grid.host.bcast(path)
        if path is None:
            return None
        ckpt.verify_together(path, self.world)  # sizes and SHA-256 of every file, shared among the ranks
        f, step, saved_cfg = ckpt.open_model(path, check=False)
        f.close()
        mismatch = ckpt.model_mismatch(saved_cfg.get("model", {}), self.cfg.to_dict()["model"])
        if mismatch:  # every rank reads the same attribute: each raises, rank 0 prints
            err = CheckpointError(f"cannot resume from {path}: {mismatch}")
            err.all_ranks = True
            raise err
        for line in check_resume(self.cfg, saved_cfg, step, path):  # or refused, before anything is changed
            self.log(line)
        try:
            self.loader.load_state_dict(cast("LoaderState", ckpt.read_state(path)["data"]))
        except DataError as exc:  # every rank reads the same state: each raises, rank 0 prints
            refusal = DataError(f"cannot resume {path}: {exc}. To train on these shards, start a new run: set a new "
                                f"train.run_dir (or remove {self.run_dir} to start it afresh)")
            refusal.all_ranks = True
            raise refusal from None
        return path

    def _resume(self, path: str) -> None:
        """Load the checkpoint `_check_resume` accepted into the engine and the optimizer."""
        e = self.engine
        buffer = e.master_buffer()  # the parameters in the master dtype (a host buffer for a ZeRO-1 slice)
        step, _ = ckpt.load(path, e.specs, buffer, self.optimizer, e.xp)
        e.adopt_master(buffer)
        self.step = step
        self.run.continues(path, step)
        self.log(f"resumed from {path} (step {step})")

    # ------------------------------------------------------------------ checkpoint
    def _kept_checkpoint(self) -> str:
        """What a stopped run leaves to resume from, in words: its newest complete checkpoint, or none."""
        self.poll_async_save(wait=True)
        return self.run.kept_checkpoint()

    def save_checkpoint(self) -> None:
        """Every rank writes its own pieces at once (checkpoint.save); a failure on any rank (a full
        disk) ends every rank with the same one-line error, the previous checkpoint untouched.

        With `checkpoint.async = true` the ranks take a snapshot of what they write (its bytes are
        reported as memory.checkpoint_snapshot), rank 0 prepares the folder, and a background thread
        writes each rank's file while training goes on; `poll_async_save` publishes it at a later step
        boundary. At most one save is in flight: a new one first waits for the previous one."""
        self._stop_if_a_write_failed()  # never a checkpoint past metrics that could not be written
        self.poll_async_save(wait=True)
        par, asynchronous = self.cfg.parallel, self.cfg.checkpoint.async_
        state = None
        if self.is_root:
            state = {"data": self.loader.state_dict(), "seed": self.cfg.train.seed,
                     "layout": {"tp": par.tp, "pp": par.pp, "dp": par.dp, "tp_mode": par.tp_mode,
                                "zero_stage": par.zero_stage}}
        states = [ckpt.rank_state(self.engine, self.optimizer)]
        args = (self.run_dir, self.step, self.cfg, states, self.optimizer.t, state)
        keep = self.cfg.checkpoint.keep
        if not asynchronous:
            self.log(f"checkpoint {ckpt.save(*args, comm=self.world, keep=keep, log=self.log, prune_in_background=True)}")
            return
        pending = ckpt.PendingSave(*args, comm=self.world, keep=keep, log=self.log, prune_in_background=True)
        pending.snapshot()
        self.snapshot_bytes = pending.nbytes
        thread = threading.Thread(target=pending.write_in_background, name="boostmpi-checkpoint", daemon=True)
        thread.start()
        self._in_flight = (pending, thread)

    def poll_async_save(self, wait: bool = False) -> None:
        """Publish the asynchronous save in flight once every rank has written its file (collective;
        with `wait`, first wait for this rank's writer). A write that failed on any rank stops every
        rank with its one-line error; the previous checkpoint stays the latest."""
        if self._in_flight is None:
            return
        pending, thread = self._in_flight
        if wait:
            thread.join()
        if self.engine.grid.host.sum([0.0 if pending.written else 1.0])[0] > 0:
            return  # some rank is still writing: look again at the next step boundary
        self._in_flight = None
        self.log(f"checkpoint {pending.finish()}")

    # ------------------------------------------------------------------ validation
    def validate(self) -> float:
        """Mean loss over the validation windows (each dp rank evaluates its share)."""
        e, tr = self.engine, self.cfg.train
        dp, r = self.cfg.parallel.dp, e.grid.coords.dp
        B = tr.micro_batch_size
        n = len(self.val_x)
        batches = []
        for start in range(0, n, B * dp):
            lo = start + r * B
            hi = min(lo + B, n)
            batches.append((self.val_x[lo:hi], self.val_y[lo:hi]) if lo < hi else None)
        total = 0.0
        for summed in e.evaluate_batches(batches):
            total += summed
        return total / n

    def _mfu(self, seconds: float) -> float | None:
        """Model FLOPs utilisation of a step of `seconds`: the model's FLOPs of the step
        (`boostmpi.sim.model.model_flops_per_step`, the count `boostmpi sim` uses) over what every
        rank's GPU could do in that time at its profile's peak; None without a profile (the CPU)."""
        if self.peak_flops is None or seconds <= 0:
            return None
        from boostmpi.sim.model import model_flops_per_step

        return model_flops_per_step(self.cfg) / (seconds * self.engine.grid.world_size * self.peak_flops)

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainResult:
        cfg, e, tr = self.cfg, self.engine, self.cfg.train
        preemption.started()  # from here a stop signal is acted on at a step boundary, with a checkpoint
        preemption.stage("first-step")
        self._root_decides(lambda: self.run.prepare(cfg.to_toml()))
        tokens_per_step = cfg.tokens_per_step
        log = metrics.MetricsFile(self.run_dir) if self.is_root else None
        t_start = time.perf_counter()
        steps_done = 0
        last_val = None
        try:
            while self.step < tr.steps:
                step = self.step
                lr = learning_rate(step, tr)
                self.preemption.step_begins()
                position = self.loader.state_dict()
                micro = [self.loader.next_batch() for _ in range(tr.grad_accum)]
                e.grid.counter.reset()
                t0 = time.perf_counter()
                if self.graph is None:
                    loss = e.forward_backward(micro, also_sum=self._step_sums)
                    summed = e.summed
                else:  # one rank (graph_step.check): its flags are read before the launch, which updates the weights
                    summed = e.grid.host.sum(self._step_sums())
                counters, (stop, stopped_before, write_failed) = self._step_totals(summed)
                self._stop_if_a_write_failed(write_failed)
                if stopped_before and steps_done:
                    # a stop signal came, on some rank, after the previous step's all-reduce: the run stops at
                    # that step's boundary. This step is dropped (no update, no row, its batches put back), so
                    # the checkpoint is of the step the signal arrived in, at no extra collective per step.
                    self.loader.load_state_dict(position)
                    return self._stop_at_boundary(last_val)
                if self.graph is not None:  # forward, backward, clipping and AdamW in one launch
                    loss, gnorm = self.graph.step(micro, lr)
                    stop = stop or self.preemption.signal is not None
                if not math.isfinite(loss):
                    raise TrainingDiverged(f"the loss became {loss} at step {step + 1}; {self._kept_checkpoint()} "
                                           f"(lower train.lr or raise train.warmup_steps)")
                if self.graph is None:
                    gnorm = optimizer_step(e, self.optimizer, lr, tr.grad_clip)
                dt = time.perf_counter() - t0
                self.step = step + 1
                steps_done += 1
                row = metrics.step_row(self.step, loss, lr, gnorm, dt, tokens_per_step, counters, mfu=self._mfu(dt))
                if self.step == 1 or self.step % max(1, tr.log_every) == 0 or self.step == tr.steps:
                    row["memory"] = self._memory()
                    if steps_done == 1:
                        self.log(self._memory_line(row["memory"]))
                want_val = (tr.val_every and self.step % tr.val_every == 0) or self.step == tr.steps
                if want_val:
                    last_val = self.validate()
                    row["val_loss"] = last_val
                if log and self._write_failure is None:
                    failure = log.append(row)
                    if failure is not None:  # rank 0 alone: every rank stops at the next agreement
                        self._write_failed(failure)
                if self.step == 1 or self.step % max(1, tr.log_every) == 0 or self.step == tr.steps or want_val:
                    elapsed = time.perf_counter() - t_start
                    eta = elapsed / steps_done * (tr.steps - self.step)
                    val = f" | val {last_val:.4f}" if want_val else ""
                    mfu_text = f" | MFU {row['mfu']:.1%}" if "mfu" in row else ""
                    self.log(f"step {self.step:>6d}/{tr.steps} | loss {loss:.4f}{val} | lr {lr:.2e} | "
                             f"{tokens_per_step / dt:,.0f} tok/s{mfu_text} | elapsed {format_duration(elapsed)} | eta {format_duration(eta)}",
                             live=not want_val and self.step != tr.steps)
                every = cfg.checkpoint.every
                saving = (every and self.step % every == 0) or self.step == tr.steps
                if not stop and (want_val or saving):
                    # a stop signal (or a write failure) that came after the step's all-reduce, during the long
                    # parts that follow it (validation), is agreed on here, before the step's checkpoint; on
                    # other steps the next step's all-reduce carries it (and that step is dropped, above)
                    late = e.grid.host.max([0.0 if self.preemption.signal is None else 1.0,
                                            0.0 if self._write_failure is None else 1.0])
                    self._stop_if_a_write_failed(late[1] > 0)
                    stop = late[0] > 0
                self.poll_async_save(wait=self.step == tr.steps)
                if saving:
                    self.save_checkpoint()
                    self.poll_async_save(wait=self.step == tr.steps)
                if stop:
                    return self._stop_at_boundary(last_val)
            self._stop_if_a_write_failed()
            self._root_decides(self._write_final_record)
        finally:
            if log:
                log.close()
            ckpt.wait_for_pruning()
            self.close()
        return {"step": self.step, "preempted": False, "val_loss": last_val, "loss": loss if steps_done else None}

    def _write_final_record(self) -> None:
        """Rank 0, once the last step is trained and its checkpoint published (RunDirectory.write_final_record)."""
        self.run.write_final_record(self.step, self.cfg.train.steps)

    def _stop_at_boundary(self, last_val: float | None) -> TrainResult:
        """A stop signal reached some rank: checkpoint the step reached (unless it was just saved), say so,
        leave the marker for the job scripts, and return (exit status STOPPED_EARLY_EXIT)."""
        every, steps = self.cfg.checkpoint.every, self.cfg.train.steps
        if not (every and self.step % every == 0) and self.step != steps:
            self.save_checkpoint()
        self.poll_async_save(wait=True)
        self.log(f"stopped by signal at step {self.step}: checkpoint written, resume by running the same command "
                 f"({self.preemption.name()}; exit status {STOPPED_EARLY_EXIT})")
        self._stop_if_a_write_failed()
        if self.is_root:
            self.run.write_stop_marker(f"stopped on {self.preemption.name()} at step {self.step}\n")
        if self.step >= steps:  # stopped at the last step: the run is finished all the same
            self._root_decides(self._write_final_record)
        # no rank leaves before rank 0 has published the checkpoint and the marker: a launcher
        # that ends the others at the first non-zero exit (srun --kill-on-bad-exit) would cut them
        self.engine.grid.host.barrier()
        return {"step": self.step, "preempted": True, "val_loss": last_val}

    def _step_sums(self) -> list[float]:
        """What the trainer adds to the step's one all-reduce: this rank's payload bytes and calls per
        axis, its two stop flags (a signal arrived; before this step began) and whether rank 0 failed
        to write its metrics or log."""
        return (metrics.counter_floats(self.engine.grid.counter) + self.preemption.flags()
                + [1.0 if self._write_failure is not None else 0.0])

    @staticmethod
    def _step_totals(summed: np.ndarray) -> tuple[np.ndarray, tuple[bool, ...]]:
        """(the summed traffic counters, (some rank was signalled to stop, some rank was before this step
        began, rank 0 failed to write its metrics or log)) from the step's all-reduce."""
        n = metrics.COUNTER_FLOATS
        return summed[:n], tuple(bool(v > 0) for v in summed[n:n + 3])

    def _memory(self) -> dict[str, int]:
        e = self.engine
        shard = e.data_parallel.grad_shard  # + the reduce-scattered slice of the summed gradient under ZeRO-1
        grads = e.grads.data.nbytes + (shard.nbytes if e.data_parallel.sharded and shard is not None else 0)
        mine = [e.param_bytes, grads, self.optimizer.nbytes, e.saved_activation_bytes, e.in_flight_activation_bytes,
                self.snapshot_bytes, peak_memory_bytes(e.xp)]
        return metrics.memory_figures(mine, e.grid.host)  # the largest rank's figure for each

    def _memory_line(self, mem: dict[str, int]) -> str:
        mib = format_bytes
        per_layer = self.engine.saved_activation_bytes_per_layer
        layer = ""
        if per_layer:  # lowrank's first layer may keep less (its input is looked up again)
            lo, hi = min(per_layer), max(per_layer)
            layer = f" ({mib(hi)} per layer)" if lo == hi else f" ({mib(lo)} to {mib(hi)} per layer)"
        return (f"memory (largest rank): params {mib(mem['params'])}, grads {mib(mem['grads'])}, optimizer "
                f"{mib(mem['optimizer'])}, saved activations {mib(mem['activations_saved'])} per micro-batch{layer} "
                f"with recompute = {self.cfg.train.recompute}, {mib(mem['activations_in_flight'])} held at once "
                f"by the pipeline schedule, peak {mib(mem['peak'])}")
