"""A checkpoint written under one parallel layout resumes under any other (docs/FORMATS.md, Checkpoints):
the next losses are those of the uninterrupted run within 1e-10 relative, in float64.

Run with `timeout 300 mpiexec -n N python -m pytest --with-mpi tests/integration/test_resume_layouts.py`
(N = 2, 3 or 4; each layout below runs where tp * pp * dp = N). The one-rank runs are made by world
rank 0 alone through the Trainer (the train command would see N ranks); the layout runs call
`boostmpi.cli.main` on every rank, as `mpiexec boostmpi train` would. The global batch is the same
in every run (micro_batch_size * grad_accum * dp = GLOBAL_BATCH), so every run sees the same data.
"""

import numpy as np
import pytest

from boostmpi.cli import main
from boostmpi.config import load_config
from tests.support.mpi_helpers import abort_on_error, assert_all_ranks, on_root, world
from tests.support.train_helpers import (TINY_CONFIG, h5_datasets, read_metrics, reproducible, stop_signals_restored, train_argv,
                           train_settings, write_text_shards)

pytestmark = pytest.mark.mpi(min_size=2)

GLOBAL_BATCH = 12  # sequences per step: divisible by every dp below
STEPS, CUT = 6, 3  # every run checkpoints at step CUT; the resumed runs continue from it
RTOL = 1e-10
COMMON = ("train.dtype=float64", f"train.steps={STEPS}", f"checkpoint.every={CUT}", f"train.val_every={CUT}",
          "train.val_windows=4", "train.warmup_steps=2")

# name -> (tp, pp, dp, tp_mode, zero_stage), for the tiny config (4 heads, 2 kv heads, rank 8, 2 layers);
# each rank writes its own file of a checkpoint, and each reads only its pieces of any other layout's
LAYOUTS = {
    "tp2-btp": (2, 1, 1, "btp", 0),
    "tp2-vanilla": (2, 1, 1, "vanilla", 0),
    "pp2": (1, 2, 1, "btp", 0),
    "dp2": (1, 1, 2, "btp", 0),
    "dp2-zero1": (1, 1, 2, "btp", 1),
    "dp3": (1, 1, 3, "btp", 0),
    "dp3-zero1": (1, 1, 3, "btp", 1),
    "tp2-pp2": (2, 2, 1, "btp", 0),
    "tp2-dp2-vanilla": (2, 1, 2, "vanilla", 0),
    "tp2-dp2-zero1": (2, 1, 2, "btp", 1),
    "pp2-dp2-zero1": (1, 2, 2, "btp", 1),
    "tp4-vanilla": (4, 1, 1, "vanilla", 0),
}
ONE_RANK = (1, 1, 1, "btp", 0)


def layout_settings(layout):
    tp, pp, dp, mode, zero = layout
    per_replica = GLOBAL_BATCH // dp
    grad_accum = 2 if per_replica % 2 == 0 else 1  # several micro-batches wherever they fit (1F1B under pp)
    return (f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.tp_mode={mode}",
            f"parallel.zero_stage={zero}",
            f"train.micro_batch_size={per_replica // grad_accum}", f"train.grad_accum={grad_accum}", *COMMON)


def layouts_here():
    size = world().Get_size()
    return [name for name, (tp, pp, dp, _, _) in LAYOUTS.items() if tp * pp * dp == size]


def step_dir(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:08d}"


# ---------------------------------------------------------------- the runs

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """(folder every rank sees, (train shard, val shard)), made by rank 0."""

    def make():
        folder = tmp_path_factory.mktemp("layouts")
        return folder, write_text_shards(folder / "text", max_bytes=60_000)

    made = on_root(make)
    return world().bcast(made, root=0)


def train_on_one_rank(run_dir, shards, resume=None):
    """World rank 0 alone trains the one-rank layout; every rank waits for it and fails with it."""

    def train():
        from boostmpi.train.trainer import Trainer

        cfg = load_config(TINY_CONFIG, overrides=train_settings(run_dir, *shards, *layout_settings(ONE_RANK)))
        with stop_signals_restored():
            Trainer(cfg, world=None, resume=None if resume is None else str(resume)).train()

    on_root(train)


def train_on_all_ranks(layout, run_dir, shards, resume=None):
    with abort_on_error():  # the ranks run collectives together: a local exception must not leave them waiting
        status = main(train_argv(run_dir, *shards, *layout_settings(layout), resume=resume))
    assert_all_ranks(status == 0, f"boostmpi train exited {status}")


@pytest.fixture(scope="module")
def one_rank_run(shared):
    folder, shards = shared
    run_dir = folder / "one-rank"
    train_on_one_rank(run_dir, shards)
    return run_dir


@pytest.fixture(scope="module")
def layout_runs(shared):
    """name -> run directory of the uninterrupted run of each layout of this world size."""
    folder, shards = shared
    runs = {}
    for name in layouts_here():
        runs[name] = folder / name
        train_on_all_ranks(LAYOUTS[name], runs[name], shards)
    return runs


