"""llm.c token shards: write, open, evaluation windows, the training stream.

A shard is a header of 256 little-endian int32 (magic, version, token count, then zeros)
followed by the tokens. llm.c has two such formats (its dev/data/data_common.py, HEADERS_INFO):
"gpt-2", magic 20240520 version 1, little-endian uint16 tokens; and "llama-3", magic 20240801
version 7, little-endian uint32 tokens. A vocabulary of up to 65,536 ids is written in the
first, a larger one in the second; readers take either. Shards are memory-mapped: nothing here
loads a whole shard into RAM.

Letters: T sequence length, B sequences per micro-batch (per data-parallel rank).
"""

import glob
import os
from collections.abc import Sequence
from typing import NotRequired, TypedDict

import numpy as np

from boostmpi.arrays import Array
from boostmpi.errors import DataError
from boostmpi.files import atomic_file

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
HEADER_DTYPE = np.dtype("<i4")
# (magic, version) -> token dtype: llm.c's "gpt-2" and "llama-3" headers
FORMATS: dict[tuple[int, int], np.dtype[np.unsignedinteger]] = {(20240520, 1): np.dtype("<u2"), (20240801, 7): np.dtype("<u4")}
NARROW, WIDE = (20240520, 1), (20240801, 7)
MAX_TOKEN_ID = {NARROW: 2**16 - 1, WIDE: 2**32 - 1}
MAX_SHARD_TOKENS = 2**31 - 1  # the count is an int32 in the header


def shard_format(vocab_size: int) -> tuple[int, int]:
    """The (magic, version) of the shards for a vocabulary: uint16 up to 65,536 ids, uint32 above."""
    return NARROW if vocab_size <= MAX_TOKEN_ID[NARROW] + 1 else WIDE


def token_dtype(vocab_size: int) -> np.dtype[np.unsignedinteger]:
    """The dtype that shards of a vocabulary store their ids in."""
    return FORMATS[shard_format(vocab_size)]


