"""The user tools: eval, inspect, generate (KV cache), export (torch, safetensors), plot.

One tiny model is trained once per module (about a second) on a repeated sentence; most tests
read its checkpoint. Reference values come from routes that share no code with the tool under
test where possible: the PyTorch oracle (tests/support/torch_llama.py), the training engine, the run's own
metrics, NumPy on the HDF5 tensors.
"""

import io
import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import h5py
import numpy as np
import pytest

from boostmpi import checkpoint as ckpt
from boostmpi.cli import main
from boostmpi.config import config_from_dict
from boostmpi.data.shards import eval_windows, open_shard, write_shard
from boostmpi.errors import CheckpointError, UserError
from boostmpi.tools.generate import Decoder, checkpoint_tokenizer, encode_prompt, generate_ids, sample_token
from boostmpi.tools.inspect import describe
from boostmpi.tools.loading import load_checkpoint, load_checkpoint_engine
from boostmpi.tools.plot import make_figure
from boostmpi.train.trainer import Trainer
from tests.support.global_tensors import save_global
from tests.support.mpi_helpers import MPIEXEC

SENTENCE = "the quick brown fox jumps over the lazy dog. "
SEQ_LEN = 16
VOCAB = 128  # ASCII only: a byte above 127 is outside the model's vocabulary


def tiny_config(run_dir, shard, **train):
    return config_from_dict({
        "model": {"arch": "cola", "vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "rank": 8, "d_ff": 64, "seq_len": SEQ_LEN},
        "train": dict({"run_dir": str(run_dir), "steps": 150, "micro_batch_size": 8, "lr": 1e-2,
                       "warmup_steps": 10, "val_windows": 8}, **train),
        "data": {"train": str(shard), "val": str(shard)}})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A cola model trained for 150 steps on a repeated sentence: (run dir, shard path, config)."""
    root = tmp_path_factory.mktemp("tools")
    shard = root / "sentence.bin"
    write_shard(shard, np.frombuffer((SENTENCE * 100).encode(), dtype=np.uint8))
    cfg = tiny_config(root / "run", shard)
    Trainer(cfg, out=io.StringIO()).train()
    return root / "run", shard, cfg


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr) of `boostmpi ARGV...` run in this process."""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def assert_bad_input(capsys, fragments, *argv):
    status, _, err = run_cli(capsys, *argv)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def copy_checkpoint(run_dir, dest):
    source = ckpt.find_latest(str(run_dir))
    shutil.copytree(source, dest)
    return dest


def torch_loss(model_cfg, tensors, x, y, dtype="float32"):
    torch = pytest.importorskip("torch")
    from tests.support.torch_llama import TorchLlama

    with torch.no_grad():
        model = TorchLlama(model_cfg, tensors, dtype=dtype)
        return model(torch.as_tensor(x), torch.as_tensor(y)).item()


# ---------------------------------------------------------------- loading

def test_loading_forces_one_process_layout_with_the_checkpoints_weights(trained, tmp_path):
    run_dir, shard, cfg = trained
    # the same weights recorded by a run laid out tp 2 x pp 2 x dp 2, grad_accum 3, in float64
    other = cfg.replace(**{"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2, "train.grad_accum": 3,
                           "train.dtype": "float64", "train.run_dir": str(tmp_path / "other")})
    loaded = load_checkpoint(run_dir)
    tensors64 = {k: v.astype(np.float64) for k, v in loaded.tensors.items()}
    save_global(str(tmp_path / "other"), 7, other, tensors64, (tensors64, tensors64), 1,
                {"layout": {"tp": 2, "pp": 2, "dp": 2, "tp_mode": "btp"}})

    engine, one, step = load_checkpoint_engine(tmp_path / "other")
    assert step == 7
    assert (one.parallel.tp, one.parallel.pp, one.parallel.dp) == (1, 1, 1)
    assert one.train.dtype == "float64" and engine.params.data.dtype == np.float64
    assert one.train.global_batch_size == one.train.micro_batch_size and one.train.grad_accum == 1
    assert one.model == cfg.model
    with h5py.File(ckpt.find_latest(str(run_dir)) + "/model.h5", "r") as f:
        for name in ("embed", "layers/1/down/B", "lm_head"):
            np.testing.assert_array_equal(engine.params[name], np.asarray(f[name]))

    engine32, cfg32, _ = load_checkpoint_engine(run_dir)  # a float32 run stays float32
    assert cfg32.train.dtype == "float32" and engine32.params.data.dtype == np.float32


def rewrite_marker(ckpt_dir):
    """Record the current sizes and SHA-256 in COMPLETE, as if the edited files had been written so."""
    import hashlib

    marker = json.loads((ckpt_dir / "COMPLETE").read_text())
    for name in marker:
        data = (ckpt_dir / name).read_bytes()
        marker[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt_dir / "COMPLETE").write_text(json.dumps(marker))


def test_a_model_h5_missing_a_tensor_or_with_a_wrong_shape_is_named(trained, tmp_path):
    ckpt_dir = copy_checkpoint(trained[0], tmp_path / "step")
    with h5py.File(ckpt_dir / "model.h5", "a") as f:
        del f["layers/1/up/A"]
    rewrite_marker(ckpt_dir)
    with pytest.raises(CheckpointError, match="has no tensor layers/1/up/A"):
        load_checkpoint(ckpt_dir / "model.h5")
    with h5py.File(ckpt_dir / "model.h5", "a") as f:
        f["layers/1/up/A"] = np.zeros((3, 3), dtype=np.float32)
    rewrite_marker(ckpt_dir)
    with pytest.raises(CheckpointError, match=r"layers/1/up/A has shape \(3, 3\)"):
        load_checkpoint(ckpt_dir)


# ---------------------------------------------------------------- eval

def test_eval_prints_the_mean_loss_over_the_windows(trained, capsys):
    run_dir, shard, cfg = trained
    status, out, _ = run_cli(capsys, "eval", run_dir, "--data", shard, "--max-windows", 5, "--batch-size", 2)
    assert status == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["windows"] == 5 and result["tokens"] == 5 * SEQ_LEN and result["step"] == 150

    # the same windows through the PyTorch oracle
    loaded = load_checkpoint(run_dir)
    x, y = eval_windows(open_shard(shard), SEQ_LEN, 5)
    assert result["loss"] == pytest.approx(torch_loss(asdict(cfg.model), loaded.tensors, x, y), rel=1e-5, abs=1e-6)
    # the run's own validation loss (8 windows, as the trainer evaluated them)
    val_loss = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]["val_loss"]
    status, out, _ = run_cli(capsys, "eval", run_dir, "--data", shard, "--max-windows", 8, "--batch-size", 3)
    assert json.loads(out)["loss"] == pytest.approx(val_loss, rel=1e-5)
    assert val_loss < 0.2  # the sentence was learnt

    status, out, _ = run_cli(capsys, "eval", run_dir, "--data", shard)
    assert json.loads(out)["windows"] == (len(SENTENCE) * 100 - 1) // SEQ_LEN


