"""The data layer: llm.c shards, evaluation windows, the training stream, tokenizers,
`boostmpi data`, the built-in corpus and progress lines."""

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

from boostmpi.cli import main
from boostmpi.data import corpus
from boostmpi.data.corpus import InputReader, builtin_files, ensure_builtin, read_text_pieces, write_dataset
from boostmpi.data.progress import Progress, format_duration
from boostmpi.data.shards import TrainLoader, eval_windows, open_shard, resolve_shards, write_shard
from boostmpi.data.tokenizer import (ByteTokenizer, Tokenizer, load_tokenizer, save_tokenizer,
                                     tokenizer_for_shards, tokenizer_spec)
from boostmpi.errors import DataError, UserError


def one_line_error(exc_info, *fragments):
    message = str(exc_info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert str(fragment) in message, message


# ---------------------------------------------------------------- shards

def test_shard_round_trip_in_llm_c_layout(tmp_path):
    tokens = np.array([0, 1, 255, 256, 50256, 65535, 7], dtype=np.int64)
    path = tmp_path / "s.bin"
    write_shard(path, tokens)
    # the layout read back by hand, independently of open_shard
    raw = path.read_bytes()
    assert len(raw) == 256 * 4 + 2 * len(tokens)
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert list(header[:3]) == [20240520, 1, len(tokens)] and not header[3:].any()
    assert np.array_equal(np.frombuffer(raw[1024:], dtype="<u2"), tokens)

    opened = open_shard(path, vocab_size=65536)
    assert isinstance(opened, np.memmap) and opened.dtype == np.uint16
    assert np.array_equal(opened, tokens)
    assert not [p for p in os.listdir(tmp_path) if p != "s.bin"]  # no temporary file left behind


LLAMA3_VOCAB = 128_256


def test_wide_vocabulary_shard_in_llm_c_llama_3_layout(tmp_path):
    tokens = np.array([0, 1, 65535, 65536, 100_000, LLAMA3_VOCAB - 1, 7], dtype=np.int64)
    path = tmp_path / "s.bin"
    write_shard(path, tokens, vocab_size=LLAMA3_VOCAB)
    raw = path.read_bytes()  # read back by hand, as llm.c's write_datafile(..., "llama-3") lays it out
    assert len(raw) == 256 * 4 + 4 * len(tokens)
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert list(header[:3]) == [20240801, 7, len(tokens)] and not header[3:].any()
    assert np.array_equal(np.frombuffer(raw[1024:], dtype="<u4"), tokens)
    opened = open_shard(path, vocab_size=LLAMA3_VOCAB)
    assert isinstance(opened, np.memmap) and opened.dtype == np.uint32
    assert np.array_equal(opened, tokens)
    with pytest.raises(DataError) as exc:
        open_shard(path, vocab_size=100_000)
    one_line_error(exc, "s.bin", "token id 128255", "100000 ids")
    x, y = eval_windows(opened, 2)
    assert x[2].tolist() == [100_000, LLAMA3_VOCAB - 1] and y[1].tolist() == [65536, 100_000]

    # the format follows the vocabulary, not the ids: a vocabulary of 65,536 stays uint16 byte for byte
    write_shard(tmp_path / "narrow.bin", [1, 2, 3], vocab_size=65536)
    write_shard(tmp_path / "plain.bin", [1, 2, 3])
    assert (tmp_path / "narrow.bin").read_bytes() == (tmp_path / "plain.bin").read_bytes()
    write_shard(tmp_path / "wide.bin", [1, 2, 3], vocab_size=65537)
    assert list(np.fromfile(tmp_path / "wide.bin", dtype="<i4", count=2)) == [20240801, 7]
    assert open_shard(tmp_path / "wide.bin").tolist() == [1, 2, 3]


@pytest.mark.parametrize("magic, version", [(20240520, 7), (20240801, 1), (20240522, 1), (20240801, 8)])
def test_open_shard_refuses_any_other_magic_or_version(tmp_path, magic, version):
    path = tmp_path / "odd.bin"
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, 4
    path.write_bytes(header.tobytes() + np.arange(4, dtype="<u4").tobytes())
    with pytest.raises(DataError) as exc:
        open_shard(path)
    one_line_error(exc, "odd.bin", magic, "20240520 version 1", "20240801 version 7")


@pytest.mark.parametrize("bad_id, vocab", [(65536, 65536), (-1, None), (2**32, None), (-5, LLAMA3_VOCAB)])
def test_write_shard_refuses_ids_outside_its_format(tmp_path, bad_id, vocab):
    with pytest.raises(DataError) as exc:
        write_shard(tmp_path / "s.bin", [1, bad_id, 2], vocab_size=vocab)
    one_line_error(exc, bad_id)
    assert not os.listdir(tmp_path)


def test_open_shard_errors_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(DataError) as exc:
        open_shard(tmp_path / "missing.bin")
    one_line_error(exc, "missing.bin", "does not exist")

    short = tmp_path / "short.bin"
    short.write_bytes(b"hello")
    with pytest.raises(DataError) as exc:
        open_shard(short)
    one_line_error(exc, "short.bin", "not a token shard")

    text = tmp_path / "text.bin"
    text.write_bytes(b"x" * 5000)
    with pytest.raises(DataError) as exc:
        open_shard(text)
    one_line_error(exc, "text.bin", "magic")

    good = tmp_path / "good.bin"
    write_shard(good, np.arange(100))
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(DataError) as exc:
        open_shard(truncated)
    one_line_error(exc, "truncated.bin", "truncated", "100 tokens")

    padded = tmp_path / "padded.bin"
    padded.write_bytes(good.read_bytes() + b"\0\0")
    with pytest.raises(DataError) as exc:
        open_shard(padded)
    one_line_error(exc, "padded.bin", "2 bytes")

    with pytest.raises(DataError) as exc:
        open_shard(good, vocab_size=99)
    one_line_error(exc, "good.bin", "token id 99", "99 ids", "token 99")
    assert len(open_shard(good, vocab_size=100)) == 100


def test_resolve_shards_sorts_and_names_the_pattern(tmp_path):
    for name in ["train_000002.bin", "train_000000.bin", "train_000001.bin", "val_000000.bin"]:
        write_shard(tmp_path / name, [1, 2, 3])
    found = resolve_shards(str(tmp_path / "train_*.bin"))
    assert [os.path.basename(p) for p in found] == ["train_000000.bin", "train_000001.bin", "train_000002.bin"]
    assert resolve_shards(str(tmp_path / "val_000000.bin")) == [str(tmp_path / "val_000000.bin")]
    with pytest.raises(DataError) as exc:
        resolve_shards(str(tmp_path / "nothing_*.bin"))
    one_line_error(exc, "nothing_*.bin")


def test_eval_windows_exact_indices():
    T = 5
    for n in (21, 23, 25):  # 21 = 3T+T+1 is the boundary where window k=3 just fits
        x, y = eval_windows(np.arange(n, dtype=np.uint16), T)
        assert x.dtype == np.int64 and y.dtype == np.int64
        windows = [k for k in range(n) if k * T + T + 1 <= n]
        assert x.shape == y.shape == (len(windows), T)
        for k in windows:
            assert list(x[k]) == list(range(k * T, k * T + T))
            assert list(y[k]) == list(range(k * T + 1, k * T + T + 1))
    x, y = eval_windows(np.arange(100), T, max_windows=3)
    assert x.shape == (3, T) and x[2, 0] == 10


def test_eval_windows_too_short_names_the_shard():
    assert eval_windows(np.arange(6), 5)[0].shape == (1, 5)
    with pytest.raises(DataError) as exc:
        eval_windows(np.arange(5), 5, name="val_000000.bin")
    one_line_error(exc, "val_000000.bin", "5 tokens", "6")


# ---------------------------------------------------------------- training stream

T = 4
SHARD_LENGTHS = (53, 41, 3)  # 13 and 10 windows; the last shard is too short for one and is skipped


@pytest.fixture
def train_shards(tmp_path):
    """Shards whose token values say where they come from, and the stream of windows they should give."""
    paths, windows, offset = [], [], 0
    for i, n in enumerate(SHARD_LENGTHS):
        tokens = np.arange(offset, offset + n)
        offset += n
        path = tmp_path / f"train_{i:06d}.bin"
        write_shard(path, tokens)
        paths.append(str(path))
        windows += [tokens[k * T : k * T + T + 1] for k in range(n) if k * T + T + 1 <= n]
    assert len(windows) == 23
    return paths, np.array(windows)


def test_train_loader_stream_and_wrap_around(train_shards):
    paths, windows = train_shards
    loader = TrainLoader(paths, T, batch_size=3)
    assert all(isinstance(s, np.memmap) for s in loader.shards[:2])
    for step in range(20):  # 60 windows: past two wrap-arounds, with batches that straddle them
        x, y = loader.next_batch()
        expected = windows[[(3 * step + i) % 23 for i in range(3)]]
        assert x.dtype == np.int64 and x.shape == (3, T)
        assert np.array_equal(x, expected[:, :-1]) and np.array_equal(y, expected[:, 1:])
    assert loader.epoch == 60 // 23


def test_train_loader_data_parallel_ranks_split_one_global_batch(train_shards):
    paths, _ = train_shards
    whole = TrainLoader(paths, T, batch_size=6)
    ranks = [TrainLoader(paths, T, batch_size=3, rank=r, world=2) for r in range(2)]
    for _ in range(9):
        x, y = whole.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert np.array_equal(x, np.concatenate([p[0] for p in parts]))
        assert np.array_equal(y, np.concatenate([p[1] for p in parts]))
    assert ranks[0].state_dict() == ranks[1].state_dict() == whole.state_dict()


def test_train_loader_resumes_exactly(train_shards):
    paths, _ = train_shards
    uninterrupted = TrainLoader(paths, T, batch_size=2, rank=1, world=2)
    interrupted = TrainLoader(paths, T, batch_size=2, rank=1, world=2)
    expected = [uninterrupted.next_batch() for _ in range(12)]
    for _ in range(7):
        interrupted.next_batch()
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives a round trip as plain ints
    assert all(isinstance(v, int) for v in state.values())
    resumed = TrainLoader(paths, T, batch_size=2, rank=1, world=2)
    resumed.load_state_dict(state)
    for want in expected[7:]:
        got = resumed.next_batch()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])

    with pytest.raises(DataError) as exc:
        TrainLoader(paths, T + 1, batch_size=2).load_state_dict(state)
    one_line_error(exc, "seq_len")


