"""configs/paper_*.toml: the BOOST paper's four models as given (dimensions, layouts), priced by
`boostmpi sim` as they stand, and hyper-parameters that a model of their width trains with.

The training check is the paper's width at 2 layers, a 16-token sequence and one sequence a step
(a byte vocabulary: the width is what the hyper-parameters are for), 10 steps on one CPU process,
every step on the same batch: no loss after step 1 may exceed step 1's, and on that one batch
none may exceed the step's before. With the defaults (lr 1e-3, 10 warm-up steps) instead, the 7B
width's loss rises far above its first and the 1B width's rises from one step to the next (the
mutations the test was checked against). The 1B width is the one in the default run; the 3B, 7B and
13B widths take one to several minutes each on two cores and are marked slow.
"""

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from boostmpi.cli import main
from boostmpi.config import load_config
from boostmpi.parallel.engine import Engine
from boostmpi.train.optim import AdamW, learning_rate
from boostmpi.train.trainer import optimizer_step

REPO = Path(__file__).resolve().parents[2]
# name: (d_model, d_ff, n_layers, n_heads, rank, tp, pp), the paper's table
PAPER = {"1b": (2048, 5472, 24, 32, 512, 1, 1), "3b": (3072, 8192, 26, 24, 768, 2, 1),
         "7b": (4096, 11008, 32, 32, 1024, 4, 1), "13b": (5120, 13824, 40, 40, 1280, 4, 2)}


def paper_path(name):
    return REPO / "configs" / f"paper_{name}.toml"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_config_is_the_papers_model(name):
    cfg = load_config(paper_path(name))
    m, p, t = cfg.model, cfg.parallel, cfg.train
    assert (m.d_model, m.d_ff, m.n_layers, m.n_heads, m.rank, p.tp, p.pp) == PAPER[name]
    assert (m.arch, m.vocab_size, m.seq_len, t.micro_batch_size, t.dtype) == ("cola", 32000, 4096, 4, "bfloat16")
    assert t.lr <= 3e-4 and t.warmup_steps >= 1000  # nothing like the laptop defaults
    text = paper_path(name).read_text()
    for key in ("lr", "warmup_steps", "weight_decay", "steps", "global_batch_size"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{key} ") or ln.startswith(f"{key}="))
        assert "arXiv" in line or "section" in line, f"{name}: {key} has no source: {line}"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_sim_prices_the_paper_config_as_given(name, capsys):
    assert main(["sim", "--config", str(paper_path(name)), "--machine", "a100-80gb"]) == 0
    out = capsys.readouterr().out
    tp, pp = PAPER[name][5:]
    assert f"tp={tp}" in out.replace(" ", "") or f"tp {tp}" in out, out


def test_readme_sim_line_runs_a_paper_config(capsys, monkeypatch):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    line = next(ln for ln in readme.splitlines() if ln.startswith("boostmpi sim "))
    words = shlex.split(line.split("#")[0])
    config = words[words.index("--config") + 1]
    assert re.fullmatch(r"configs/paper_\d+b\.toml", config), line
    monkeypatch.chdir(REPO)
    assert main(words[1:]) == 0


def train_losses(name, *overrides, steps=10, T=16):
    """Losses of `steps` steps at the config's width, 2 layers deep, on one repeated 16-token batch."""
    cfg = load_config(paper_path(name), ["model.n_layers=2", f"model.seq_len={T}", "model.vocab_size=256",
                                         "parallel.tp=1", "parallel.pp=1", "train.device=cpu", "train.dtype=float32",
                                         "train.micro_batch_size=1", "train.global_batch_size=0", "train.grad_accum=1",
                                         "train.recompute=none", f"train.steps={steps}", *overrides])
    engine = Engine(cfg)
    optimizer = AdamW(engine.params, engine.specs, cfg.train, engine.xp, shard=engine.shard, master=engine.master)
    tokens = np.frombuffer(b"the cat sat on the mat, the dog sat on the log.", dtype=np.uint8).astype(np.int64)
    batch = (tokens[None, :T], tokens[None, 1:T + 1])
    losses = []
    for step in range(steps):
        losses.append(float(engine.forward_backward([batch])))
        optimizer_step(engine, optimizer, learning_rate(step, cfg.train), cfg.train.grad_clip)
    return losses


@pytest.mark.parametrize("name", ["1b", *(pytest.param(n, marks=pytest.mark.slow) for n in ("3b", "7b", "13b"))])
def test_paper_width_never_exceeds_its_first_loss(name):
    losses = train_losses(name)
    assert max(losses[1:]) <= losses[0] and losses[-1] < losses[0], losses
    assert all(b <= a for a, b in zip(losses, losses[1:])), losses  # one batch: every step goes down