def write_shard(path: str | os.PathLike[str], tokens: Array, vocab_size: int | None = None) -> None:
    """Write `tokens` as one shard, atomically: a reader sees the old file or the new one.

    The format follows `vocab_size` (see `shard_format`); without it, the ids themselves decide.
    """
    path = os.fspath(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise DataError(f"cannot write {path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"cannot write {path}: token ids must be integers, got {tokens.dtype}")
    if tokens.size > MAX_SHARD_TOKENS:
        raise DataError(f"cannot write {path}: {tokens.size} tokens exceed the {MAX_SHARD_TOKENS} a shard header can count")
    low, high = (int(tokens.min()), int(tokens.max())) if tokens.size else (0, 0)
    fmt = shard_format(high + 1 if vocab_size is None else vocab_size)
    dtype = FORMATS[fmt]
    if low < 0 or high > MAX_TOKEN_ID[fmt]:
        bad = low if low < 0 else high
        raise DataError(f"cannot write {path}: token id {bad} does not fit a {dtype.name} shard (0..{MAX_TOKEN_ID[fmt]})")
    header = np.zeros(HEADER_INTS, dtype=HEADER_DTYPE)
    header[0], header[1], header[2] = fmt[0], fmt[1], tokens.size

    with atomic_file(path, "wb") as f:
        # file.write, not ndarray.tofile: tofile reports a full disk without its errno
        f.write(header.data.cast("B"))
        f.write(np.ascontiguousarray(tokens, dtype=dtype).data.cast("B"))


def open_shard(path: str | os.PathLike[str], vocab_size: int | None = None) -> Array:
    """The tokens of a shard as a read-only uint16 or uint32 memmap (an empty array for an empty shard).

    Checks the header against the file size, and with `vocab_size` that every id is below it.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"token shard {path} does not exist")
    if not os.path.isfile(path):
        raise DataError(f"token shard {path} is not a regular file")
    file_bytes = os.path.getsize(path)
    if file_bytes < HEADER_BYTES:
        raise DataError(f"{path} is not a token shard: {file_bytes} bytes is shorter than the {HEADER_BYTES}-byte header")
    try:
        header = np.fromfile(path, dtype=HEADER_DTYPE, count=HEADER_INTS)
    except OSError as exc:
        raise DataError(f"cannot read token shard {path}: {exc.strerror or exc}") from exc
    magic, version, n_tokens = (int(v) for v in header[:3])
    dtype = FORMATS.get((magic, version))
    if dtype is None:
        known = " or ".join(f"magic {m} version {v}" for m, v in FORMATS)
        if magic not in {m for m, _ in FORMATS}:
            raise DataError(f"{path} is not an llm.c token shard (magic number {magic}, expected {known})")
        raise DataError(f"{path}: unsupported token shard version {version} with magic {magic} (expected {known})")
    expected_bytes = HEADER_BYTES + dtype.itemsize * n_tokens
    if n_tokens < 0 or file_bytes < expected_bytes:
        raise DataError(
            f"{path} is truncated: its header announces {n_tokens} tokens ({expected_bytes} bytes) "
            f"but the file has {file_bytes} bytes"
        )
    if file_bytes > expected_bytes:
        raise DataError(
            f"{path} is corrupted: {file_bytes - expected_bytes} bytes follow the {n_tokens} tokens its header announces"
        )
    if n_tokens == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=dtype)
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))
    if vocab_size is not None:
        top = int(tokens.max())
        if top >= vocab_size:
            first = int(np.argmax(tokens >= vocab_size))
            raise DataError(
                f"{path} holds token id {top} (first out-of-range id at token {first}) but the vocabulary has "
                f"{vocab_size} ids: the shard was made with another tokenizer"
            )
    return tokens


def resolve_shards(pattern: str | os.PathLike[str]) -> list[str]:
    """The shard files that a path or glob names, sorted; an error naming the pattern if there are none."""
    pattern = os.path.expanduser(os.fspath(pattern))
    if os.path.isfile(pattern):
        return [pattern]
    matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    if not matches:
        raise DataError(f"no token shards match {pattern!r}")
    return matches


def window_count(n_tokens: int, T: int) -> int:
    """How many windows of T+1 tokens, stride T, fit in n_tokens: the largest k+1 with kT+T+1 <= n."""
    return max(0, (n_tokens - 1) // T)


def eval_windows(tokens: Array, T: int, max_windows: int | None = None, name: str | None = None) -> tuple[Array, Array]:
    """The evaluation windows of a shard as int64 arrays x, y of shape [n, T].

    x[k] = tokens[kT : kT+T], y[k] = tokens[kT+1 : kT+T+1], for every k with kT+T+1 <= len(tokens),
    at most `max_windows` of them.
    """
    if T < 1:
        raise DataError(f"sequence length must be at least 1, got {T}")
    if max_windows is not None and max_windows < 1:
        raise DataError(f"max_windows must be at least 1, got {max_windows}")
    n = window_count(len(tokens), T)
    if n == 0:
        what = f"shard {name}" if name else "the shard"
        raise DataError(f"{what} holds {len(tokens)} tokens, fewer than one window of seq_len + 1 = {T + 1}")
    if max_windows is not None:
        n = min(n, max_windows)
    x = np.asarray(tokens[: n * T], dtype=np.int64).reshape(n, T)
    y = np.asarray(tokens[1 : n * T + 1], dtype=np.int64).reshape(n, T)
    return x, y


class LoaderState(TypedDict):
    """`TrainLoader.state_dict()`: the stream position, saved beside a checkpoint."""

    next_window: int
    epoch: int
    windows_per_epoch: int
    seq_len: int
    fingerprint: NotRequired[int]  # older checkpoints have none


class TrainLoader:
    """Micro-batches for data-parallel rank `rank` of `world`, deterministic and exactly resumable.

    The global stream is every window of T+1 tokens (stride T, as in `eval_windows`) of each
    shard in turn; it wraps around to the first shard at the end (a new epoch). Global batch k
    is windows [k*world*B, (k+1)*world*B) of the stream and rank r takes its contiguous slice
    of B windows. The position is one global window index, the same on every rank, so a saved
    state resumes exactly, even under another dp size. With `shuffle`, epoch e visits the windows
    in the order of a permutation drawn from (seed, e): still one global stream, so resuming stays
    exact; without it the order is the files' (llm.c style).
    """

    def __init__(self, paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], T: int, batch_size: int,
                 rank: int = 0, world: int = 1, seed: int = 0, vocab_size: int | None = None,
                 shuffle: bool = False) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = resolve_shards(paths)
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise DataError("no training shards given")
        if T < 1 or batch_size < 1:
            raise DataError(f"seq_len and batch size must be at least 1, got {T} and {batch_size}")
        if not 0 <= rank < world:
            raise DataError(f"data-parallel rank {rank} is outside 0..{world - 1}")
        self.paths = paths
        self.T, self.B, self.rank, self.world, self.seed = T, batch_size, rank, world, seed
        self.shards = [open_shard(p, vocab_size) for p in paths]
        self.shard_windows = [window_count(len(s), T) for s in self.shards]
        # first global window index of each shard; shards too short for one window are skipped
        self.first_window = np.concatenate([[0], np.cumsum(self.shard_windows)]).astype(np.int64)
        self.windows_per_epoch = int(self.first_window[-1])
        needed = world * batch_size
        if self.windows_per_epoch < needed:
            where = paths[0] if len(paths) == 1 else f"{len(paths)} shards ({paths[0]} ...)"
            raise DataError(
                f"training data {where} holds {self.windows_per_epoch} windows of seq_len + 1 = {T + 1} tokens "
                f"but one global batch needs {needed} (dp {world} x micro-batch {batch_size})"
            )
        self.next_window = 0  # global index of the first window of the next global batch
        self.shuffle = shuffle
        self._order: tuple[int | None, Array] = (None, None)  # (epoch, permutation of the epoch's windows)

    @property
    def epoch(self) -> int:
        return self.next_window // self.windows_per_epoch

    def next_batch(self) -> tuple[Array, Array]:
        """(x, y) int64 [B, T] for this rank; advances the stream by one global batch."""
        B, T = self.B, self.T
        x = np.empty((B, T), dtype=np.int64)
        y = np.empty((B, T), dtype=np.int64)
        start = self.next_window + self.rank * B
        filled = 0
        while filled < B:
            stream_index = start + filled
            window = stream_index % self.windows_per_epoch
            if self.shuffle:  # one window at a time, in this epoch's order
                window, run = int(self._permutation(stream_index // self.windows_per_epoch)[window]), 1
            shard = int(np.searchsorted(self.first_window, window, side="right")) - 1
            local = window - int(self.first_window[shard])
            if not self.shuffle:  # one contiguous run of windows per shard touched
                run = min(B - filled, self.shard_windows[shard] - local, self.windows_per_epoch - window)
            chunk = np.asarray(self.shards[shard][local * T : (local + run) * T + 1], dtype=np.int64)
            x[filled : filled + run] = chunk[:-1].reshape(run, T)
            y[filled : filled + run] = chunk[1:].reshape(run, T)
            filled += run
        self.next_window += self.world * B
        return x, y

    def _permutation(self, epoch: int) -> Array:
        if self._order[0] != epoch:
            rng = np.random.default_rng([int(self.seed), int(epoch)])
            self._order = (epoch, rng.permutation(self.windows_per_epoch))
        return self._order[1]

    FINGERPRINT_TOKENS = 4096

    @property
    def fingerprint(self) -> int:
        """What tells these shards from others with as many windows, cheaply at any size: SHA-256 of each
        shard's token count and its first and last FINGERPRINT_TOKENS tokens, in order (not its path, so
        shards may move)."""
        if getattr(self, "_fingerprint", None) is None:
            import hashlib

            h, n = hashlib.sha256(), self.FINGERPRINT_TOKENS
            for shard in self.shards:
                h.update(np.int64(len(shard)).tobytes())
                h.update(np.ascontiguousarray(shard[:n], dtype=np.uint32).tobytes())
                h.update(np.ascontiguousarray(shard[-n:], dtype=np.uint32).tobytes())
            self._fingerprint = int(h.hexdigest()[:15], 16)  # a plain int, like the rest of the position
        return self._fingerprint

    def state_dict(self) -> LoaderState:
        """The position and the shards' fingerprint, as plain ints (store it beside a checkpoint)."""
        return {
            "next_window": int(self.next_window),
            "epoch": int(self.epoch),
            "windows_per_epoch": self.windows_per_epoch,
            "seq_len": self.T,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: LoaderState) -> None:
        """Restore a position from `state_dict()`; the shards and seq_len must be the ones it was saved with."""
        if int(state["seq_len"]) != self.T or int(state["windows_per_epoch"]) != self.windows_per_epoch:
            raise DataError(
                f"the saved data position is for {state['windows_per_epoch']} windows of seq_len {state['seq_len']}, "
                f"but the training shards now hold {self.windows_per_epoch} windows of seq_len {self.T}: "
                f"resuming would not continue the same stream"
            )
        if "fingerprint" in state and state["fingerprint"] != self.fingerprint:  # older checkpoints have none
            raise DataError(
                f"the saved data position is for other training shards (as many windows, {self.windows_per_epoch}, "
                f"but other tokens: fingerprint {state['fingerprint']}, these shards {self.fingerprint}): resuming "
                f"would not continue the same stream"
            )
        self.next_window = int(state["next_window"])