def test_train_loader_needs_one_window_per_sequence(train_shards):
    paths, _ = train_shards
    TrainLoader(paths, T, batch_size=23)
    with pytest.raises(DataError) as exc:
        TrainLoader(paths, T, batch_size=12, world=2)
    one_line_error(exc, "23 windows", "24")
    with pytest.raises(DataError):
        TrainLoader(paths, T, batch_size=1, rank=2, world=2)
    with pytest.raises(DataError) as exc:
        TrainLoader(paths, T, batch_size=1, vocab_size=50)
    one_line_error(exc, "train_000000.bin", "50")


# ---------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 日本語 🙂\nend"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert np.array_equal(tok.encode_array(text), ids) and tok.encode_array(text).dtype == np.uint16
    assert (tok.eot, tok.vocab_size, tok.name) == (0, 256, "byte")
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character decodes, replaced
    with pytest.raises(UserError) as exc:
        tok.encode("a\ud800b")
    one_line_error(exc, "U+D800", "position 1")


def test_tokenizer_record_next_to_shards(tmp_path):
    write_shard(tmp_path / "val_000000.bin", [1, 2])
    assert isinstance(tokenizer_for_shards(str(tmp_path / "val_*.bin")), ByteTokenizer)  # none recorded
    save_tokenizer(ByteTokenizer(), str(tmp_path))
    record = json.loads((tmp_path / "tokenizer.json").read_text())
    assert record == {"kind": "byte", "name": "byte", "vocab_size": 256, "eot": 0} == tokenizer_spec(ByteTokenizer())
    assert tokenizer_for_shards(str(tmp_path / "val_000000.bin")).vocab_size == 256

    with pytest.raises(DataError) as exc:
        load_tokenizer({"kind": "byte", "name": "byte", "vocab_size": 300, "eot": 0})
    one_line_error(exc, "300")
    with pytest.raises(DataError):
        load_tokenizer({"kind": "sentencepiece", "vocab_size": 300})