# ---------------------------------------------------------------- the checks (on rank 0, outcome to all)

def assert_close_rows(rows, reference, what):
    """Steps, learning rates exactly; losses, validation losses and gradient norms within RTOL."""
    assert [r["step"] for r in rows] == [r["step"] for r in reference], what
    assert [r["lr"] for r in rows] == [r["lr"] for r in reference], what
    for key in ("loss", "val_loss", "grad_norm"):
        have = [r[key] for r in rows if r[key] is not None]
        want = [r[key] for r in reference if r[key] is not None]
        assert len(have) == len(want) and np.allclose(have, want, rtol=RTOL, atol=0), f"{what}: {key} {have} != {want}"


def assert_close_weights(run_dir, reference_dir, what):
    have, want = h5_datasets(step_dir(run_dir, STEPS) / "model.h5"), h5_datasets(step_dir(reference_dir, STEPS) / "model.h5")
    assert have.keys() == want.keys(), what
    for name in want:
        worst = np.max(np.abs(have[name] - want[name]) / (np.abs(want[name]) + 1e-12))
        assert np.allclose(have[name], want[name], rtol=RTOL, atol=1e-14), f"{what}: {name} differs (worst relative {worst:.1e})"


def check_resumed(resumed_dir, reference_dir, what, traffic_dir=None):
    """The resumed run's steps CUT+1.. match the reference's; its communication is that of its
    own layout's uninterrupted run (`traffic_dir`)."""

    def check():
        rows = reproducible(read_metrics(resumed_dir))
        assert [r["step"] for r in rows] == list(range(CUT + 1, STEPS + 1)), what
        assert_close_rows(rows, reproducible(read_metrics(reference_dir))[CUT:], what)
        assert_close_weights(resumed_dir, reference_dir, what)
        if traffic_dir is not None:
            own = reproducible(read_metrics(traffic_dir))[CUT:]
            assert [r["comm_bytes"] for r in rows] == [r["comm_bytes"] for r in own], what

    on_root(check)


def skip_unless_here(name):
    if name not in layouts_here():
        pytest.skip(f"{name} needs {np.prod(LAYOUTS[name][:3])} ranks")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_trains_like_one_rank(name, one_rank_run, layout_runs):
    skip_unless_here(name)

    def check():
        rows = reproducible(read_metrics(layout_runs[name]))
        assert_close_rows(rows, reproducible(read_metrics(one_rank_run)), name)
        assert any(r["comm_bytes"][axis] > 0 for r in rows for axis in ("tp", "pp", "dp")), name

    on_root(check)


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout[4] == 1])
def test_zero_stage_1_reports_each_ranks_share_of_the_optimizer_state(name, layout_runs):
    """memory.optimizer is the largest rank's AdamW state: under ZeRO-1 its dp share, ceil(n / dp)
    elements of each moment, against the whole buffer of the same layout without ZeRO."""
    skip_unless_here(name)
    tp, pp, dp, mode, _ = LAYOUTS[name]
    replicated = next((n for n, layout in LAYOUTS.items() if layout == (tp, pp, dp, "btp", 0) and n in layout_runs), None)
    if replicated is None:
        pytest.skip(f"no zero_stage 0 run of {name}'s layout here")

    def check():
        whole = read_metrics(layout_runs[replicated])[0]["memory"]["optimizer"]
        share = read_metrics(layout_runs[name])[0]["memory"]["optimizer"]
        n = whole // 16  # two float64 moments of every local parameter
        assert share == 16 * -(-n // dp), (share, whole)

    on_root(check)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_rank_checkpoint_resumes_under_the_layout(name, shared, one_rank_run, layout_runs):
    skip_unless_here(name)
    folder, shards = shared
    resumed = folder / f"one-rank-to-{name}"
    train_on_all_ranks(LAYOUTS[name], resumed, shards, resume=step_dir(one_rank_run, CUT))
    check_resumed(resumed, one_rank_run, f"one rank -> {name}", traffic_dir=layout_runs[name])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_checkpoint_resumes_on_one_rank(name, shared, layout_runs):
    skip_unless_here(name)
    folder, shards = shared
    resumed = folder / f"{name}-to-one-rank"
    train_on_one_rank(resumed, shards, resume=step_dir(layout_runs[name], CUT))
    check_resumed(resumed, layout_runs[name], f"{name} -> one rank")


def test_layout_checkpoint_resumes_under_another_layout(shared, layout_runs):
    """Each layout of this world size resumes the checkpoint of the next one (a ring)."""
    names = layouts_here()
    if len(names) < 2:
        pytest.skip(f"only one layout fits {world().Get_size()} ranks")
    folder, shards = shared
    for writer, reader in zip(names, names[1:] + names[:1]):
        resumed = folder / f"{writer}-to-{reader}"
        train_on_all_ranks(LAYOUTS[reader], resumed, shards, resume=step_dir(layout_runs[writer], CUT))
        check_resumed(resumed, layout_runs[writer], f"{writer} -> {reader}", traffic_dir=layout_runs[reader])
