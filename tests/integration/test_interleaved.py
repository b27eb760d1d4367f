"""Interleaved 1F1B (`parallel.virtual_stages`) under MPI: the loss and every gradient of plain 1F1B
on the same ranks and of one rank, in float64, over two optimizer steps; the activations the first
rank holds at once; and a checkpoint written with one number of chunks resumes with another.

Run with `timeout 600 mpiexec -n N python -m pytest --with-mpi -m mpi tests/integration/test_interleaved.py`,
N = 2 (pp2 v2, pp2 v3 with 12 layers, the checkpoints) or 4 (tp2 x pp2 v2, pp4 v2).
"""

import numpy as np
import pytest

from boostmpi.cli import main
from boostmpi.config import config_from_dict
from tests.support.global_tensors import gather_global
from tests.support.mpi_helpers import abort_on_error, assert_all_ranks, on_root, world
from tests.support.train_helpers import h5_datasets, read_metrics, reproducible, train_argv, write_text_shards

MODEL = dict(vocab_size=61, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, attn_rank=8, mlp_rank=12, seq_len=8)
TRAIN = {"lr": 0.01, "warmup_steps": 1, "grad_clip": 0.5, "weight_decay": 0.1, "dtype": "float64", "seed": 5}
MICRO_BATCH, STEPS, TOLERANCE = 2, 2, 1e-12

# name -> (tp, pp, virtual_stages, n_layers, micro-batches per step, dp)
CASES = {
    "pp2-v2": (1, 2, 2, 4, 4, 1),
    "pp2-v3": (1, 2, 3, 12, 2, 1),
    "tp2-pp2-v2": (2, 2, 2, 4, 4, 1),
    "pp4-v2": (1, 4, 2, 8, 8, 1),
    "pp2-v2-dp2": (1, 2, 2, 4, 4, 2),  # each layer's dp bucket starts once its last chunk backward is done
}


def config(tp, pp, v, n_layers, grad_accum, dp=1, one_rank=False):
    model = dict(MODEL, n_layers=n_layers)
    train = dict(TRAIN, micro_batch_size=MICRO_BATCH, grad_accum=grad_accum)
    if one_rank:  # the whole global batch in each micro-batch
        return config_from_dict({"model": model, "train": dict(train, micro_batch_size=MICRO_BATCH * dp)})
    return config_from_dict({"model": model, "parallel": {"tp": tp, "pp": pp, "dp": dp, "virtual_stages": v},
                             "train": train}, world_size=tp * pp * dp)


def batches(step, grad_accum, dp=1, dp_rank=None):
    """Micro-batches of data-parallel rank `dp_rank`, or (None) of the one-rank run: its micro-batch
    k holds micro-batch k of every data-parallel rank."""
    rng = np.random.default_rng(100 + step)
    tokens = rng.integers(0, MODEL["vocab_size"], (dp * grad_accum * MICRO_BATCH, MODEL["seq_len"] + 1))
    ranks = range(dp) if dp_rank is None else [dp_rank]
    out = []
    for k in range(grad_accum):
        rows = np.concatenate([tokens[(r * grad_accum + k) * MICRO_BATCH:][:MICRO_BATCH] for r in ranks])
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def run_steps(engine, grad_accum, dp=1, reference=False):
    """(losses, gathered global gradients per step (rank 0), in-flight activation bytes of this rank)."""
    from boostmpi.train.optim import AdamW, learning_rate
    from boostmpi.train.trainer import optimizer_step

    optimizer = AdamW(engine.params, engine.specs, engine.cfg.train, shard=engine.shard)
    losses, grads = [], []
    for step in range(STEPS):
        engine.grid.counter.reset()
        losses.append(engine.forward_backward(batches(step, grad_accum, dp, None if reference else engine.grid.coords.dp)))
        grads.append(gather_global(engine, engine.grads))
        optimizer_step(engine, optimizer, learning_rate(step, engine.cfg.train), TRAIN["grad_clip"])
    pp_bytes = engine.grid.counter.bytes["pp"]
    if engine.grid.world is not None:
        pp_bytes = engine.grid.world.allreduce(pp_bytes)
    return losses, grads, engine.in_flight_activation_bytes, pp_bytes


