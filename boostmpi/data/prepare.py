"""`boostmpi data`: tokenize text files, folders or the built-in corpus into llm.c token shards.

Writes `<out>/train_000000.bin ...`, `<out>/val_000000.bin ...` and `<out>/tokenizer.json`, all
at once: everything is made in a hidden temporary folder beside `<out>` and moved into place only
when complete (a rename of the folder when `<out>` is new or empty; otherwise the files move in one
by one after the old shards are removed, `tokenizer.json` last, the set's completion mark). A failed
or interrupted run leaves `<out>` as it was, and at most its temporary folder, which the next run
into `<out>` removes.
Folders are read recursively in sorted order, hidden files and folders left out; each file
is one document. Files found in folders that are not UTF-8 text are skipped (and counted);
a file named on the command line that is not UTF-8 is an error.
"""

import argparse
import fnmatch
import glob
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Literal, NoReturn

from boostmpi.data.corpus import (
    DEFAULT_BUILTIN_BYTES,
    DEFAULT_SHARD_TOKENS,
    DEFAULT_VAL_FRACTION,
    InputReader,
    builtin_files,
    shard_globs,
    write_dataset,
)
from boostmpi.data.progress import Progress
from boostmpi.data.tokenizer import HF_COPY_FILE, TOKENIZER_FILE, tokenizer_from_name
from boostmpi.errors import DataError, UserError
from boostmpi.files import check_dir_creatable, fs_error, make_dirs

DATA_TMP_SUFFIX = ".data-tmp"  # the temporary folders a run builds its shard set in


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser(
        "data",
        help="tokenize text into llm.c token shards",
        description="Tokenize text files, folders or the built-in corpus into llm.c token shards.",
    )
    parser.add_argument("inputs", nargs="*", help="text files or folders (read recursively)")
    parser.add_argument("--builtin", action="store_true", help="use the built-in corpus (the Python standard library's source) instead of inputs")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the shards")
    parser.add_argument("--tokenizer", default="byte", help="byte (default), a tiktoken encoding such as gpt2, or PATH.json (a Hugging Face tokenizers file)")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, help="fraction of documents for validation (default %(default)s)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard (default %(default)s)")
    parser.add_argument("--glob", default=None, metavar="PATTERN", help='only files in folders whose name matches, e.g. "*.txt" (default: every UTF-8 text file)')
    parser.add_argument("--max-bytes", type=int, default=None, help=f"read at most this many bytes of text (default: all; {DEFAULT_BUILTIN_BYTES} for --builtin)")
    parser.add_argument("--force", action="store_true", help="replace shards already in --out")
    parser.set_defaults(func=run)


def find_input_files(inputs: Sequence[str], pattern: str | None = None,
                     exclude_dir: str | None = None) -> list[tuple[str, bool]]:
    """[(path, named)] for the inputs; `named` is true for a file given directly rather than found in a folder."""
    exclude_dir = os.path.abspath(exclude_dir) if exclude_dir else None

    def folder_error(exc: OSError) -> NoReturn:
        raise DataError(f"cannot read folder {exc.filename}: {exc.strerror or exc}")

    files: list[tuple[str, bool]] = []
    for item in inputs:
        if os.path.isfile(item):
            files.append((item, True))
        elif os.path.isdir(item):
            for dirpath, dirnames, filenames in os.walk(item, onerror=folder_error):
                dirnames[:] = sorted(
                    d for d in dirnames if not d.startswith(".") and os.path.abspath(os.path.join(dirpath, d)) != exclude_dir
                )
                for name in sorted(filenames):
                    path = os.path.join(dirpath, name)
                    if name.startswith(".") or (pattern and not fnmatch.fnmatch(name, pattern)) or not os.path.isfile(path):
                        continue
                    files.append((path, False))
        elif os.path.exists(item):
            raise DataError(f"input {item} is neither a regular file nor a folder")
        else:
            raise DataError(f"input {item} does not exist")
    if not files:
        matching = f" matching {pattern!r}" if pattern else ""
        raise DataError(f"no input files{matching} in {', '.join(inputs)}")
    return files


def shard_set_files(out_dir: str) -> list[str]:
    """The files of a shard set in `out_dir`: shards, then the tokenizer files, completion mark last."""
    train_glob, val_glob = shard_globs(out_dir)
    found = sorted(glob.glob(train_glob)) + sorted(glob.glob(val_glob))
    return found + [p for p in (os.path.join(out_dir, HF_COPY_FILE), os.path.join(out_dir, TOKENIZER_FILE)) if os.path.exists(p)]