def test_eval_bad_input_is_one_line_and_exit_status_2(trained, tmp_path, capsys):
    run_dir, shard, _ = trained
    assert_bad_input(capsys, ["nowhere", "does not exist"], "eval", tmp_path / "nowhere", "--data", shard)

    incomplete = copy_checkpoint(run_dir, tmp_path / "step_00000001")
    (incomplete / "COMPLETE").unlink()
    assert_bad_input(capsys, ["incomplete"], "eval", incomplete, "--data", shard)

    corrupted = copy_checkpoint(run_dir, tmp_path / "corrupted")
    data = bytearray((corrupted / "model.h5").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (corrupted / "model.h5").write_bytes(bytes(data))
    assert_bad_input(capsys, [str(corrupted / "model.h5"), "corrupted"], "eval", corrupted, "--data", shard)

    not_a_shard = tmp_path / "text.bin"
    not_a_shard.write_text("just some text, long enough to hold a header? no: " * 30)
    assert_bad_input(capsys, ["text.bin", "not an llm.c token shard"], "eval", run_dir, "--data", not_a_shard)
    assert_bad_input(capsys, ["missing.bin", "does not exist"], "eval", run_dir, "--data", tmp_path / "missing.bin")

    short = tmp_path / "short.bin"
    write_shard(short, np.arange(SEQ_LEN))  # one token short of a window
    assert_bad_input(capsys, ["short.bin", "fewer than one window"], "eval", run_dir, "--data", short)

    too_big = tmp_path / "bytes.bin"
    write_shard(too_big, np.frombuffer("café latte".encode() * 10, dtype=np.uint8))
    assert_bad_input(capsys, ["bytes.bin", "token id 195", "128"], "eval", run_dir, "--data", too_big)

    assert_bad_input(capsys, ["--batch-size"], "eval", run_dir, "--data", shard, "--batch-size", 0)
    assert_bad_input(capsys, ["--max-windows"], "eval", run_dir, "--data", shard, "--max-windows", 0)
    stray_file = tmp_path / "weights.bin"
    stray_file.write_bytes(b"x")
    assert_bad_input(capsys, ["weights.bin", "is a file but not a checkpoint"], "eval", stray_file, "--data", shard)


def test_every_checkpoint_argument_accepts_the_latest_file_and_the_checkpoints_folder(trained, capsys, tmp_path):
    run_dir, shard, _ = trained
    step_folder = ckpt.find_latest(str(run_dir))
    for name in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "latest", step_folder,
                 Path(step_folder) / "model.h5"):
        assert ckpt.resolve(name) == step_folder, name
        status, out, err = run_cli(capsys, "eval", name, "--data", shard, "--max-windows", 2)
        assert status == 0 and json.loads(out)["step"] == 150, err
    for command in (["inspect"], ["generate", "--prompt", "the", "--max-new-tokens", "2"]):
        status, _, err = run_cli(capsys, command[0], run_dir / "checkpoints" / "latest", *command[1:])
        assert status == 0, err
    status, _, err = run_cli(capsys, "export", run_dir / "checkpoints" / "latest", "--to", "safetensors",
                             "--out", tmp_path / "m.safetensors")
    assert status == 0, err
    bad_latest = tmp_path / "checkpoints" / "latest"
    bad_latest.parent.mkdir()
    bad_latest.write_text("../../etc\n")
    assert_bad_input(capsys, [str(bad_latest), "does not name a checkpoint folder"], "eval", bad_latest, "--data", shard)


