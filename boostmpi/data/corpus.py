"""Text corpora into train/val shards, and the built-in corpus every machine has.

`write_dataset` turns documents into `train_000000.bin ...`, `val_000000.bin ...` and
`tokenizer.json`. Every document is preceded by the tokenizer's end-of-text id. The split
is by document and deterministic: document i goes to val when floor((i+1) f) > floor(i f),
i.e. every 1/f-th one (f = val_fraction). With fewer documents than that (one large text
file, say), val is instead the last fraction f of the token stream.

Files are read and tokenized in pieces of about 16 MB cut after a newline, so a file of
any size streams through in bounded memory (a BPE tokenizer sees the same words, since
its pre-tokenizer splits at whitespace anyway).

The built-in corpus is the Python standard library that ships with the interpreter: its
*.py files (sorted, test folders and site-packages left out) up to a byte budget, 8 MB by
default, tokenized with the byte tokenizer. The same interpreter version gives the same
corpus. `ensure_builtin` prepares it once per folder and is safe to call from several
processes at once: each builds in a temporary folder and renames it into place; the
folder's completion marker `builtin.json` is written last.
"""

import codecs
import json
import os
import platform
import shutil
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypedDict

import numpy as np

from boostmpi.arrays import Array
from boostmpi.data.progress import Progress
from boostmpi.data.tokenizer import Tokenizer

from boostmpi.data.shards import open_shard, token_dtype, write_shard
from boostmpi.files import atomic_file
from boostmpi.data.tokenizer import ByteTokenizer, save_tokenizer
from boostmpi.errors import DataError

DEFAULT_VAL_FRACTION = 0.02
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_BUILTIN_BYTES = 8_000_000
READ_PIECE_BYTES = 16 * 2**20
BUILTIN_MARKER = "builtin.json"
SKIPPED_STDLIB_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def shard_globs(out_dir: str) -> tuple[str, str]:
    """(train glob, val glob) of the shards `write_dataset` writes into `out_dir`."""
    return os.path.join(out_dir, "train_*.bin"), os.path.join(out_dir, "val_*.bin")


class NotUtf8Error(DataError):
    """A file that is not UTF-8 text."""