def test_vocabulary_over_uint32_is_refused():
    class Huge(Tokenizer):
        name, vocab_size = "huge", 2**32 + 1

    with pytest.raises(UserError) as exc:
        Huge()._check_vocab()
    one_line_error(exc, "huge", 2**32 + 1, 2**32)


class Llama3Sized(Tokenizer):
    """A stand-in with Llama 3's vocabulary: character c becomes id 65,000 + ord(c), eot the last id."""

    kind, name, vocab_size, eot = "byte", "llama3-sized", LLAMA3_VOCAB, LLAMA3_VOCAB - 1

    def encode(self, text):
        return [65_000 + ord(c) for c in text]


def test_dataset_of_a_128256_vocabulary_is_written_in_uint32_and_read_back(tmp_path):
    tok = Llama3Sized()
    docs = [f"document number {i}\n" for i in range(50)]
    summary = write_dataset(iter(docs), str(tmp_path), tok, val_fraction=0.1, shard_tokens=300)
    for path, n in summary["train"] + summary["val"]:
        assert list(np.fromfile(path, dtype="<i4", count=3)) == [20240801, 7, n]
        assert os.path.getsize(path) == 1024 + 4 * n
    train = read_stream(str(tmp_path / "train_*.bin"))
    assert train.max() > 65535 and train[0] == tok.eot and train[1:4].tolist() == tok.encode("doc")
    loader = TrainLoader(str(tmp_path / "train_*.bin"), 8, batch_size=2, vocab_size=LLAMA3_VOCAB)
    x, y = loader.next_batch()
    assert x[0].tolist() == train[:8].tolist() and y[0].tolist() == train[1:9].tolist()