def check_out_dir(out_dir: str, force: bool) -> None:
    """Refuse an --out that cannot be written, or that holds shards unless `force`."""
    check_dir_creatable(out_dir, "--out")
    if shard_set_files(out_dir) and not force:
        raise DataError(f"--out {out_dir} already holds shards; pass --force to replace them")


def temporary_out_dir(out_dir: str) -> str:
    """A new hidden folder beside `out_dir` to build the shards in; stale ones of killed runs go first."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    make_dirs(parent, "--out")
    prefix = f".{os.path.basename(os.path.abspath(out_dir))}."
    for stale in glob.glob(os.path.join(parent, glob.escape(prefix) + "*" + DATA_TMP_SUFFIX)):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        return tempfile.mkdtemp(dir=parent, prefix=prefix, suffix=DATA_TMP_SUFFIX)
    except OSError as exc:
        raise fs_error(exc, "cannot create a temporary folder for --out", parent) from exc


def move_into_place(tmp_dir: str, out_dir: str) -> None:
    """Put the complete shard set of `tmp_dir` at `out_dir`, replacing the shards there."""
    os.chmod(tmp_dir, 0o777 & ~_umask())  # mkdtemp makes the folder private; shards are shared data
    try:
        if not os.path.isdir(out_dir) or not os.listdir(out_dir):
            os.replace(tmp_dir, out_dir)  # atomic; replaces a missing or empty folder
            return
        for path in shard_set_files(out_dir):  # old shards beyond the new last one would join the glob
            os.remove(path)
        for path in shard_set_files(tmp_dir):  # tokenizer.json last: the set is complete once it is there
            os.replace(path, os.path.join(out_dir, os.path.basename(path)))
    except OSError as exc:
        raise fs_error(exc, "cannot move the new shards into --out", out_dir) from exc


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run(args: argparse.Namespace) -> int:
    if args.builtin and args.inputs:
        raise UserError("give either input files/folders or --builtin, not both")
    if not args.builtin and not args.inputs:
        raise UserError("no input: give text files or folders, or --builtin")
    if not 0 <= args.val_fraction < 1:
        raise UserError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.shard_tokens < 1:
        raise UserError(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise UserError(f"--max-bytes must be at least 1, got {args.max_bytes}")

    tokenizer = tokenizer_from_name(args.tokenizer)  # before any reading: a missing tokenizer fails fast
    if args.builtin:
        files = [(p, False) for p in builtin_files(args.max_bytes or DEFAULT_BUILTIN_BYTES)]
        if not files:
            raise UserError(f"no Python standard library file fits in --max-bytes {args.max_bytes}")
        max_bytes = None  # builtin_files already kept to the budget
    else:
        files = find_input_files(args.inputs, args.glob, exclude_dir=args.out)
        max_bytes = args.max_bytes
    total_bytes = sum(os.path.getsize(p) for p, _ in files)
    if max_bytes is not None:
        total_bytes = min(total_bytes, max_bytes)
    if total_bytes == 0:
        raise DataError(f"the input is empty ({len(files)} file(s), 0 bytes)")
    check_out_dir(args.out, args.force)

    tmp_dir = temporary_out_dir(args.out)
    try:
        with Progress(total=total_bytes, desc="tokenizing", unit="B") as progress:
            reader = InputReader(files, max_bytes, progress)
            try:
                summary = write_dataset(reader.documents(), tmp_dir, tokenizer, args.val_fraction, args.shard_tokens)
            except UserError as exc:  # name the files as the user will find them, in --out
                exc.args = (str(exc).replace(tmp_dir, os.path.abspath(args.out)),) + exc.args[1:]
                raise
            except OSError as exc:
                if isinstance(exc.filename, str):
                    exc.filename = exc.filename.replace(tmp_dir, os.path.abspath(args.out))
                raise
        move_into_place(tmp_dir, args.out)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    if reader.skipped:
        print(f"warning: skipped {len(reader.skipped)} file(s) that are not UTF-8 text, e.g. {reader.skipped[0]}", file=sys.stderr)

    train_glob, val_glob = shard_globs(args.out)
    print(f"{summary['documents']} document(s), tokenizer {tokenizer.name} (vocab {tokenizer.vocab_size}, end-of-text id {tokenizer.eot})")
    splits: tuple[tuple[Literal["train", "val"], str], ...] = (("train", train_glob), ("val", val_glob))
    for name, pattern in splits:
        shards = summary[name]
        if shards:
            print(f"{name}: {sum(n for _, n in shards):,} tokens in {len(shards)} shard(s): {pattern}")
    print(f"tokenizer recorded in {os.path.join(args.out, TOKENIZER_FILE)}")
    return 0
