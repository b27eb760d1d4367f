"""`boostmpi <command>`: one entry point, one subcommand per module.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func` to a callable `run(args) -> int`. Modules are imported only when the command
line names them, so `boostmpi sim` never imports MPI and `boostmpi data` never imports h5py.
"""

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

from boostmpi.errors import UserError
from boostmpi.parallel.startup import set_host_threads  # imports no NumPy

if TYPE_CHECKING:
    # what each command module's `register` is handed (argparse's class is generic only to a type checker)
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

# command name -> module that registers it
COMMANDS = {
    "train": "boostmpi.train.cli",
    "eval": "boostmpi.tools.evaluate",
    "inspect": "boostmpi.tools.inspect",
    "data": "boostmpi.data.prepare",
    "sim": "boostmpi.sim.cli",
    "calibrate": "boostmpi.sim.calibrate",
    "generate": "boostmpi.tools.generate",
    "export": "boostmpi.tools.export",
    "plot": "boostmpi.tools.plot",
}


DESCRIPTION = ("Train low-rank bottleneck language models with bottleneck-aware 3D parallelism (NumPy/CuPy,\n"
               "MPI), and evaluate, inspect, sample, export and model them.")
EPILOG = """\
Run `boostmpi COMMAND --help` for a command's options. Under mpiexec or srun, `train` runs on
every rank; the other commands run on one process.

exit status: 0 success; 2 bad input (configuration, data, checkpoint, command line, filesystem),
one line `error: ...`; 1 an internal failure; train only: 75 stopped early by a signal, with a
checkpoint to resume from."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command name and its description on one line."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=20, width=100)
        self._action_max_length = 18  # room for the longest command name at the commands' indentation


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command-line parser; with `only`, the other commands' modules are not imported."""
    parser = argparse.ArgumentParser(prog="boostmpi", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"boostmpi {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name)
            continue
        importlib.import_module(module).register(sub)
    return parser


def version() -> str:
    try:
        from importlib.metadata import version as installed_version

        return installed_version("boostmpi")
    except Exception:  # noqa: BLE001 - run from a checkout without installing
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (130 after Ctrl-C, also while the command's
    modules are still being imported)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130


def _main(argv: Sequence[str] | None) -> int:
    # first, before anything imports NumPy: under mpiexec/srun, one share of the node's cores per rank
    set_host_threads()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "help":  # `boostmpi help [COMMAND]`
        argv = [a for a in argv if a != "help"] + ["--help"]
        command = next((a for a in argv if not a.startswith("-")), None)
    if command is None:
        if any(a in ("-h", "--help", "--version") for a in argv):
            return _parse_and_run(build_parser(), argv)
        build_parser().print_help(sys.stderr)
        print("error: no command given", file=sys.stderr)
        return 2
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; the commands are {', '.join(COMMANDS)} "
              f"(boostmpi --help describes them)", file=sys.stderr)
        return 2
    return _parse_and_run(build_parser(only=command), argv)


def _parse_and_run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help and --version exit 0; argparse prints its own one-line error
        return 0 if not exc.code else 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a path the filesystem refused, or a full disk: a one-line error, not a traceback
        from boostmpi.files import fs_error, is_out_of_space

        full = is_out_of_space(exc)
        if exc.filename is None and not full:
            raise
        print(f"error: {fs_error(exc, 'cannot write' if full else 'cannot use')}", file=sys.stderr)
        return 2