def read_text_pieces(path: str, limit: int | None = None, on_bytes: Callable[[int], None] | None = None,
                     piece_bytes: int = READ_PIECE_BYTES) -> Iterator[str]:
    """The text of a UTF-8 file, at most `limit` bytes, in pieces that end after a newline where
    one is near. `on_bytes(n)` is told of every n bytes read. A character cut by the limit is dropped."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, offset = "", 0
    try:
        with open(path, "rb") as f:
            while limit is None or offset < limit:
                data = f.read(piece_bytes if limit is None else min(piece_bytes, limit - offset))
                if not data:
                    break
                offset += len(data)
                if on_bytes is not None:
                    on_bytes(len(data))
                try:
                    text = carry + decoder.decode(data, final=False)
                except UnicodeDecodeError as exc:
                    raise NotUtf8Error(f"{path} is not UTF-8 text (byte {offset - len(data) + exc.start} is invalid)") from exc
                cut = text.rfind("\n") + 1 or (len(text) if len(text) >= piece_bytes else 0)
                if cut:
                    yield text[:cut]
                carry = text[cut:]
            if limit is None or offset < limit:  # the whole file was read: a dangling partial character is an error
                try:
                    decoder.decode(b"", final=True)
                except UnicodeDecodeError as exc:
                    raise NotUtf8Error(f"{path} is not UTF-8 text (it ends inside a character)") from exc
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if carry:
        yield carry


class InputReader:
    """Text files as documents (each an iterable of text pieces), `max_bytes` in all.

    A file that turns out not to be UTF-8 before any of its text was used is skipped and
    listed in `skipped`, unless it was `named` (given by the user directly): then it is an error.
    """

    def __init__(self, files: Sequence[tuple[str, bool]], max_bytes: int | None = None, progress: Progress | None = None,
                 piece_bytes: int = READ_PIECE_BYTES) -> None:
        self.files = files  # [(path, named)]
        self.remaining = max_bytes
        self.progress = progress
        self.piece_bytes = piece_bytes
        self.skipped: list[str] = []

    def documents(self) -> Iterator[Iterator[str]]:
        for path, named in self.files:
            if self.remaining is not None and self.remaining <= 0:
                return
            yield self._document(path, named)

    def _document(self, path: str, named: bool) -> Iterator[str]:
        started = False
        try:
            for piece in read_text_pieces(path, self.remaining, self._count, self.piece_bytes):
                started = True
                yield piece
        except NotUtf8Error:
            if named or started:
                raise
            self.skipped.append(path)

    def _count(self, n_bytes: int) -> None:
        if self.progress is not None:
            self.progress.update(n_bytes)
        if self.remaining is not None:
            self.remaining -= n_bytes


class ShardStream:
    """Cuts a stream of tokens into `<prefix>_000000.bin`, ... of `shard_tokens` tokens (the last shorter)."""

    def __init__(self, out_dir: str, prefix: str, shard_tokens: int, vocab_size: int) -> None:
        self.out_dir, self.prefix, self.shard_tokens = out_dir, prefix, shard_tokens
        self.vocab_size, self.dtype = vocab_size, token_dtype(vocab_size)
        self.pieces: list[Array] = []
        self.buffered = 0
        self.total = 0
        self.written: list[tuple[str, int]] = []  # (path, token count)

    def add(self, tokens: Array) -> None:
        self.pieces.append(np.asarray(tokens, dtype=self.dtype))
        self.buffered += len(tokens)
        self.total += len(tokens)
        while self.buffered >= self.shard_tokens:
            self._write(self.shard_tokens)

    def pop_tail(self, n_tokens: int) -> Array:
        """Take back the last n_tokens added, reading back written shards if the buffer holds fewer."""
        while self.buffered < n_tokens and self.written:
            path, count = self.written.pop()
            self.pieces.insert(0, np.array(open_shard(path)))  # a copy: the file goes next
            os.remove(path)
            self.buffered += count
        stream = np.concatenate(self.pieces) if self.pieces else np.zeros(0, dtype=self.dtype)
        keep = len(stream) - n_tokens
        self.pieces = [stream[:keep]] if keep else []
        self.buffered = keep
        self.total -= n_tokens
        return stream[keep:]

    def close(self) -> list[tuple[str, int]]:
        if self.buffered:  # fewer than shard_tokens, also after pop_tail
            self._write(self.buffered)
        return self.written

    def _write(self, n_tokens: int) -> None:
        stream = np.concatenate(self.pieces)
        path = os.path.join(self.out_dir, f"{self.prefix}_{len(self.written):06d}.bin")
        write_shard(path, stream[:n_tokens], self.vocab_size)
        self.written.append((path, n_tokens))
        rest = stream[n_tokens:]
        self.pieces = [rest] if len(rest) else []
        self.buffered = len(rest)


def is_val_document(index: int, val_fraction: float) -> bool:
    return int((index + 1) * val_fraction) > int(index * val_fraction)


class DatasetSummary(TypedDict):
    """What `write_dataset` wrote: the document count and each split's (shard path, token count)."""

    documents: int
    train: list[tuple[str, int]]
    val: list[tuple[str, int]]


