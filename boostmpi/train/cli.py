"""`boostmpi train --config FILE [--set section.key=value ...] [--resume CHECKPOINT]`."""

import signal

import numpy as np

from boostmpi.errors import UserError


def register(subparsers):
    p = subparsers.add_parser("train", help="train a model (run under mpiexec/srun for several ranks)")
    p.add_argument("--config", required=True, help="TOML configuration file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a configuration key")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT",
                   help="resume from this checkpoint (default: the run directory's latest complete one, if any)")
    p.set_defaults(func=run)


def run(args):
    from boostmpi.parallel.launch import STOP_SIGNALS, init_mpi, run_guarded

    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    world, rank, size, local_rank = init_mpi()

    def body():
        from boostmpi.config import load_config
        from boostmpi.parallel.startup import check_mpi

        check_mpi(world, rank, local_rank)  # prints the MPI library and transport; refuses a wrong MPI

        cfg = load_config(args.config, overrides=args.set, world_size=size)
        from boostmpi.train.trainer import Trainer, prepare_builtin

        if rank == 0:
            print(banner(cfg, args.config, size, local_rank), flush=True)
        try:
            prepare_builtin(cfg, rank == 0)
        except UserError as exc:
            exc.all_ranks = False
            raise
        if world is not None:
            world.Barrier()
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
        if rank == 0:
            print(f"done: step {result['step']}; results in {cfg.train.run_dir} "
                  f"(metrics.jsonl, config.toml, checkpoints/)", flush=True)
        return 0

    try:
        return run_guarded(body, world, rank)
    finally:
        # init_mpi and the trainer take over the stop signals; a caller in this process (a test) gets
        # its own handlers back, or `timeout` could no longer end it
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def banner(cfg, config_path, size, local_rank):
    from boostmpi.parallel.launch import mpi_library

    par, tr, m = cfg.parallel, cfg.train, cfg.model
    backend = "numpy (cpu)" if tr.device == "cpu" else "cupy (gpu)"
    nccl = "no" if tr.device == "cpu" or par.comm == "mpi" else "yes"
    return (f"boostmpi | {backend} | {mpi_library()} | nccl {nccl} | ranks {size} = tp {par.tp} x pp {par.pp} x dp {par.dp} "
            f"({par.tp_mode}) | {m.arch} d={m.d_model} L={m.n_layers} r={m.rank} | {tr.dtype} | config {config_path}")
