"""`boostmpi <command>`: one entry point, one subcommand per module.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func` to a callable `run(args) -> int`. Modules are imported only when the command
line names them, so `boostmpi sim` never imports MPI and `boostmpi data` never imports h5py.
"""

import argparse
import importlib
import os
import sys

from boostmpi.errors import UserError

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


def build_parser(only=None):
    parser = argparse.ArgumentParser(prog="boostmpi", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=f"(see boostmpi {name} --help)")
            continue
        importlib.import_module(module).register(sub)
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        build_parser(only="__none__").print_help(sys.stderr)
        if command is not None:
            print(f"error: unknown command {command!r}", file=sys.stderr)
        return 2
    parser = build_parser(only=command)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse prints its own one-line error
        return 0 if exc.code == 0 else 2
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
