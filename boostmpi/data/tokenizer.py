"""Tokenizers, and the record of which one made a set of shards.

`ByteTokenizer` (the default, no dependency): vocabulary 256, one id per UTF-8 byte.
Documents are separated by the end-of-text id 0 (the NUL byte), which `boostmpi data`
puts before every document, as llm.c does with GPT-2's <|endoftext|>. A NUL inside the
text itself therefore reads as a document boundary; text files practically never hold one.

Optional: `TiktokenTokenizer("gpt2")` (package `tiktoken`, its encoding cached offline) and
`HFTokenizer(path)` (package `tokenizers`, a tokenizer.json file).

Shards hold uint16 ids for a vocabulary of up to 65,536, uint32 above (boostmpi.data.shards);
a vocabulary beyond uint32 is refused. `save_tokenizer` writes
`tokenizer.json` next to the shards ({kind, name, vocab_size, eot}, plus `path` for a
Hugging Face file, which is copied beside it as `hf_tokenizer.json`);
`tokenizer_for_shards` reads it back, or gives the byte tokenizer where there is none.
"""

import json
import os
import re
import shutil
from collections.abc import Iterable
from typing import NotRequired, TypedDict

import numpy as np

from boostmpi.arrays import Array
from boostmpi.data.shards import MAX_TOKEN_ID, WIDE, resolve_shards, token_dtype
from boostmpi.errors import DataError, UserError
from boostmpi.files import atomic_file

TOKENIZER_FILE = "tokenizer.json"
HF_COPY_FILE = "hf_tokenizer.json"


class TokenizerSpec(TypedDict):
    """The record of a tokenizer in `tokenizer.json`."""

    kind: str
    name: str
    vocab_size: int
    eot: int
    path: NotRequired[str]  # a Hugging Face tokenizer's file


def _first_line(exc: BaseException, max_chars: int = 200) -> str:
    """A short one-line account of an exception from a library, for our one-line errors."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _describe_char(text: str, position: int) -> str:
    char = text[position]
    return f"character {char!r} (U+{ord(char):04X}) at position {position}"


def utf8_bytes(text: str) -> bytes:
    """`text` as UTF-8; a lone surrogate (which has no UTF-8 form) is an error naming it."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"cannot encode {_describe_char(text, exc.start)}: it has no UTF-8 form") from exc


class Tokenizer:
    """What every tokenizer has: kind, name, vocab_size, eot, encode, decode."""

    kind = ""
    name = ""
    vocab_size = 0
    eot = 0

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_array(self, text: str) -> Array:
        """`encode` as a uint16 or uint32 array, the form this vocabulary's shards store."""
        return np.asarray(self.encode(text), dtype=token_dtype(self.vocab_size))

    def _check_vocab(self) -> None:
        if self.vocab_size > MAX_TOKEN_ID[WIDE] + 1:
            raise UserError(
                f"tokenizer {self.name} has {self.vocab_size} ids, more than the {MAX_TOKEN_ID[WIDE] + 1} "
                f"that uint32 token shards can hold"
            )