def write_dataset(documents: Iterable[str | Iterable[str]], out_dir: str, tokenizer: Tokenizer,
                  val_fraction: float = DEFAULT_VAL_FRACTION, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> DatasetSummary:
    """Tokenize documents (each a str or an iterable of str pieces) into train/val shards and
    tokenizer.json in `out_dir`. Returns {"documents": n, "train": [(path, tokens), ...], "val": [...]}."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise DataError(f"shard size must be at least 1 token, got {shard_tokens}")
    os.makedirs(out_dir, exist_ok=True)
    eot = np.array([tokenizer.eot], dtype=token_dtype(tokenizer.vocab_size))
    train = ShardStream(out_dir, "train", shard_tokens, tokenizer.vocab_size)
    val = ShardStream(out_dir, "val", shard_tokens, tokenizer.vocab_size)

    n_documents = 0
    for document in documents:
        stream = None  # chosen at the first non-empty piece: an empty document is no document
        for piece in [document] if isinstance(document, str) else document:
            tokens = tokenizer.encode_array(piece)
            if len(tokens) == 0:
                continue
            if stream is None:
                stream = val if is_val_document(n_documents, val_fraction) else train
                stream.add(eot)
                n_documents += 1
            stream.add(tokens)
    if n_documents == 0:
        raise DataError("the input holds no text")
    if val_fraction > 0 and val.total == 0:  # too few documents for the rule to pick one
        val.add(train.pop_tail(max(1, round(val_fraction * train.total))))
    if train.total == 0:
        raise DataError(f"the input ({n_documents} document(s), {val.total} tokens) is too small to split into train and val")

    summary: DatasetSummary = {"documents": n_documents, "train": train.close(), "val": val.close()}
    save_tokenizer(tokenizer, out_dir)
    return summary


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def builtin_files(max_bytes: int = DEFAULT_BUILTIN_BYTES) -> list[str]:
    """The standard library's *.py files in sorted order, as many whole files as fit in max_bytes."""
    files: list[str] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(stdlib_dir()):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_STDLIB_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            size = os.path.getsize(path)
            if total + size > max_bytes:
                return files
            files.append(path)
            total += size
    return files


def _read_marker(out_dir: str) -> dict[str, object] | None:
    try:
        with open(os.path.join(out_dir, BUILTIN_MARKER)) as f:
            marker: dict[str, object] = json.load(f)
            return marker
    except (OSError, ValueError):
        return None


def _check_marker(marker: dict[str, object], out_dir: str, max_bytes: int) -> None:
    if marker.get("max_bytes") != max_bytes:
        raise DataError(
            f"{out_dir} holds the built-in corpus prepared with max_bytes={marker.get('max_bytes')}, "
            f"not {max_bytes}; remove it or choose another folder"
        )


def ensure_builtin(out_dir: str, max_bytes: int = DEFAULT_BUILTIN_BYTES) -> tuple[str, str]:
    """Prepare the built-in corpus in `out_dir` unless it is already there; (train glob, val glob)."""
    out_dir = os.path.abspath(out_dir)
    marker = _read_marker(out_dir)
    if marker is None and os.path.isdir(out_dir) and os.listdir(out_dir):
        marker = _read_marker(out_dir)  # a concurrent caller may have moved its folder in since the first look
        if marker is None:
            raise DataError(f"{out_dir} exists but holds no complete built-in corpus ({BUILTIN_MARKER} is missing); remove it or choose another folder")
    if marker is not None:
        _check_marker(marker, out_dir, max_bytes)
        return shard_globs(out_dir)
    files = builtin_files(max_bytes)
    if not files:
        raise DataError(f"no Python standard library files fit in max_bytes={max_bytes} (stdlib at {stdlib_dir()})")

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.", suffix=".tmp")
    try:
        reader = InputReader([(path, False) for path in files])
        summary = write_dataset(reader.documents(), tmp_dir, ByteTokenizer(), DEFAULT_VAL_FRACTION, DEFAULT_SHARD_TOKENS)
        marker = {
            "max_bytes": max_bytes,
            "python": platform.python_version(),
            "stdlib": stdlib_dir(),
            "files": len(files) - len(reader.skipped),
            "documents": summary["documents"],
            "train_tokens": sum(n for _, n in summary["train"]),
            "val_tokens": sum(n for _, n in summary["val"]),
            "tokenizer": "byte",
        }
        with atomic_file(os.path.join(tmp_dir, BUILTIN_MARKER)) as f:
            json.dump(marker, f, indent=2)
            f.write("\n")
        os.chmod(tmp_dir, 0o755)  # mkdtemp makes the folder private; the corpus is shared data
        try:
            os.replace(tmp_dir, out_dir)  # atomic; replaces a missing or empty folder only
        except OSError as exc:
            if _read_marker(out_dir) is None:  # not a concurrent caller that finished first
                raise DataError(f"cannot move the prepared built-in corpus into {out_dir}: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    marker = _read_marker(out_dir)
    if marker is None:  # removed or damaged by another process since it was moved into place
        raise DataError(f"{out_dir} holds no complete built-in corpus ({BUILTIN_MARKER} is missing or unreadable); "
                        f"remove it or choose another folder")
    _check_marker(marker, out_dir, max_bytes)
    return shard_globs(out_dir)