def test_eval_takes_a_glob_of_shards_and_averages_over_all_their_windows(trained, capsys, tmp_path):
    run_dir, shard, _ = trained
    tokens = np.asarray(open_shard(shard))
    write_shard(tmp_path / "val_000000.bin", tokens[: 10 * SEQ_LEN + 1])
    write_shard(tmp_path / "val_000001.bin", tokens[5: 5 + 6 * SEQ_LEN + 1])
    write_shard(tmp_path / "val_000002.bin", tokens[:3])  # too short for a window: passed over
    losses = []
    for name in ("val_000000.bin", "val_000001.bin"):
        status, out, _ = run_cli(capsys, "eval", run_dir, "--data", tmp_path / name)
        losses.append(json.loads(out))
    status, out, err = run_cli(capsys, "eval", run_dir, "--data", str(tmp_path / "val_*.bin"))
    assert status == 0, err
    result = json.loads(out)
    assert result["windows"] == 16 and result["shards"] == 2 and result["tokens"] == 16 * SEQ_LEN
    assert result["loss"] == pytest.approx((10 * losses[0]["loss"] + 6 * losses[1]["loss"]) / 16, rel=1e-6)
    status, out, _ = run_cli(capsys, "eval", run_dir, "--data", str(tmp_path / "val_*.bin"), "--max-windows", 12)
    assert json.loads(out)["windows"] == 12 and json.loads(out)["shards"] == 2
    assert_bad_input(capsys, ["no token shards match", "nothing_*.bin"], "eval", run_dir, "--data",
                     str(tmp_path / "nothing_*.bin"))