def worst(grads, reference):
    """The largest relative error over the tensors: max |g - ref| / max |ref|."""
    errors = {n: float(np.abs(grads[n] - r).max() / max(np.abs(r).max(), 1e-300)) for n, r in reference.items()}
    name = max(errors, key=errors.get)
    return errors[name], name


def compare(name):
    """Runs case `name` three ways (one rank, plain 1F1B, interleaved); returns per step the loss
    differences (to plain, to one rank, relative), the gradient errors (rank 0; None elsewhere), and
    the interleaved engine, its results and plain 1F1B's."""
    from boostmpi.parallel.engine import Engine

    tp, pp, v, n_layers, M, dp = CASES[name]
    comm = world()
    with abort_on_error():
        one = on_root(lambda: run_steps(Engine(config(1, 1, 1, n_layers, M, dp, one_rank=True)), M, dp, reference=True))
        plain_engine = Engine(config(tp, pp, 1, n_layers, M, dp), comm)
        plain = run_steps(plain_engine, M, dp)
        engine = Engine(config(tp, pp, v, n_layers, M, dp), comm)
        interleaved = run_steps(engine, M, dp)
    steps = []
    for step in range(STEPS):
        loss, ref = interleaved[0][step], comm.bcast(one[0][step] if comm.Get_rank() == 0 else None)
        losses = (abs(loss - plain[0][step]) / abs(plain[0][step]), abs(loss - ref) / abs(ref))
        errors = on_root(lambda: (worst(interleaved[1][step], plain[1][step]), worst(interleaved[1][step], one[1][step])))
        steps.append((losses, errors))
    return steps, engine, plain_engine, interleaved, plain


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(CASES))
def test_interleaved_matches_plain_1f1b_and_one_rank(name):
    tp, pp, v, n_layers, M, dp = CASES[name]
    comm = world()
    if tp * pp * dp != comm.Get_size():
        pytest.skip(f"{name} runs on {tp * pp * dp} ranks")
    steps, engine, plain_engine, interleaved, plain = compare(name)
    assert_all_ranks(len(engine.chunks) == v and all(len(c) == n_layers // (pp * v) for c in engine.chunks),
                     lambda: f"chunks {engine.chunks}")
    for step, (losses, errors) in enumerate(steps):
        # after an AdamW step, tp's own order of sums (the same in plain 1F1B) puts the one-rank run
        # ~1e-12 away (test_parallel.py allows 1e-10); interleaving itself must change nothing
        one_rank_tolerance = TOLERANCE if step == 0 or tp * dp == 1 else 1e-10
        assert_all_ranks(losses[0] <= TOLERANCE and losses[1] <= TOLERANCE,
                         lambda: f"step {step}: loss off by {losses} (relative; plain 1F1B, one rank)")
        assert_all_ranks(comm.Get_rank() != 0 or (errors[0][0] <= TOLERANCE and errors[1][0] <= one_rank_tolerance),
                         lambda: f"step {step}: gradients off by {errors} (relative; plain 1F1B, one rank)")
    # the pipeline's payload: two messages per micro-batch across each of the pp * v - 1 boundaries
    # between virtual stages, as docs/COMMUNICATION.md and the performance model count it
    from boostmpi.sim.model import comm_bytes

    want_pp = comm_bytes(engine.cfg)["pp"]
    assert_all_ranks(interleaved[3] == want_pp and plain[3] == comm_bytes(plain_engine.cfg)["pp"],
                     lambda: f"pp bytes {interleaved[3]} (sim {want_pp}), plain {plain[3]}")
    # the first rank holds (v + 1) pp - 1 chunks of 1 / (pp v) of the layers at once, plain 1F1B pp
    # micro-batches of 1 / pp: 1 + (pp - 1) / (pp v) times as much (up to the token ids it keeps per chunk)
    ratio = interleaved[2] / plain[2]
    want = min((v + 1) * pp - 1, v * M) / v / min(pp, M)
    first = engine.grid.coords.pp == 0
    assert_all_ranks(not first or abs(ratio - want) <= 0.05 * want,
                     lambda: f"in-flight ratio {ratio:.3f}, expected {want:.3f}")


@pytest.mark.mpi(min_size=2)
def test_the_parity_check_can_fail(monkeypatch):
    """Ranks holding contiguous layers (plain 1F1B's cut) under the interleaved schedule run the
    layers out of order: the losses and gradients come out wrong and the comparison says so."""
    from boostmpi.model import params
    from boostmpi.parallel import engine as engine_module

    if world().Get_size() != 2:
        pytest.skip("runs on 2 ranks")

    def contiguous(n_layers, pp, stage, virtual_stages=1):
        layers = list(range(*params.split_range(n_layers, pp, stage)))
        size = len(layers) // virtual_stages
        return [range(layers[0] + c * size, layers[0] + (c + 1) * size) for c in range(virtual_stages)]

    monkeypatch.setattr(engine_module, "chunk_layers", contiguous)
    monkeypatch.setattr(params, "chunk_layers", contiguous)  # the parameters each rank holds follow
    steps, *_ = compare("pp2-v2")
    losses, errors = steps[0]
    assert_all_ranks(losses[0] > 1e-6 and losses[1] > 1e-6, lambda: f"the mutant's loss is off by only {losses}")


# ---------------------------------------------------------------- checkpoints across numbers of chunks
LAYERS, CUT, CKPT_STEPS = 4, 2, 4
CKPT_COMMON = ("train.dtype=float64", f"train.steps={CKPT_STEPS}", f"checkpoint.every={CUT}", "train.val_every=0",
               "train.val_windows=2", "train.warmup_steps=1", f"model.n_layers={LAYERS}", "train.micro_batch_size=2",
               "train.grad_accum=2")


def two_rank_run(run_dir, shards, v, resume=None):
    settings = ("parallel.pp=2", f"parallel.virtual_stages={v}", *CKPT_COMMON)
    with abort_on_error():
        status = main(train_argv(run_dir, *shards, *settings, resume=resume))
    assert_all_ranks(status == 0, f"boostmpi train exited {status}")


@pytest.mark.mpi(min_size=2)
def test_checkpoints_reshard_across_virtual_stages(tmp_path_factory):
    """v = 2 writes, v = 1 resumes (and the other way): the resumed steps are those of the run
    that was not interrupted, and both write the same global tensors."""
    comm = world()
    if comm.Get_size() != 2:
        pytest.skip("runs on 2 ranks")

    def make():
        folder = tmp_path_factory.mktemp("interleaved")
        return folder, write_text_shards(folder / "text", max_bytes=60_000)

    folder, shards = comm.bcast(on_root(make), root=0)
    runs = {v: folder / f"v{v}" for v in (1, 2)}
    for v, run_dir in runs.items():
        two_rank_run(run_dir, shards, v)
    for written, resumed in ((2, 1), (1, 2)):
        run_dir = folder / f"v{written}-to-v{resumed}"
        two_rank_run(run_dir, shards, resumed, resume=runs[written] / "checkpoints" / f"step_{CUT:08d}")

        def check():
            rows = reproducible(read_metrics(run_dir))
            want = reproducible(read_metrics(runs[resumed]))[CUT:]
            assert [r["step"] for r in rows] == list(range(CUT + 1, CKPT_STEPS + 1))
            for key in ("loss", "grad_norm", "val_loss"):  # val_loss: the evaluation round the ring of chunks
                have, ref = [r[key] for r in rows if r[key] is not None], [r[key] for r in want if r[key] is not None]
                assert len(have) == len(ref) and np.allclose(have, ref, rtol=1e-10, atol=0), (written, resumed, key)
            assert rows[-1]["val_loss"] is not None
            final = f"checkpoints/step_{CKPT_STEPS:08d}/model.h5"
            a, b = h5_datasets(run_dir / final), h5_datasets(runs[resumed] / final)
            assert a.keys() == b.keys()
            assert all(np.allclose(a[n], b[n], rtol=1e-10, atol=1e-14) for n in a)

        on_root(check)
    # `boostmpi eval` loads the interleaved run's checkpoint on one process (plain layout) and gets
    # the run's own last validation loss
    def evaluate_on_one_process():
        from boostmpi.tools.evaluate import evaluate_shards
        from boostmpi.tools.loading import load_checkpoint_engine

        engine, cfg, _step = load_checkpoint_engine(str(runs[2] / "checkpoints" / f"step_{CKPT_STEPS:08d}"))
        assert cfg.parallel.pp == 1 and cfg.parallel.virtual_stages == 1
        loss = evaluate_shards(engine, cfg, str(shards[1]), max_windows=2)[0]
        want = [r["val_loss"] for r in read_metrics(runs[2]) if r.get("val_loss") is not None][-1]
        assert abs(loss - want) <= 1e-10 * abs(want), (loss, want)

    on_root(evaluate_on_one_process)

    # the uninterrupted runs with and without interleaving agree too, evaluation included
    def same_runs():
        a, b = reproducible(read_metrics(runs[2])), reproducible(read_metrics(runs[1]))
        for key in ("loss", "val_loss"):
            have, want = [r[key] for r in a if r[key] is not None], [r[key] for r in b if r[key] is not None]
            assert want and len(have) == len(want) and np.allclose(have, want, rtol=1e-10, atol=0), key

    on_root(same_runs)


# ---------------------------------------------------------------- configurations interleaving cannot run
BAD = {
    "one stage": ({"pp": 1, "virtual_stages": 2}, {}, ["parallel.virtual_stages = 2", "parallel.pp > 1"]),
    "zero chunks": ({"pp": 2, "virtual_stages": 0}, {}, ["parallel.virtual_stages", "positive"]),
    "more chunks than layers": ({"pp": 2, "virtual_stages": 3}, {}, ["= 6 is larger than model.n_layers = 4"]),
}
# what the performance model prices (published runs use them) and the engine does not run
SIM_ONLY = {
    "layers not divisible": ({"pp": 3, "virtual_stages": 2}, {"grad_accum": 3},
                             ["model.n_layers = 8", "parallel.pp * parallel.virtual_stages = 6", "boostmpi sim"]),
    "micro-batches not a multiple of pp": ({"pp": 2, "virtual_stages": 2}, {"grad_accum": 3},
                                           ["train.grad_accum = 3", "multiple of parallel.pp = 2", "boostmpi sim"]),
}


@pytest.mark.parametrize("parallel,train,fragments", list(BAD.values()), ids=list(BAD))
def test_bad_interleaving_is_one_line(parallel, train, fragments):
    from boostmpi.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": dict(MODEL, n_layers=4), "parallel": parallel, "train": train})
    message = str(err.value)
    assert "\n" not in message and all(f in message for f in fragments), message


@pytest.mark.parametrize("parallel,train,fragments", list(SIM_ONLY.values()), ids=list(SIM_ONLY))
def test_sim_prices_what_train_refuses_in_one_line(parallel, train, fragments):
    from boostmpi.errors import ConfigError
    from boostmpi.parallel.engine import Engine
    from boostmpi.sim.machines import load_machine
    from boostmpi.sim.model import predict

    d = {"model": dict(MODEL, n_layers=8 if parallel["pp"] == 3 else 4), "parallel": parallel, "train": train}
    cfg = config_from_dict(d)  # what `boostmpi sim` loads
    assert predict(cfg, load_machine("a100-80gb")).time_s > 0
    for refuse in (lambda: config_from_dict(d, world_size=parallel["pp"]), lambda: Engine(cfg)):
        with pytest.raises(ConfigError) as err:
            refuse()
        message = str(err.value)
        assert "\n" not in message and all(f in message for f in fragments), message


def test_good_interleaving_is_accepted():
    cfg = config_from_dict({"model": dict(MODEL, n_layers=12), "parallel": {"pp": 2, "virtual_stages": 3},
                            "train": {"grad_accum": 4}}, world_size=2)
    assert cfg.parallel.virtual_stages == 3


def test_train_refuses_interleaving_without_a_pipeline(tmp_path, capfd):
    """Through the command line: one line, exit 2, nothing written."""
    from tests.support.train_helpers import assert_refused

    shards = write_text_shards(tmp_path / "text", max_bytes=60_000)
    run_dir = tmp_path / "run"
    argv = train_argv(run_dir, *shards, "parallel.virtual_stages=2")
    assert_refused(capfd, argv, tmp_path, "parallel.virtual_stages = 2", "parallel.pp > 1")
    assert not run_dir.exists()


@pytest.mark.mpi(min_size=2)
def test_train_refuses_a_sim_only_interleaving_on_every_rank(tmp_path_factory):
    comm = world()
    if comm.Get_size() != 2:
        pytest.skip("runs on 2 ranks")
    folder = comm.bcast(on_root(lambda: tmp_path_factory.mktemp("simonly")), root=0)
    shards = comm.bcast(on_root(lambda: write_text_shards(folder / "text", max_bytes=60_000)), root=0)
    run_dir = folder / "run"
    status = main(train_argv(run_dir, *shards, "parallel.pp=2", "parallel.virtual_stages=2", "model.n_layers=6",
                             "train.grad_accum=2"))
    assert_all_ranks(status == 2, f"exit status {status}")
    assert_all_ranks(not run_dir.exists(), "the run directory was made")


def test_sim_command_line_states_interleaving_and_selective_recompute(capsys):
    """`boostmpi sim` as a user runs it: interleaving shortens the bubble and moves more p2p bytes;
    selective recompute costs time; a value train could not run is priced too."""
    import json

    from tests.support.train_helpers import TINY_CONFIG

    def sim(*settings):
        argv = ["sim", "--config", str(TINY_CONFIG), "--machine", "a100-80gb", "--json",
                "--set", "model.n_layers=8", "--set", "parallel.pp=4", "--set", "train.grad_accum=8"]
        for setting in settings:
            argv += ["--set", setting]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    plain, inter = sim(), sim("parallel.virtual_stages=2")
    assert inter["breakdown"]["pp_bubble_and_p2p"] < plain["breakdown"]["pp_bubble_and_p2p"]
    assert inter["comm_bytes"]["pp"] * 3 == plain["comm_bytes"]["pp"] * 7
    assert inter["memory_bytes"]["activations"] > plain["memory_bytes"]["activations"]
    selective = sim("train.recompute=selective")
    assert selective["time_s"] > plain["time_s"]
    uneven = sim("parallel.virtual_stages=2", "model.n_layers=10")  # train refuses: 10 layers in 8 chunks
    assert uneven["time_s"] > 0


def test_sim_knows_the_first_ranks_extra_activations_and_the_smaller_bubble():
    """The performance model: the first rank's activations 1 + (pp - 1) / (pp v) times plain 1F1B's,
    the bubble (pp - 1) / v slots instead of pp - 1, the p2p payload over pp v - 1 boundaries."""
    from boostmpi.sim.machines import load_machine
    from boostmpi.sim.model import comm_bytes, predict

    machine = load_machine("a100-80gb")
    pp, v, M = 4, 2, 8

    def cfg(chunks):
        return config_from_dict({"model": dict(MODEL, n_layers=8, seq_len=256, d_model=256, d_ff=512, attn_rank=64,
                                               mlp_rank=64),
                                 "parallel": {"pp": pp, "virtual_stages": chunks},
                                 "train": {"grad_accum": M, "dtype": "bfloat16", "device": "gpu"}})

    plain, inter = predict(cfg(1), machine), predict(cfg(v), machine)
    ratio = inter.memory_bytes["activations"] / plain.memory_bytes["activations"]
    assert abs(ratio - (1 + (pp - 1) / (pp * v))) < 0.02, ratio
    slot = plain.details["forward_s"] + plain.details["backward_s"]
    bubble = lambda p: p.breakdown["pp_bubble_and_p2p"]  # noqa: E731
    # (pp - 1)(1 - 1/v) slots fewer, less the v times more sends on the path
    assert bubble(plain) - bubble(inter) > 0.8 * (pp - 1) * slot * (1 - 1 / v)
    assert comm_bytes(cfg(v))["pp"] * (pp - 1) == comm_bytes(cfg(1))["pp"] * (pp * v - 1)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
# NCCL in the default run; MPI carrying the device buffers (as tests/support/gpu_steps.py's tp2-pp2-mpi layout does
# for plain 1F1B) with the slow tests
@pytest.mark.parametrize("comm", ["nccl", pytest.param("mpi", marks=pytest.mark.slow)])
def test_interleaved_on_the_gpu_path(comm):
    """pp2 v2 and pp4 v2 on the GPU path (a real GPU, or the CuPy stand-in whose NCCL runs over MPI
    with NCCL's ordering rules) in float32: plain 1F1B's loss and gradients bit for bit, the CPU
    float64 run's within 1e-4."""
    from boostmpi.parallel.engine import Engine

    world_comm = world()
    pp = world_comm.Get_size()
    if pp not in (2, 4):
        pytest.skip("runs on 2 or 4 ranks")
    M = pp

    def run(v, device, dtype):
        cfg = config_from_dict({"model": dict(MODEL, n_layers=2 * pp),
                                "parallel": {"pp": pp, "virtual_stages": v, "comm": comm},
                                "train": dict(TRAIN, micro_batch_size=MICRO_BATCH, grad_accum=M, device=device,
                                              dtype=dtype)}, world_size=pp)
        engine = Engine(cfg, world_comm, local_rank=world_comm.Get_rank())
        loss = engine.forward_backward(batches(0, M))
        return loss, gather_global(engine, engine.grads)

    with abort_on_error():
        plain, inter = run(1, "gpu", "float32"), run(2, "gpu", "float32")
        cpu = run(1, "cpu", "float64")
    assert_all_ranks(inter[0] == plain[0] and abs(inter[0] - cpu[0]) <= 1e-4 * abs(cpu[0]),
                     lambda: f"loss {inter[0]!r}, plain {plain[0]!r}, cpu {cpu[0]!r}")

    def check():
        for name, g in cpu[1].items():
            assert np.array_equal(inter[1][name], plain[1][name]), name
            err = np.abs(inter[1][name].astype(np.float64) - g).max() / np.abs(g).max()
            assert err <= 1e-4, (name, err)

    on_root(check)


def test_sweep_keeps_the_configured_interleaving_where_there_is_a_pipeline():
    """--sweep from an interleaved config: layouts without a pipeline run plain 1F1B (not dropped),
    pipelined ones keep v; layouts train could not run (grad_accum not a multiple of pp) are left out."""
    from boostmpi.sim.machines import load_machine
    from boostmpi.sim.sweep import sweep

    cfg = config_from_dict({"model": dict(MODEL, n_layers=8), "parallel": {"pp": 2, "virtual_stages": 2},
                            "train": {"grad_accum": 2, "micro_batch_size": 2}})
    rows = sweep(cfg, load_machine("a100-80gb"), 4, archs=["cola"], keep_infeasible=True)
    assert {r["pp"] for r in rows} >= {1, 2}
    assert all(r["virtual_stages"] == (2 if r["pp"] > 1 else 1) for r in rows)
    assert all(r["grad_accum"] % r["pp"] == 0 for r in rows if r["pp"] > 1)
    assert not any(r["pp"] == 4 and r["dp"] == 1 for r in rows)  # grad_accum 2 with pp 4: train refuses it