class ByteTokenizer(Tokenizer):
    """One id per UTF-8 byte; id 0 (NUL) is the end-of-text separator."""

    kind = "byte"
    name = "byte"
    vocab_size = 256
    eot = 0

    def encode(self, text: str) -> list[int]:
        return list(utf8_bytes(text))

    def encode_array(self, text: str) -> Array:
        return np.frombuffer(utf8_bytes(text), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        array = np.asarray(ids, dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() > 255):
            bad = int(array.min()) if array.min() < 0 else int(array.max())
            raise UserError(f"id {bad} is not a byte: the byte tokenizer decodes ids 0..255")
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class TiktokenTokenizer(Tokenizer):
    """An OpenAI tiktoken encoding (e.g. "gpt2"); needs the package and the encoding cached offline."""

    kind = "tiktoken"

    def __init__(self, name: str = "gpt2") -> None:
        try:
            import tiktoken
        except ImportError as exc:
            raise UserError(f"tokenizer {name!r} needs the tiktoken package ({_first_line(exc)}); use --tokenizer byte") from exc
        try:
            self._encoding = tiktoken.get_encoding(name)
        except Exception as exc:  # noqa: BLE001 - unknown name, no network, no cache: all mean "not available"
            raise UserError(
                f"tiktoken encoding {name!r} is not available offline ({_first_line(exc)}); "
                f"set TIKTOKEN_CACHE_DIR to a folder that holds it, or use --tokenizer byte"
            ) from exc
        self.name = name
        self.vocab_size = self._encoding.n_vocab
        self.eot = self._encoding.eot_token
        self._check_vocab()

    def encode(self, text: str) -> list[int]:
        utf8_bytes(text)  # byte-level BPE represents all text except lone surrogates
        ids: list[int] = self._encoding.encode_ordinary(text)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        text: str = self._encoding.decode([int(i) for i in ids], errors="replace")
        return text


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` file. `eot`: the end-of-text id; found by its usual names if not given."""

    kind = "hf"
    EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")

    def __init__(self, path: str | os.PathLike[str], eot: int | None = None) -> None:
        try:
            import tokenizers
        except ImportError as exc:
            raise UserError(f"tokenizer {path} needs the tokenizers package ({_first_line(exc)}); use --tokenizer byte") from exc
        if not os.path.isfile(path):
            raise UserError(f"tokenizer file {path} does not exist")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(os.fspath(path))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exceptions for bad files
            raise UserError(f"cannot load tokenizer {path} ({_first_line(exc)})") from exc
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0  # ids may have gaps
        self._check_vocab()
        if eot is None:
            eot = next((vocab[t] for t in self.EOT_NAMES if t in vocab), None)
            if eot is None:
                raise UserError(f"tokenizer {path} has none of the end-of-text tokens {', '.join(self.EOT_NAMES)}")
        if not 0 <= int(eot) < self.vocab_size:
            raise UserError(f"end-of-text id {eot} is outside the vocabulary of tokenizer {path}")
        self.eot = int(eot)
        self._unk_token = getattr(self._tokenizer.model, "unk_token", None)
        self._unk_id = vocab.get(self._unk_token) if self._unk_token else None

    def encode(self, text: str) -> list[int]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = encoding.ids
        if self._unk_id is not None:
            for i, token_id in enumerate(ids):
                start, end = encoding.offsets[i]
                if token_id == self._unk_id and text[start:end] != self._unk_token:
                    raise UserError(f"tokenizer {self.name} cannot represent {_describe_char(text, start)}")
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        text: str = self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
        return text


# tiktoken's encodings (tiktoken.list_encoding_names() when the package is there)
TIKTOKEN_ENCODINGS = ("gpt2", "r50k_base", "p50k_base", "p50k_edit", "cl100k_base", "o200k_base")


def tiktoken_encodings() -> tuple[str, ...]:
    try:
        import tiktoken

        return tuple(tiktoken.list_encoding_names())
    except (ImportError, AttributeError):
        return TIKTOKEN_ENCODINGS


def tokenizer_from_name(name: str) -> Tokenizer:
    """The tokenizer a command line names: "byte", a tiktoken encoding ("gpt2"), or a .json file."""
    if name == "byte":
        return ByteTokenizer()
    if name.endswith(".json") or os.path.sep in name:
        return HFTokenizer(name)
    known = tiktoken_encodings()
    if name not in known:
        raise UserError(f"unknown tokenizer {name!r}: use byte, a tiktoken encoding ({', '.join(known)}), "
                        f"or the path of a Hugging Face tokenizer .json file")
    return TiktokenTokenizer(name)


def tokenizer_spec(tokenizer: Tokenizer) -> TokenizerSpec:
    """The JSON-ready record of a tokenizer."""
    spec: TokenizerSpec = {"kind": tokenizer.kind, "name": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                           "eot": tokenizer.eot}
    if isinstance(tokenizer, HFTokenizer):  # kind "hf"
        spec["path"] = tokenizer.path
    return spec


def load_tokenizer(spec: TokenizerSpec, base_dir: str | None = None) -> Tokenizer:
    """The tokenizer a record describes; a relative `path` is taken from `base_dir`."""
    tokenizer: Tokenizer
    try:
        kind = spec["kind"]
        if kind == "byte":
            tokenizer = ByteTokenizer()
        elif kind == "tiktoken":
            tokenizer = TiktokenTokenizer(spec["name"])
        elif kind == "hf":
            path = spec["path"]
            if base_dir is not None and not os.path.isabs(path):
                path = os.path.join(base_dir, path)
            tokenizer = HFTokenizer(path, eot=spec.get("eot"))
        else:
            raise DataError(f"unknown tokenizer kind {kind!r} (expected byte, tiktoken or hf)")
        recorded = int(spec["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"tokenizer record {spec!r} is incomplete or malformed ({_first_line(exc)})") from exc
    if recorded != tokenizer.vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.name} now has {tokenizer.vocab_size} ids but the shards were made with {recorded}"
        )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: str) -> str:
    """Record `tokenizer` as `<out_dir>/tokenizer.json` (a Hugging Face file is copied beside it)."""
    spec = tokenizer_spec(tokenizer)
    if isinstance(tokenizer, HFTokenizer):  # kind "hf"
        copy = os.path.join(out_dir, HF_COPY_FILE)
        if not (os.path.exists(copy) and os.path.samefile(copy, tokenizer.path)):
            shutil.copyfile(tokenizer.path, copy)
        spec["path"] = HF_COPY_FILE  # relative: the folder of shards stays self-contained when moved
    path = os.path.join(out_dir, TOKENIZER_FILE)
    with atomic_file(path) as f:
        json.dump(spec, f, indent=2)
        f.write("\n")
    return path


def tokenizer_for_shards(shard_path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer recorded next to some shards (a path, glob or folder); byte if none is recorded."""
    shard_path = os.fspath(shard_path)
    if os.path.isdir(shard_path):
        directory = shard_path
    else:
        directory = os.path.dirname(resolve_shards(shard_path)[0])
    record = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.exists(record):
        return ByteTokenizer()
    try:
        with open(record) as f:
            spec: TokenizerSpec = json.load(f)  # a record as read: its shape is checked below and in load_tokenizer
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read tokenizer record {record} ({_first_line(exc)})") from exc
    if not isinstance(spec, dict):
        raise DataError(f"tokenizer record {record} is not a JSON object")
    return load_tokenizer(spec, base_dir=directory)


DATA_SHARD_NAME = re.compile(r"(train|val)_\d{6}\.bin")  # the names `boostmpi data` gives its shards


def check_complete_set(paths: Iterable[str]) -> None:
    """Refuse shards named as `boostmpi data` names them whose folder lacks what a finished run of it
    leaves there: its tokenizer record, written last, and a val shard (the trace of a run that failed
    or was interrupted, from before `data` wrote its output all at once)."""
    for folder in sorted({os.path.dirname(p) for p in paths if DATA_SHARD_NAME.fullmatch(os.path.basename(p))}):
        names = os.listdir(folder or ".")
        missing = [] if TOKENIZER_FILE in names else [f"no {TOKENIZER_FILE}"]
        if not any(n.startswith("val_") and DATA_SHARD_NAME.fullmatch(n) for n in names):
            missing.append("no val shard")
        if missing:
            raise DataError(f"{folder or '.'} holds an incomplete shard set ({', '.join(missing)}): the `boostmpi data` "
                            f"run that wrote it did not finish; run it again with --force")