@pytest.mark.mpi_skip  # it starts an MPI job of its own
def test_eval_of_a_checkpoint_written_by_tensor_parallel_ranks(trained, tmp_path, capsys):
    """A real tp = 2 run: its global tensors evaluate on one process to the run's own val_loss."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec")
    _, shard, _ = trained
    run_dir = tmp_path / "tp2"
    sets = {"model.arch": "svd", "model.vocab_size": VOCAB, "model.d_model": 32, "model.n_layers": 2,
            "model.n_heads": 4, "model.n_kv_heads": 2, "model.rank": 8, "model.d_ff": 64, "model.seq_len": SEQ_LEN,
            "parallel.tp": 2, "parallel.tp_mode": "vanilla", "train.steps": 3, "train.micro_batch_size": 2,
            "train.val_windows": 4, "train.run_dir": str(run_dir), "data.train": str(shard), "data.val": str(shard)}
    config = tmp_path / "empty.toml"
    config.write_text("")
    command = [MPIEXEC, "-n", "2", sys.executable, "-m", "boostmpi", "train", "--config", str(config)]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert describe(run_dir)["layout"] == {"tp": 2, "pp": 1, "dp": 1, "tp_mode": "vanilla", "zero_stage": 0}
    val_loss = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]["val_loss"]
    status, out, _ = run_cli(capsys, "eval", run_dir, "--data", shard, "--max-windows", 4)
    assert status == 0 and json.loads(out)["loss"] == pytest.approx(val_loss, rel=1e-5)


# ---------------------------------------------------------------- inspect

def test_inspect_counts_and_statistics(trained, capsys):
    run_dir, _, cfg = trained
    info = describe(run_dir, stats=True)
    m = cfg.model
    C, V, L, F, R, KV = m.d_model, m.vocab_size, m.n_layers, m.d_ff, m.rank, m.kv_dim
    shapes = [(C, C), (C, KV), (C, KV), (C, C), (C, F), (C, F), (F, C)]  # q k v o gate up down
    outer = 2 * V * C + C + 2 * L * C  # embed, lm_head, final norm, the layers' two norms
    assert info["parameters"]["actual"] == outer + L * sum(R * (i + o) for i, o in shapes)
    assert info["parameters"]["dense_equivalent"] == outer + L * sum(i * o for i, o in shapes)
    assert info["step"] == 150 and info["checksums"]["ok"]
    assert info["layout"] == {"tp": 1, "pp": 1, "dp": 1, "tp_mode": "btp", "zero_stage": 0}
    assert info["config"]["model"]["arch"] == "cola"
    assert set(info["files"]) == {"COMPLETE", "model.h5", "optim.h5", "state.json", "rank-tp0-pp0-dp0.h5"}
    assert info["files"]["model.h5"] == os.path.getsize(Path(info["checkpoint"]) / "model.h5")
    with h5py.File(Path(info["checkpoint"]) / "model.h5", "r") as f:
        w = np.asarray(f["layers/0/q/A"], dtype=np.float64)
    stats = info["tensors"]["layers/0/q/A"]
    assert stats["shape"] == [C, R]
    for key, value in {"mean": w.mean(), "std": w.std(), "min": w.min(), "max": w.max(),
                       "rms": np.sqrt((w ** 2).mean())}.items():
        assert stats[key] == pytest.approx(value, rel=1e-12), key
    names = list(info["tensors"])
    assert names[0] == "embed" and names.index("layers/0/q/A") < names.index("layers/1/attn_norm")

    status, out, _ = run_cli(capsys, "inspect", run_dir)
    assert status == 0
    for fragment in ("step         150", "tp 1 x pp 1 x dp 1 (btp)", f"{info['parameters']['actual']:,} actual",
                     f"{info['parameters']['dense_equivalent']:,} dense-equivalent", "checksums    ok",
                     "layers/1/down/B", 'arch = "cola"'):
        assert fragment in out, fragment
    assert "rms" not in out
    status, out, _ = run_cli(capsys, "inspect", run_dir, "--stats")
    assert status == 0 and "rms" in out
    status, out, _ = run_cli(capsys, "inspect", run_dir, "--json", "--stats")
    assert status == 0 and json.loads(out)["tensors"]["lm_head"]["rms"] > 0


def test_inspect_reports_failed_checksums_and_bad_paths(trained, tmp_path, capsys):
    run_dir, _, _ = trained
    ckpt_dir = copy_checkpoint(run_dir, tmp_path / "step")
    rank_file = ckpt_dir / "rank-tp0-pp0-dp0.h5"  # the moments' bytes live in the rank file
    with open(rank_file, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        last = f.read(8)
        f.seek(-8, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in last))
    status, out, err = run_cli(capsys, "inspect", ckpt_dir)
    assert status == 2
    assert "step         150" in out and "checksums    FAILED" in out
    assert err.startswith("error: ") and rank_file.name in err and "corrupted" in err
    assert_bad_input(capsys, ["nowhere", "does not exist"], "inspect", tmp_path / "nowhere")
    (ckpt_dir / "COMPLETE").unlink()
    assert_bad_input(capsys, ["incomplete"], "inspect", ckpt_dir)


def test_inspect_of_a_bit_flipped_model_h5_is_the_checksum_line(trained, tmp_path, capsys):
    """Wherever the flipped bit lands in model.h5's metadata (some places made HDF5 raise a KeyError while
    the objects were visited), inspect says what eval and export say: the checksum line, exit 2."""
    ckpt_dir = copy_checkpoint(trained[0], tmp_path / "step")
    model = ckpt_dir / "model.h5"
    original = model.read_bytes()
    for position in range(0, min(len(original), 2048), 32):
        flipped = bytearray(original)
        flipped[position] ^= 0x10
        model.write_bytes(bytes(flipped))
        status, _, err = run_cli(capsys, "inspect", ckpt_dir)
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1, (position, err)
        assert lines[0] == f"error: {model} is corrupted: its XXH3-64 does not match the one recorded when it was written"
    model.write_bytes(original)


# ---------------------------------------------------------------- generate

def test_kv_cache_logits_equal_the_full_forward_the_engine_and_torch(trained):
    torch = pytest.importorskip("torch")
    from tests.support.torch_llama import TorchLlama

    run_dir, shard, cfg = trained
    loaded = load_checkpoint(run_dir, dtype="float64")
    decoder = Decoder(loaded.cfg.model, loaded.tensors, np.float64)
    ids = np.random.default_rng(3).integers(0, VOCAB, SEQ_LEN + 1)

    full = decoder.forward(ids[:SEQ_LEN], decoder.new_cache())
    cache = decoder.new_cache()
    pieces = [decoder.forward(ids[:5], cache)] + [decoder.forward([i], cache) for i in ids[5:SEQ_LEN]]
    incremental = np.concatenate(pieces)
    assert cache.length == SEQ_LEN
    np.testing.assert_allclose(incremental, full, rtol=0, atol=1e-12)

    with torch.no_grad():
        reference = TorchLlama(asdict(cfg.model), loaded.tensors).logits(torch.as_tensor(ids[None, :SEQ_LEN]))
    np.testing.assert_allclose(full, reference[0].numpy(), rtol=0, atol=1e-10)

    # the training engine's loss on the same window equals the cross-entropy of these logits
    engine, _, _ = load_checkpoint_engine(run_dir, dtype="float64")
    log_norm = np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1)) + full.max(-1)
    cross_entropy = np.mean(log_norm - full[np.arange(SEQ_LEN), ids[1:]])
    assert engine.evaluate(ids[None, :SEQ_LEN], ids[None, 1:]) == pytest.approx(cross_entropy, rel=1e-12)


def test_greedy_generation_continues_the_training_sentence(trained, capsys):
    run_dir, _, _ = trained
    prompt = "the quick brown "
    # 60 new tokens > seq_len: the context slides (re-encoded at positions 0..) twice on the way
    status, out, _ = run_cli(capsys, "generate", run_dir, "--prompt", prompt, "--temperature", 0,
                             "--max-new-tokens", 60)
    assert status == 0
    assert out.rstrip("\n") == prompt + (SENTENCE * 3)[len(prompt):len(prompt) + 60]


def test_sampling_is_seeded_and_its_filters_narrow_it(trained, capsys):
    run_dir, _, _ = trained
    texts = {}
    for seed in (0, 0, 1):
        status, out, _ = run_cli(capsys, "generate", run_dir, "--prompt", "", "--temperature", 5.0,
                                 "--max-new-tokens", 40, "--seed", seed)
        assert status == 0
        texts.setdefault(seed, []).append(out)
    assert texts[0][0] == texts[0][1] and texts[0][0] != texts[1][0]

    logits = np.array([1.0, 3.0, 2.0, 0.5])
    rng = np.random.default_rng(0)
    assert sample_token(logits, rng, temperature=0) == 1
    assert {sample_token(logits, rng, temperature=10, top_k=1) for _ in range(20)} == {1}
    assert {sample_token(logits, rng, temperature=10, top_k=2) for _ in range(200)} == {1, 2}
    # probabilities at temperature 1: 0.64, 0.24, 0.09, 0.03; top_p 0.8 keeps the first two
    assert {sample_token(logits, rng, temperature=1, top_p=0.8) for _ in range(200)} == {1, 2}
    draws = [sample_token(logits, rng, temperature=1) for _ in range(4000)]
    expected = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, expected, atol=0.03)


def test_generation_stops_at_end_of_text():
    class Scripted:  # a stand-in decoder that always predicts its next scripted id
        m = config_from_dict({"model": {"seq_len": 4, "vocab_size": 8}}).model

        def __init__(self):
            self.script = iter([5, 6, 0, 7])

        def new_cache(self):
            return type("Cache", (), {"length": 0})()

        def forward(self, ids, cache):
            cache.length += len(ids)
            logits = np.zeros((len(ids), 8))
            logits[-1, next(self.script)] = 1
            return logits

    assert generate_ids(Scripted(), [1, 2], 10, np.argmax, stop_id=0) == [5, 6, 0]


def test_a_temperature_near_zero_samples_the_greedy_token(trained, capsys):
    """1e-320 made logits / temperature overflow to inf and the probabilities NaN (a ValueError traceback)."""
    rng = np.random.default_rng(0)
    logits = np.array([0.5, 3.0, -1.0, 2.9])
    assert [sample_token(logits, rng, temperature=t) for t in (1e-320, 5e-324, 1e-300)] == [1, 1, 1]
    run_dir = trained[0]
    outputs = [run_cli(capsys, "generate", run_dir, "--prompt", "the quick", "--max-new-tokens", 12,
                       "--temperature", t) for t in (0, 1e-320)]
    assert outputs[0][0] == outputs[1][0] == 0, outputs
    assert outputs[0][1] == outputs[1][1]


def test_generate_bad_input(trained, tmp_path, capsys):
    run_dir, _, _ = trained
    assert_bad_input(capsys, ["'é'", "position 3", "128"], "generate", run_dir, "--prompt", "cafés")
    with pytest.raises(UserError, match="no UTF-8 form"):
        from boostmpi.data.tokenizer import ByteTokenizer

        encode_prompt(ByteTokenizer(), "a\ud800", VOCAB)
    assert_bad_input(capsys, ["--temperature"], "generate", run_dir, "--prompt", "a", "--temperature", -1)
    assert_bad_input(capsys, ["--top-p"], "generate", run_dir, "--prompt", "a", "--top-p", 0)
    assert_bad_input(capsys, ["--top-k"], "generate", run_dir, "--prompt", "a", "--top-k", -2)
    assert_bad_input(capsys, ["nowhere"], "generate", tmp_path / "nowhere", "--prompt", "a")
    assert_bad_input(capsys, ["tok.json"], "generate", run_dir, "--prompt", "a", "--tokenizer", tmp_path / "tok.json")


def test_the_tokenizer_recorded_with_the_training_shards_is_used(trained, tmp_path, capsys):
    _, shard, cfg = trained
    assert checkpoint_tokenizer(cfg).kind == "byte"  # shards without a record: byte
    assert checkpoint_tokenizer(cfg, "byte").kind == "byte"
    moved = cfg.replace(**{"data.train": str(tmp_path / "gone" / "train_*.bin")})
    assert checkpoint_tokenizer(moved).kind == "byte"
    assert "not here" in capsys.readouterr().err
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    shutil.copy(shard, recorded / "train_000000.bin")
    (recorded / "tokenizer.json").write_text('{"kind": "sentencepiece", "name": "x", "vocab_size": 99, "eot": 0}')
    with pytest.raises(UserError, match="unknown tokenizer kind 'sentencepiece'"):
        checkpoint_tokenizer(cfg.replace(**{"data.train": str(recorded / "train_*.bin")}))


# ---------------------------------------------------------------- export

def read_safetensors(path):
    """(tensors, metadata) of a safetensors file, read by the format's definition."""
    dtypes = {"F32": "<f4", "F64": "<f8", "F16": "<f2"}
    raw = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0  # the data starts aligned
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    metadata = header.pop("__metadata__")
    tensors = {}
    end = 0
    for name, entry in header.items():
        start, stop = entry["data_offsets"]
        tensors[name] = np.frombuffer(data[start:stop], dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
        end = max(end, stop)
    assert end == len(data)  # no stray bytes
    return tensors, metadata


def test_export_round_trip_into_torch_reproduces_the_eval_loss(trained, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from tests.support.torch_llama import TorchLlama, from_state_dict

    run_dir, shard, _ = trained
    status, out, _ = run_cli(capsys, "eval", run_dir, "--data", shard, "--max-windows", 6)
    boostmpi_loss = json.loads(out)["loss"]
    x, y = eval_windows(open_shard(shard), SEQ_LEN, 6)

    assert run_cli(capsys, "export", run_dir, "--to", "torch", "--out", tmp_path / "model.pt")[0] == 0
    state_dict = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in state_dict.values())
    sidecar = json.loads((tmp_path / "model.json").read_text())
    assert sidecar["step"] == 150 and sidecar["format"] == "boostmpi"

    assert run_cli(capsys, "export", run_dir, "--to", "safetensors", "--out", tmp_path / "model.safetensors")[0] == 0
    tensors, metadata = read_safetensors(tmp_path / "model.safetensors")
    assert metadata["step"] == "150" and metadata["format"] == "boostmpi"
    assert set(tensors) == set(state_dict)

    for weights, config in ((from_state_dict(state_dict), sidecar["config"]),
                            (tensors, json.loads(metadata["config"]))):
        with torch.no_grad():
            model = TorchLlama(config["model"], weights, dtype="float32")
            loss = model(torch.as_tensor(x), torch.as_tensor(y)).item()
        assert loss == pytest.approx(boostmpi_loss, rel=1e-5, abs=1e-6)


def test_export_h5_is_one_self_contained_file_equal_to_the_checkpoint(trained, tmp_path, capsys):
    run_dir, _, _ = trained
    out = tmp_path / "shared" / "model.h5"
    out.parent.mkdir()
    assert run_cli(capsys, "export", run_dir, "--to", "h5", "--out", out)[0] == 0
    source = ckpt.find_latest(str(run_dir))
    with h5py.File(out, "r") as f, h5py.File(source + "/model.h5", "r") as g:
        assert dict(f.attrs) == dict(g.attrs)
        names = []
        g.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        assert names and all(g[n].is_virtual for n in names)
        for name in names:
            assert not f[name].is_virtual
            np.testing.assert_array_equal(f[name][()], g[name][()])
    assert sorted(os.listdir(out.parent)) == ["model.h5"]  # nothing else needed beside it


def test_export_bad_input(trained, tmp_path, capsys, monkeypatch):
    run_dir, _, _ = trained
    status, _, err = run_cli(capsys, "export", run_dir, "--to", "onnx", "--out", tmp_path / "m.onnx")
    assert status == 2 and "--to" in err and "onnx" in err
    assert_bad_input(capsys, ["nowhere", "does not exist"], "export", run_dir, "--to", "safetensors",
                     "--out", tmp_path / "nowhere" / "m.safetensors")
    assert_bad_input(capsys, ["is a folder"], "export", run_dir, "--to", "safetensors", "--out", tmp_path)
    assert_bad_input(capsys, [".json"], "export", run_dir, "--to", "torch", "--out", tmp_path / "m.json")
    assert_bad_input(capsys, ["nowhere"], "export", tmp_path / "nowhere", "--to", "torch", "--out", tmp_path / "m.pt")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert_bad_input(capsys, ["--out", str(a_file), "is a file, not a folder"], "export", run_dir, "--to", "safetensors",
                     "--out", a_file / "m.safetensors")
    monkeypatch.setitem(sys.modules, "torch", None)  # as if PyTorch were not installed
    assert_bad_input(capsys, ["needs PyTorch", "--to safetensors"], "export", run_dir, "--to", "torch",
                     "--out", tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize("arch", ["full", "svd"])
def test_export_hf_loads_in_transformers_with_the_same_logits(arch, tmp_path, capsys):
    """LlamaForCausalLM.from_pretrained on the exported folder, fed the same tokens as boostmpi's own
    forward (the KV-cache decoder), gives the same logits; svd's pairs are multiplied out."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    shard = tmp_path / "sentence.bin"
    write_shard(shard, np.frombuffer((SENTENCE * 20).encode(), dtype=np.uint8))
    # not LLaMA's defaults, so that a setting not carried over would show; GQA (4 heads, 2 kv heads)
    cfg = tiny_config(tmp_path / "run", shard, steps=3).replace(**{
        "model.arch": arch, "model.rope_theta": 500.0, "model.norm_eps": 1e-5, "model.mlp_rank": 12})
    Trainer(cfg, out=io.StringIO()).train()
    status, out, err = run_cli(capsys, "export", tmp_path / "run", "--to", "hf", "--out", tmp_path / "hf")
    assert status == 0, err
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]

    loaded = load_checkpoint(tmp_path / "run")
    ids = np.frombuffer(b"the lazy dog. the quick", dtype=np.uint8)[:SEQ_LEN].astype(np.int64)
    decoder = Decoder(loaded.cfg.model, loaded.tensors, np.float64)  # boostmpi's forward, in float64
    ours = decoder.forward(ids, decoder.new_cache())
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)  # float32 weights, float64 compute on both sides
    assert model.config.rope_parameters["rope_theta"] == 500.0 and model.config.num_key_value_heads == 2

    status, _, err = run_cli(capsys, "export", tmp_path / "run", "--to", "hf", "--out", tmp_path / "hf")
    assert status == 2 and "already exists" in err  # never written over


def test_export_hf_refuses_cola_saying_why(trained, tmp_path, capsys):
    assert_bad_input(capsys, ["arch = cola", "no dense weight", "--to safetensors"], "export", trained[0], "--to", "hf",
                     "--out", tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and os.listdir(tmp_path) == []


def test_export_without_the_optional_packages_says_how_to_install_them(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    assert_bad_input(capsys, ["safetensors package", "pip install -e '.[export]'"], "export", trained[0],
                     "--to", "safetensors", "--out", tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


# ---------------------------------------------------------------- plot

def fake_run(root, name, comm, val_every=2, steps=4):
    run_dir = root / name
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            row = {"step": step, "loss": 5.0 / step, "lr": 1e-3, "tokens_per_s": 1000.0 + step,
                   "tokens": 64 * step, "comm_bytes": dict(comm)}
            if step % val_every == 0:
                row["val_loss"] = 5.5 / step
            f.write(json.dumps(row) + "\n\n")  # blank lines are allowed
    return run_dir


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_overlays_runs(trained, tmp_path, capsys):
    runs = [fake_run(tmp_path, "full", {"tp": 0, "pp": 0, "dp": 0}),
            fake_run(tmp_path, "svd", {"tp": 4096, "pp": 0, "dp": 100}),
            fake_run(tmp_path, "cola", {"tp": 1024, "pp": 512, "dp": 100}, val_every=99)]
    fig, n_series = make_figure(runs)
    # loss: 3 + val_loss: 2 (cola has none) + throughput: 3 + comm: svd tp, dp + cola tp, pp, dp
    assert n_series == 3 + 2 + 3 + 5
    assert len(fig.axes) == 3
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["full loss", "full val_loss", "svd loss", "svd val_loss", "cola loss"]
    assert list(fig.axes[0].get_lines()[0].get_xdata()) == [64, 128, 192, 256]
    # communication: grouped bars side by side, one per run and axis, each labelled with its size
    comm = fig.axes[2]
    bars = [patch for container in comm.containers for patch in getattr(container, "patches", [])]
    assert len(bars) == 5 and len({(round(b.get_x(), 6), b.get_width()) for b in bars}) == 5  # none hides another
    assert sorted(round(b.get_height()) for b in bars) == [100, 100, 512, 1024, 4096]
    assert [t.get_text() for t in comm.get_xticklabels()] == ["tp axis", "pp axis", "dp axis"]
    assert {t.get_text() for t in comm.texts} >= {"4.0 KiB", "1.0 KiB", "512 B", "100 B"}
    assert [t.get_text() for t in comm.get_legend().get_texts()] == ["svd", "cola"]
    fig, _ = make_figure(runs, x="step")
    assert list(fig.axes[0].get_lines()[0].get_xdata()) == [1, 2, 3, 4]
    fig, n_series = make_figure(runs[:1])  # no communication at all: the panel says so
    assert n_series == 3 and "no communication" in fig.axes[2].texts[0].get_text()
    # every panel's title lies inside the figure, none clipped at its edge
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for ax in fig.axes:
        title = ax.title.get_window_extent(renderer)
        assert box.x0 <= title.x0 and title.x1 <= box.x1 and title.y1 <= box.y1, (ax.get_title(), title, box)

    out = tmp_path / "curves.png"
    status, text, _ = run_cli(capsys, "plot", *runs, trained[0], "--out", out, "--x", "step")
    assert status == 0 and "16 series" in text  # the trained run adds loss, val_loss, throughput
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert out.stat().st_size > 10_000


def test_plot_and_export_to_a_read_only_filesystem_are_one_line(trained, tmp_path):
    from tests.support.train_helpers import run_on_a_private_tmpfs

    run_dir = fake_run(tmp_path, "good", {"tp": 0, "pp": 0, "dp": 0})
    mount = tmp_path / "ro"
    mount.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]), OPENBLAS_NUM_THREADS="1")
    script = (f"{sys.executable} -m boostmpi plot {run_dir} --out {mount}/o.png; echo status $?; "
              f"{sys.executable} -m boostmpi export {trained[0]} --to safetensors --out {mount}/m.safetensors; "
              f"echo status $?")
    done = run_on_a_private_tmpfs(mount, "ro,size=64k", script, env=env)
    assert done.stdout.split() == ["status", "2", "status", "2"], done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"error: --out {mount}/") for line in lines), done.stderr
    assert all("read-only filesystem" in line for line in lines), lines


def test_plot_bad_input(tmp_path, capsys):
    good = fake_run(tmp_path, "good", {"tp": 0, "pp": 0, "dp": 0})
    out = tmp_path / "o.png"
    assert_bad_input(capsys, ["missing", "does not exist"], "plot", tmp_path / "missing", "--out", out)
    (tmp_path / "no_metrics").mkdir()
    assert_bad_input(capsys, ["no_metrics", "no metrics.jsonl"], "plot", tmp_path / "no_metrics", "--out", out)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("\n")
    assert_bad_input(capsys, ["metrics.jsonl is empty"], "plot", good, empty, "--out", out)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n{"step": 2, "lo\n')
    assert_bad_input(capsys, ["line 2 is not JSON"], "plot", broken, "--out", out)
    no_tokens = tmp_path / "no_tokens"
    no_tokens.mkdir()
    (no_tokens / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n')
    assert_bad_input(capsys, ["no tokens column", "--x step"], "plot", no_tokens, "--out", out)
    assert run_cli(capsys, "plot", no_tokens, "--out", out, "--x", "step")[0] == 0
    assert_bad_input(capsys, ["does not exist"], "plot", good, "--out", tmp_path / "nowhere" / "o.png")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert_bad_input(capsys, ["--out", str(a_file), "is a file, not a folder"], "plot", good, "--out", a_file / "o.png")
    assert_bad_input(capsys, ["--out", "is a folder"], "plot", good, "--out", tmp_path)
    status, _, err = run_cli(capsys, "plot", good, "--out", out, "--x", "time")
    assert status == 2 and "--x" in err
