"""`boostmpi train --config FILE [--set section.key=value ...] [--resume CHECKPOINT]`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

from boostmpi.errors import UserError
from boostmpi.files import fs_error

if TYPE_CHECKING:
    import argparse

    from boostmpi.cli import Subparsers
    from boostmpi.config import Config


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a model (run under mpiexec/srun for several ranks)",
        description="Train the configured model on one process or, under mpiexec/srun, on tp x pp x dp MPI ranks. "
                    "Writes train.run_dir: config.toml, metrics.jsonl (one JSON line per step) and checkpoints/. "
                    "Started again, it resumes from the run directory's latest checkpoint. SIGTERM, SIGUSR1 or "
                    "Ctrl-C (SIGINT) write a checkpoint at the next step boundary and stop.",
        epilog="exit status: 0 finished train.steps; 75 stopped early by a signal, with a checkpoint to resume from "
               "(run the same command again); 2 bad input (configuration, data, checkpoint, filesystem); "
               "1 internal failure")
    p.add_argument("--config", required=True, help="TOML configuration file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a configuration key (`python -m boostmpi.config` prints them all, with defaults)")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT",
                   help="start from this checkpoint instead of this run directory's latest (if any): "
                        "a run directory (its latest checkpoint), its checkpoints/latest file, a step_<N> folder, "
                        "or its model.h5")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from boostmpi import preemption

    # init_mpi and the trainer take over the stop signals; a caller in this process (a test) gets its
    # own handlers back, or `timeout` could no longer end it
    with preemption.handlers_restored():
        try:
            return _run(args)
        except preemption.StoppedDuringStartup as stopped:  # every rank got it: each says it alone, once
            print(f"boostmpi: {stopped}", file=sys.stderr, flush=True)
            return stopped.exit_code


def _run(args: argparse.Namespace) -> int:
    from boostmpi.parallel.launch import init_mpi, run_guarded
    from boostmpi.preemption import STOPPED_EARLY_EXIT, stage

    world, rank, size, local_rank = init_mpi()

    def body() -> int:
        from boostmpi.config import load_config
        from boostmpi.parallel.startup import check_memory, check_mpi

        check_mpi(world, rank, local_rank)  # prints the MPI library and transport; refuses a wrong MPI

        cfg = load_config(args.config, overrides=args.set, world_size=size)
        stage("config")
        from boostmpi.parallel.comm import HostCollectives, configure_watchdog

        configure_watchdog(cfg.parallel.watchdog_s)  # from here on, a collective that waits too long ends the job
        from boostmpi.train.trainer import Trainer, prepare_builtin

        if rank == 0:
            print(banner(cfg, args.config, size, local_rank), flush=True)
        from boostmpi.sim.model import memory_estimate

        # a model too big for a rank's memory stops here, before any allocation
        check_memory(cfg, world, local_rank, lambda: memory_estimate(cfg))
        stage("memory")
        try:
            try:
                prepare_builtin(cfg, rank == 0)
            except OSError as exc:
                raise fs_error(exc, "cannot prepare the built-in corpus in data.builtin_dir") from exc
        except UserError as exc:  # rank 0 alone: the job is ended from here (run_guarded)
            exc.all_ranks = False
            raise
        HostCollectives(world).barrier()
        try:
            trainer = Trainer(cfg, world, resume=args.resume, config_path=args.config, local_rank=local_rank)
            # a diverging run overflows before its loss is checked: NumPy's warnings would bury
            # the one-line error that the loss check raises, naming the step
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                result = trainer.train()
        except UserError as exc:
            # data and checkpoint problems may be seen by some ranks only: end the job from here
            exc.all_ranks = getattr(exc, "all_ranks", world is None)
            raise
        if result["preempted"]:  # the trainer printed the one line saying so
            return STOPPED_EARLY_EXIT
        if rank == 0:
            print(f"done: step {result['step']}; results in {cfg.train.run_dir} "
                  f"(metrics.jsonl, config.toml, checkpoints/)", flush=True)
        return 0

    return run_guarded(body, world, rank)


def banner(cfg: Config, config_path: str, size: int, local_rank: int) -> str:
    from boostmpi.parallel.launch import mpi_library

    par, tr, m = cfg.parallel, cfg.train, cfg.model
    backend = "numpy (cpu)" if tr.device == "cpu" else "cupy (gpu)"
    # what the configuration asks for: on a GPU, "auto" (and "nccl") are settled when start-up builds the
    # process grid, and the `comm:` line (or a warning) says what was chosen
    comm = "mpi" if tr.device == "cpu" else par.comm
    pp = f"{par.pp} ({par.virtual_stages} chunks each, interleaved)" if par.virtual_stages > 1 else par.pp
    return (f"boostmpi | {backend} | {mpi_library()} | comm {comm} | ranks {size} = tp {par.tp} x pp {pp} x dp {par.dp} "
            f"({par.tp_mode}) | {m.arch} d={m.d_model} L={m.n_layers} r={m.rank} | {tr.dtype} | config {config_path}")