def test_hf_tokenizer_names_a_character_it_cannot_represent(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from boostmpi.data.tokenizer import HFTokenizer

    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.train_from_iterator(["hello world"], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    hf.save(str(tmp_path / "words.json"))
    tok = HFTokenizer(str(tmp_path / "words.json"))
    assert tok.eot == hf.token_to_id("</s>")
    assert tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(UserError) as exc:
        tok.encode("hello Ωmega")
    one_line_error(exc, "'Ω'", "position 6")
    out = tmp_path / "shards"
    out.mkdir()
    save_tokenizer(tok, str(out))
    assert tokenizer_for_shards(str(out)).encode("world hello") == tok.encode("world hello")


# ---------------------------------------------------------------- datasets

def read_stream(pattern):
    return np.concatenate([np.asarray(open_shard(p)) for p in resolve_shards(pattern)]).astype(np.int64)


def test_write_dataset_split_and_shard_sizes(tmp_path):
    tok = ByteTokenizer()
    docs = [f"document number {i}\n" for i in range(100)]
    summary = write_dataset(iter(docs), str(tmp_path), tok, val_fraction=0.02, shard_tokens=500)
    val_docs = [49, 99]  # floor((i+1) * 0.02) > floor(i * 0.02)

    def stream(indices):
        return [t for i in indices for t in [tok.eot] + tok.encode(docs[i])]

    assert list(read_stream(str(tmp_path / "val_*.bin"))) == stream(val_docs)
    assert list(read_stream(str(tmp_path / "train_*.bin"))) == stream(i for i in range(100) if i not in val_docs)
    assert [n for _, n in summary["train"]][:-1] == [500] * (len(summary["train"]) - 1)
    assert summary["documents"] == 100


@pytest.mark.parametrize("shard_tokens", [30, 10_000])
def test_few_documents_are_split_by_tokens(tmp_path, shard_tokens):
    tok = ByteTokenizer()
    docs = ["abcdefghij" * 50, "klmnopqrstuvwxyz" * 2]
    summary = write_dataset(docs, str(tmp_path), tok, val_fraction=0.1, shard_tokens=shard_tokens)
    train, val = read_stream(str(tmp_path / "train_*.bin")), read_stream(str(tmp_path / "val_*.bin"))
    assert len(val) == round(0.1 * (501 + 33))  # the tail of the stream, reaching into the first document
    assert list(np.concatenate([train, val])) == [t for d in docs for t in [tok.eot] + tok.encode(d)]
    sizes = [n for _, n in summary["train"]]  # shards taken back for the val tail are cut again evenly
    assert sizes == [os.path.getsize(p) // 2 - 512 for p, _ in summary["train"]]
    assert all(n == shard_tokens for n in sizes[:-1]) and 0 < sizes[-1] <= shard_tokens


def test_text_is_read_in_pieces_cut_after_newlines(tmp_path):
    text = "".join(f"line {i} ✓ ünïcode\n" for i in range(200)) + "no newline at the end"
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    pieces = list(read_text_pieces(str(path), piece_bytes=100))
    assert "".join(pieces) == text and len(pieces) > 20
    assert all(p.endswith("\n") for p in pieces[:-1])
    raw = text.encode("utf-8")
    cut_in_a_char = raw.index("✓".encode("utf-8")) + 1
    assert "".join(read_text_pieces(str(path), limit=cut_in_a_char, piece_bytes=7)) == "line 0 "

    bad = tmp_path / "bad.txt"
    bad.write_bytes(raw[:1000] + b"\xff" + raw[1000:])
    with pytest.raises(DataError) as exc:
        list(read_text_pieces(str(bad), piece_bytes=100))
    one_line_error(exc, "bad.txt", "byte 1000")
    binary = tmp_path / "binary.dat"
    binary.write_bytes(b"\xff" + raw)
    reader = InputReader([(str(binary), False), (str(path), False)], piece_bytes=100)
    assert write_dataset(reader.documents(), str(tmp_path / "out"), ByteTokenizer())["documents"] == 1
    assert reader.skipped == [str(binary)]
    reader = InputReader([(str(binary), True)], piece_bytes=100)  # a file the user named: an error
    with pytest.raises(DataError) as exc:
        write_dataset(reader.documents(), str(tmp_path / "out"), ByteTokenizer())
    one_line_error(exc, "binary.dat", "not UTF-8", "byte 0")
    reader = InputReader([(str(path), False), (str(bad), False)], piece_bytes=100)
    with pytest.raises(DataError) as exc:  # not UTF-8 after some of its text was used: an error too
        write_dataset(reader.documents(), str(tmp_path / "out"), ByteTokenizer())
    one_line_error(exc, "bad.txt", "byte 1000")


def make_text_folder(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("first document, with ünïcode ✓\n" * 20, encoding="utf-8")
    (root / "sub" / "b.txt").write_text("second document\n" * 30, encoding="utf-8")
    (root / "sub" / "c.md").write_text("# third\n" * 10, encoding="utf-8")
    (root / "blob.bin").write_bytes(bytes(range(128, 256)) * 4)  # not UTF-8
    (root / ".hidden").write_text("never read")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("never read either")
    return [(root / "a.txt").read_text(), (root / "sub" / "b.txt").read_text(), (root / "sub" / "c.md").read_text()]


def test_data_command_writes_shards_and_tokenizer(tmp_path, capsys):
    docs = make_text_folder(tmp_path / "in")
    out = tmp_path / "out"
    assert main(["data", str(tmp_path / "in"), "--out", str(out), "--shard-tokens", "1000"]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 file" in captured.err and str(out) in captured.out
    assert sorted(os.listdir(out)) == ["tokenizer.json", "train_000000.bin", "train_000001.bin", "val_000000.bin"]
    tok = tokenizer_for_shards(str(out / "train_*.bin"))
    # fewer than 50 documents: val is the last 2% of the tokens, so train + val is the whole stream
    stream = read_stream(str(out / "train_*.bin")).tolist() + read_stream(str(out / "val_*.bin")).tolist()
    assert tok.decode(stream) == "".join("\0" + d for d in docs)  # a.txt, then sub/b.txt, sub/c.md

    assert main(["data", str(tmp_path / "in"), "--out", str(out)]) == 2  # refuses to overwrite
    assert "--force" in capsys.readouterr().err
    assert main(["data", str(tmp_path / "in" / "sub"), "--out", str(out), "--force", "--glob", "*.txt"]) == 0
    assert len(resolve_shards(str(out / "train_*.bin"))) == 1  # old shards removed, not mixed in
    assert tok.decode(read_stream(str(out / "train_*.bin"))).startswith("\0second document\n")


def folder_digest(folder):
    return {p.name: p.read_bytes() for p in Path(folder).iterdir()} if Path(folder).exists() else None


@pytest.mark.parametrize("existing", [False, True])
def test_an_interrupted_data_command_leaves_out_as_it_was(tmp_path, capsys, monkeypatch, existing):
    make_text_folder(tmp_path / "in")
    out = tmp_path / "out"
    if existing:  # a complete older set, replaced with --force by the run that is interrupted
        assert main(["data", str(tmp_path / "in" / "sub"), "--out", str(out)]) == 0
    before = folder_digest(out)
    written = []

    def interrupted(self):  # after the train shards are written, before val and the tokenizer record
        written.extend(glob_names(self.out_dir))
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus.ShardStream, "close", interrupted)
    assert main(["data", str(tmp_path / "in"), "--out", str(out), "--shard-tokens", "300", "--force"]) == 130
    assert any(n.startswith("train_") for n in written)  # the interruption came mid-way, shards were on disk
    assert folder_digest(out) == before
    assert sorted(os.listdir(tmp_path)) == (["in", "out"] if existing else ["in"])  # no temporary folder left
    monkeypatch.undo()

    # a temporary folder that a killed run left behind goes with the next run into the same --out
    stale = tmp_path / ".out.killed.data-tmp"
    stale.mkdir()
    (stale / "train_000000.bin").write_bytes(b"partial")
    assert main(["data", str(tmp_path / "in"), "--out", str(out), "--force"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["in", "out"]
    assert sorted(os.listdir(out)) == ["tokenizer.json", "train_000000.bin", "val_000000.bin"]


def glob_names(folder):
    return sorted(os.listdir(folder))


def test_data_command_bad_input_is_exit_status_2(tmp_path, capsys):
    assert main(["data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "nowhere" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    assert main(["data", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["data", "--out", str(tmp_path / "o")]) == 2
    assert main(["data", str(tmp_path / "empty"), "--out", str(tmp_path / "o"), "--val-fraction", "1.5"]) == 2
    assert main(["data", str(tmp_path / "empty"), "--builtin", "--out", str(tmp_path / "o")]) == 2
    # a tokenizer name that is none of byte, a tiktoken encoding or a .json file: named as unknown,
    # not as a missing package
    capsys.readouterr()
    assert main(["data", str(tmp_path / "empty"), "--out", str(tmp_path / "o"), "--tokenizer", "nosuchtok"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown tokenizer 'nosuchtok': use byte, a tiktoken encoding (") and "gpt2" in err, err
    assert len(err.splitlines()) == 1
    # an --out below a file
    (tmp_path / "afile").write_text("x")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "t.txt").write_text("some text\n" * 50)
    assert main(["data", str(tmp_path / "text"), "--out", str(tmp_path / "afile" / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "afile" in err and "is a file, not a folder" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- built-in corpus

def test_builtin_files_are_deterministic_and_within_budget():
    files = builtin_files(300_000)
    assert files == builtin_files(300_000) and files
    assert sum(os.path.getsize(p) for p in files) <= 300_000
    assert builtin_files(600_000)[: len(files)] == files
    everything = builtin_files(10**12)
    assert everything[: len(files)] == files
    skipped = ("test", "tests", "idle_test", "site-packages", "__pycache__")
    assert all(p.endswith(".py") and not set(p.split(os.sep)) & set(skipped) for p in everything)


def test_ensure_builtin_prepares_once(tmp_path):
    out = tmp_path / "builtin"
    train_glob, val_glob = ensure_builtin(str(out), max_bytes=200_000)
    marker = json.loads((out / "builtin.json").read_text())
    train, val = read_stream(train_glob), read_stream(val_glob)
    assert marker["train_tokens"] == len(train) and marker["val_tokens"] == len(val) > 0
    assert 0.005 < len(val) / (len(train) + len(val)) < 0.2
    first = builtin_files(200_000)[0]
    assert ByteTokenizer().decode(train[:2000]).startswith("\0" + Path(first).read_text(encoding="utf-8")[:1000])

    mtime = os.path.getmtime(resolve_shards(train_glob)[0])
    assert ensure_builtin(str(out), max_bytes=200_000) == (train_glob, val_glob)
    assert os.path.getmtime(resolve_shards(train_glob)[0]) == mtime  # not prepared again
    with pytest.raises(DataError) as exc:
        ensure_builtin(str(out), max_bytes=100_000)
    one_line_error(exc, "max_bytes=200000")
    assert sorted(os.listdir(tmp_path)) == ["builtin"]  # no temporary folder left behind


def test_ensure_builtin_loses_a_race_gracefully(tmp_path, monkeypatch):
    out = str(tmp_path / "builtin")
    real_write_dataset = corpus.write_dataset

    def another_process_finishes_meanwhile(*args, **kwargs):
        summary = real_write_dataset(*args, **kwargs)
        monkeypatch.setattr(corpus, "write_dataset", real_write_dataset)
        ensure_builtin(out, max_bytes=50_000)
        return summary

    monkeypatch.setattr(corpus, "write_dataset", another_process_finishes_meanwhile)
    train_glob, _ = ensure_builtin(out, max_bytes=50_000)
    assert corpus.write_dataset is real_write_dataset  # the other one did run in between
    assert resolve_shards(train_glob) and sorted(os.listdir(tmp_path)) == ["builtin"]


def test_ensure_builtin_names_a_corpus_whose_marker_vanished(tmp_path, monkeypatch):
    """The marker cannot be read back after the folder was moved into place (another process removed
    it): one line naming the folder, not a traceback."""
    monkeypatch.setattr(corpus, "_read_marker", lambda out_dir: None)
    with pytest.raises(DataError) as exc:
        ensure_builtin(str(tmp_path / "builtin"), max_bytes=50_000)
    one_line_error(exc, "builtin.json is missing or unreadable")


# ---------------------------------------------------------------- progress

def test_format_duration():
    assert [format_duration(s) for s in (0, 42.4, 185, 7380, 101000)] == ["0s", "42s", "3m05s", "2h03m", "1d04h"]


def test_progress_plain_and_live_lines():
    quiet = io.StringIO()
    with Progress(total=100, desc="tokenizing", unit="B", stream=quiet) as progress:
        progress.update(50)
    assert quiet.getvalue() == ""  # short work in a log prints nothing

    log = io.StringIO()
    progress = Progress(total=100, desc="tokenizing", unit="B", stream=log, interval=0)
    progress.update(40)
    progress.close()
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("tokenizing: 40/100 B (40%)") and "ETA" in lines[0]
    assert lines[-1].startswith("tokenizing: 40/100 B") and " in " in lines[-1] and "\r" not in log.getvalue()

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    with Progress(total=10, desc="steps", stream=tty) as progress:
        progress.update(10)
    assert tty.getvalue().startswith("\r") and tty.getvalue().endswith("\n")


def test_the_output_of_boostmpi_data_below_data_is_not_tracked_by_git():
    import shutil
    import subprocess

    repo = Path(__file__).resolve().parents[3]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "data/mine/train_000000.bin", "data/mine/tokenizer.json"],
                             cwd=repo, capture_output=True, text=True)
    assert ignored.stdout.split() == ["data/mine/train_000000.bin", "data/mine/tokenizer.json"], ignored
    kept = subprocess.run(["git", "check-ignore", "data/builtin/builtin.json"], cwd=repo, capture_output=True, text=True)
    assert kept.returncode == 1, kept.stdout  # the project's own files stay tracked
