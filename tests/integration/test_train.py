"""`boostmpi train` end to end on real text: each arch learns (the validation loss falls well below
the unigram entropy of the training data), metrics.jsonl carries the keys of docs/FORMATS.md, and the
progress line has its documented format."""

import math
import re
import signal

import numpy as np
import pytest

from boostmpi.config import load_config
from boostmpi.data.shards import open_shard
from tests.support.train_helpers import STOP_SIGNALS, read_metrics, run_train, write_text_shards

STEPS = 300
LOG_EVERY = 50
VAL_EVERY = 100
# about 5 s per arch on one core; validation on 400 windows (most of the val shard) so that it is not
# the verdict of two blocks of text. A bigger model or more steps would only learn more.
LEARNING_SETTINGS = ("model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                     "model.rank=16", "model.d_ff=128", "model.seq_len=64", "train.micro_batch_size=16",
                     f"train.steps={STEPS}", "train.lr=3e-3", "train.warmup_steps=10",
                     f"train.log_every={LOG_EVERY}", f"train.val_every={VAL_EVERY}", "train.val_windows=400")

PROGRESS_LINE = re.compile(r"step +(?P<step>\d+)/(?P<steps>\d+) \| loss (?P<loss>\d+\.\d{4})"
                           r"(?: \| val (?P<val>\d+\.\d{4}))? \| lr \d\.\d\de[+-]\d\d \| [\d,]+ tok/s"
                           r" \| elapsed \w+ \| eta \w+")


@pytest.fixture(scope="module")
def text_shards(tmp_path_factory):
    return write_text_shards(tmp_path_factory.mktemp("text"), max_bytes=400_000)


def unigram_entropy_nats(tokens):
    """The entropy of the token frequencies: the best loss of any model that ignores context."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# cola (the paper's model) in the default run; full and svd, the same trainer on other layers, with the slow tests
@pytest.mark.parametrize("arch", [pytest.param("full", marks=pytest.mark.slow), pytest.param("svd", marks=pytest.mark.slow), "cola"])
def test_training_on_text_beats_the_unigram_entropy(arch, text_shards, tmp_path, capfd):
    train_shard, val_shard = text_shards
    run_dir = tmp_path / "run"
    handlers = [signal.getsignal(sig) for sig in STOP_SIGNALS]
    assert run_train(run_dir, train_shard, val_shard, f"model.arch={arch}", *LEARNING_SETTINGS) == 0
    # the caller's stop-signal handlers are back: `timeout` can still end this test run
    assert [signal.getsignal(sig) for sig in STOP_SIGNALS] == handlers
    out = capfd.readouterr().out
    rows = read_metrics(run_dir)

    # one row per optimizer step, each with the keys of docs/FORMATS.md; evaluation rows carry val_loss
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert {"step", "loss", "lr", "tokens_per_s", "comm_bytes"} <= set(r), r
        assert math.isfinite(r["loss"]) and r["lr"] > 0 and r["tokens_per_s"] > 0, r
        assert r["comm_bytes"] == {"tp": 0, "pp": 0, "dp": 0}, r  # one rank: nothing is communicated
        assert ("val_loss" in r) == (r["step"] % VAL_EVERY == 0), r
    assert {"params", "grads", "optimizer", "peak"} <= set(rows[0]["memory"])
    assert max(r["lr"] for r in rows) == pytest.approx(3e-3)

    # it starts from a uniform guess over the vocabulary and ends well below the unigram entropy
    assert rows[0]["loss"] == pytest.approx(math.log(256), abs=0.1)
    entropy = unigram_entropy_nats(open_shard(train_shard))
    val_losses = [r["val_loss"] for r in rows if "val_loss" in r]
    assert val_losses[-1] < 0.8 * entropy, (val_losses, entropy)
    assert val_losses[-1] < val_losses[0]

    # the resolved configuration is written beside the metrics and reads back as what ran
    saved = load_config(run_dir / "config.toml")
    assert (saved.model.arch, saved.model.d_model, saved.train.steps) == (arch, 64, STEPS)

    # progress lines: the first step, every LOG_EVERY-th and the last; loss printed as in metrics.jsonl
    progress = [PROGRESS_LINE.fullmatch(line) for line in out.splitlines() if line.startswith("step ")]
    assert progress and all(progress), out
    logged = [int(m["step"]) for m in progress]
    assert logged == [1] + list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    by_step = {r["step"]: r for r in rows}
    for m in progress:
        row = by_step[int(m["step"])]
        assert int(m["steps"]) == STEPS
        assert m["loss"] == f"{row['loss']:.4f}"
        assert (m["val"] is None) == ("val_loss" not in row)
        if m["val"] is not None:
            assert m["val"] == f"{row['val_loss']:.4f}"
    assert out.splitlines()[-1].startswith(f"done: step {STEPS}; results in {run_dir}")


def test_a_stop_marker_left_by_an_earlier_run_is_removed_when_a_run_starts(text_shards, tmp_path):
    """RUN_DIR/STOPPED_ON_SIGNAL tells a job script that the last attempt stopped cleanly on a signal;
    one left behind by an earlier run must not speak for a run that then finishes (or crashes)."""
    train_shard, val_shard = text_shards
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "STOPPED_ON_SIGNAL").write_text("stopped on SIGUSR1 at step 3\n")
    assert run_train(run_dir, train_shard, val_shard, "train.steps=2") == 0
    assert not (run_dir / "STOPPED_ON_SIGNAL").exists()
