"""The parallel engine under MPI: every tp x pp x dp layout of the started ranks gives the loss and
every gradient of the single-rank run, over several optimizer steps, and moves exactly the bytes
docs/COMMUNICATION.md says.

Run with `mpiexec -n N python -m pytest --with-mpi tests/integration/test_parallel.py` for N in 1..4; the layouts
tested are those with tp * pp * dp = N, tp in {1, 2, 4}, pp in {1, 2, 3}, dp in {1, 2, 3}. A plain
`pytest` run lists them all as skipped. The single-rank reference runs on world rank 0 in the same
process (`Engine(cfg)` without a communicator).
"""

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from boostmpi.config import config_from_dict
from boostmpi.errors import ConfigError
from boostmpi.parallel.engine import Engine
from boostmpi.model.params import FlatBuffer, param_specs
from boostmpi.train.optim import AdamW, learning_rate
from boostmpi.train.trainer import optimizer_step as trainer_optimizer_step
from tests.support.global_tensors import gather_global
from tests.support.mpi_helpers import MPIEXEC, abort_on_error, assert_all_ranks, collectively, on_root, running_under_mpi, world

# vocab 61 is odd: the vocabulary-parallel embedding and head get uneven ranges
MODEL = dict(vocab_size=61, d_model=32, n_layers=4, n_heads=4, d_ff=48, attn_rank=8, mlp_rank=12, seq_len=8)
MICRO_BATCH = 2  # sequences per micro-batch per data-parallel rank
STEPS = 3
# the trainer's optimizer between steps, so that later steps start from updated weights; a warm-up
# of one step and a clip threshold below the gradient norm exercise the schedule and the clipping
TRAIN = {"lr": 0.01, "warmup_steps": 1, "steps": STEPS, "grad_clip": 0.5, "weight_decay": 0.1}
TOLERANCE = 1e-10


@dataclass(frozen=True)
class Case:
    tp: int
    pp: int
    dp: int
    arch: str
    tp_mode: str = "btp"
    norm: str = "online"
    grouped: bool = True
    recompute: str = "none"
    zero_stage: int = 0

    @property
    def id(self):
        return (f"tp{self.tp}-pp{self.pp}-dp{self.dp}-{self.arch}-{self.tp_mode}-{self.norm}-"
                f"{'grouped' if self.grouped else 'ungrouped'}-recompute_{self.recompute}-zero{self.zero_stage}")

    @property
    def grad_accum(self):
        return self.pp + 1  # enough micro-batches for every stage to reach the 1F1B steady state

    @property
    def n_kv_heads(self):
        # GQA (2 kv heads) wherever the layout allows; btp and Megatron shard kv heads over tp
        return 4 if self.tp == 4 and (self.tp_mode == "btp" or self.arch == "full") else 2

    def config(self, parallel=True):
        model = dict(MODEL, arch=self.arch, n_kv_heads=self.n_kv_heads)
        train = dict(TRAIN, dtype="float64", grad_accum=self.grad_accum, seed=21)
        if not parallel:  # the single-rank reference: the whole global batch in each micro-batch
            return config_from_dict({"model": model, "train": dict(train, micro_batch_size=MICRO_BATCH * self.dp)})
        par = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "tp_mode": self.tp_mode, "norm": self.norm,
               "grouped": self.grouped, "zero_stage": self.zero_stage}
        return config_from_dict({"model": model, "parallel": par,
                                 "train": dict(train, micro_batch_size=MICRO_BATCH, recompute=self.recompute)},
                                world_size=self.tp * self.pp * self.dp)


def layouts(world_size):
    return [(tp, pp, dp) for tp in (1, 2, 4) for pp in (1, 2, 3) for dp in (1, 2, 3) if tp * pp * dp == world_size]


# (arch, tp_mode, norm, grouped, recompute) on each layout with a tp axis: every tp strategy, both
# norms and both groupings for btp, both groupings for vanilla and Megatron, and recompute
WITH_TP = [
    ("cola", "btp", "online", True, "none"),
    ("cola", "btp", "sync", True, "none"),
    ("cola", "btp", "online", False, "none"),
    ("cola", "btp", "sync", False, "none"),
    ("svd", "btp", "online", True, "none"),
    ("svd", "btp", "sync", False, "none"),
    ("cola", "vanilla", "online", True, "none"),
    ("cola", "vanilla", "online", False, "none"),
    ("svd", "vanilla", "online", True, "none"),
    ("full", "vanilla", "online", True, "none"),
    ("full", "vanilla", "online", False, "none"),
    ("cola", "btp", "online", True, "layer"),
    ("svd", "btp", "sync", True, "lowrank"),
    ("cola", "vanilla", "online", False, "layer"),
]
# without a tp axis the tp options change only the code path, not the communication
WITHOUT_TP = [
    ("full", "vanilla", "online", True, "none"),
    ("svd", "btp", "online", True, "none"),
    ("cola", "btp", "sync", False, "none"),
    ("cola", "btp", "online", True, "layer"),
]
WORLD_SIZES = (1, 2, 3, 4)


# ZeRO-1 on every layout with a dp axis: the optimizer sharded over dp, with and without a tp axis
WITH_ZERO = [
    ("cola", "btp", "online", True, "none", 1),
    ("full", "vanilla", "online", False, "layer", 1),
]


def cases(world_size):
    return [Case(tp, pp, dp, *variant) for tp, pp, dp in layouts(world_size)
            for variant in (WITH_TP if tp > 1 else WITHOUT_TP) + (WITH_ZERO if dp > 1 else [])]


# On a layout where tp meets pp or dp, the default run takes these variants (btp and vanilla, both norms
# and groupings, recompute; every variant runs at tp alone, on two and four ranks); the others are `slow`
MIXED_DEFAULT = {
    ("cola", "btp", "online", True, "none"),
    ("svd", "btp", "sync", False, "none"),
    ("full", "vanilla", "online", True, "none"),
    ("cola", "btp", "online", True, "layer"),
}


def in_default_run(case):
    variant = (case.arch, case.tp_mode, case.norm, case.grouped, case.recompute)
    return case.tp == 1 or case.pp * case.dp == 1 or case.zero_stage or variant in MIXED_DEFAULT


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        sizes = [world().Get_size()] if running_under_mpi(metafunc.config) else WORLD_SIZES
        chosen = [c for n in sizes for c in cases(n)]
        metafunc.parametrize("case", [c if in_default_run(c) else pytest.param(c, marks=pytest.mark.slow)
                                      for c in chosen], ids=[c.id for c in chosen])


# ---------------------------------------------------------------------------- docs/COMMUNICATION.md

def layer_traffic(mode, N, C, K, F, Ra, Rm, grouped=True, norm="online"):
    """tp elements and calls of one layer and micro-batch: (forward, backward, forward calls, backward calls)."""
    groups = 4 if grouped else 7  # grouped: q/k/v share one all-reduce, gate/up one; else one per linear
    if mode == "btp":  # the rank-R activations, the two norm statistics riding along in the forward
        return N * (4 * Ra + 3 * Rm) + 2 * N, N * (4 * Ra + 3 * Rm), groups + (2 if norm == "sync" else 0), groups
    if mode == "vanilla":  # the full output after every B; backward, the input gradient of each A group
        return N * (3 * C + 2 * K + 2 * F), N * (3 * C + F) if grouped else N * (6 * C + F), groups, groups
    # Megatron: forward after o and down; backward, the input gradient of the column-parallel q/k/v, gate/up
    return 2 * N * C, 2 * N * C if grouped else 5 * N * C, 2, 2 if grouped else 5


def embedding_and_head_traffic(mode, N, C, p):
    """tp elements and calls of the embedding and the head, forward and backward, per micro-batch."""
    cross_entropy = N + 2 * N  # max, then (sum-exp, target logit): two all-reduces
    if mode == "btp":  # all-gather of the residual shards; backward, all-reduce of the normed input's gradient
        return N * C // p + cross_entropy + N * C, 1 + 2 + 1
    return N * C + cross_entropy + N * C, 1 + 2 + 1  # vocabulary-parallel embedding all-reduce first


def expected_traffic(case, itemsize=8):
    """Bytes per axis and tp/pp calls of one optimizer step, from the formulas of docs/COMMUNICATION.md."""
    C, F, L = MODEL["d_model"], MODEL["d_ff"], MODEL["n_layers"]
    K = case.n_kv_heads * (C // MODEL["n_heads"])
    N, M, p = MICRO_BATCH * MODEL["seq_len"], case.grad_accum, case.tp
    mode = case.tp_mode if case.arch != "full" else "megatron"

    tp_elements = tp_calls = 0
    if p > 1:
        fwd, bwd, calls_fwd, calls_bwd = layer_traffic(mode, N, C, K, F, MODEL["attn_rank"], MODEL["mlp_rank"],
                                                       case.grouped, case.norm)
        edges, edge_calls = embedding_and_head_traffic(mode, N, C, p)
        forwards = 2 if case.recompute == "layer" else 1  # "layer" re-issues the forward collectives
        tp_elements = case.dp * M * (L * (forwards * fwd + bwd) + edges)
        tp_calls = case.dp * M * (L * (forwards * calls_fwd + calls_bwd) + edge_calls)

    shard = C // p if mode == "btp" else C
    pp_calls = p * case.dp * M * 2 * (case.pp - 1)
    pp_elements = pp_calls * N * shard

    dp_elements = replica_parameter_count(case, mode, K) if case.dp > 1 else 0
    if case.zero_stage and case.dp > 1:
        # ZeRO-1: the gradient is reduce-scattered (each member contributes the whole bucket, the same
        # bytes as the all-reduce) and the updated slices all-gathered: each dp group counts the
        # piece of its rank 0, ceil(local buffer / dp)
        cfg = case.config()
        for t in range(case.tp):
            for s in range(case.pp):
                local = sum(spec.local_numel for spec in param_specs(cfg, t, s))
                dp_elements += -(-local // case.dp)
    return {"bytes": {"tp": tp_elements * itemsize, "pp": pp_elements * itemsize, "dp": dp_elements * itemsize},
            "calls": {"tp": tp_calls, "pp": pp_calls}}


def replica_parameter_count(case, mode, K):
    """Local parameters summed over the ranks of one data-parallel replica (tp-replicated ones per tp rank)."""
    C, F, L, V = MODEL["d_model"], MODEL["d_ff"], MODEL["n_layers"], MODEL["vocab_size"]
    shapes = {"q": (C, C), "k": (C, K), "v": (C, K), "o": (C, C), "gate": (C, F), "up": (C, F), "down": (F, C)}
    rank = {lin: MODEL["attn_rank"] if lin in "qkvo" else MODEL["mlp_rank"] for lin in shapes}
    if case.arch == "full":
        linears = sum(d_in * d_out for d_in, d_out in shapes.values())
    else:
        linears = sum(rank[lin] * (d_in + d_out) for lin, (d_in, d_out) in shapes.items())
    total = 2 * V * C + C + L * (2 * C + linears)
    replicated = C if mode == "btp" else C + 2 * C * L  # final norm; under Megatron-style TP every norm
    return total + (case.tp - 1) * replicated


# ---------------------------------------------------------------------------- the run

def global_batch(case, step):
    """This step's tokens: per data-parallel rank M micro-batches of MICRO_BATCH sequences."""
    rng = np.random.default_rng(1000 + step)
    return rng.integers(0, MODEL["vocab_size"], (case.dp * case.grad_accum * MICRO_BATCH, MODEL["seq_len"] + 1))


def micro_batches(tokens, case, dp_rank):
    out = []
    for k in range(case.grad_accum):
        start = (dp_rank * case.grad_accum + k) * MICRO_BATCH
        rows = tokens[start:start + MICRO_BATCH]
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def single_rank_micro_batches(tokens, case):
    """Micro-batch k of the reference holds micro-batch k of every data-parallel rank."""
    per_rank = [micro_batches(tokens, case, r) for r in range(case.dp)]
    return [(np.concatenate([mbs[k][0] for mbs in per_rank]), np.concatenate([mbs[k][1] for mbs in per_rank]))
            for k in range(case.grad_accum)]


def worst_relative_error(tensors, reference):
    """(name, max |t - ref| / max |ref|) of the worst tensor."""
    assert set(tensors) == set(reference), sorted(set(tensors) ^ set(reference))
    errors = {n: float(np.abs(tensors[n] - ref).max() / max(np.abs(ref).max(), 1e-300)) for n, ref in reference.items()}
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


def summed_traffic(engine):
    """This step's counters summed over all ranks (each group counts its collectives once)."""
    from mpi4py import MPI

    counter = engine.grid.counter
    byte_axes, call_axes = ("tp", "pp", "dp"), ("tp", "pp")
    totals = np.array([counter.bytes[a] for a in byte_axes] + [counter.calls[a] for a in call_axes], dtype=np.int64)
    world().Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
    totals = totals.tolist()
    return {"bytes": dict(zip(byte_axes, totals[:3])), "calls": dict(zip(call_axes, totals[3:]))}


def replica_disagreement(engine, grads):
    """Largest relative difference of what must be equal on several ranks: the whole dp-summed gradient
    `grads` and the parameters across data-parallel replicas, and tp-replicated parameters' gradients
    across the tp group."""
    worst = 0.0
    comm = engine.grid.dp.comm
    if comm is not None:
        for mine in (grads.data, engine.params.data):
            for other in comm.allgather(mine):
                worst = max(worst, float(np.abs(other - mine).max() / np.abs(mine).max()))
    comm = engine.grid.tp.comm
    if comm is not None:
        for s in engine.specs:
            if s.tp_replicated:
                mine = grads[s.name]
                for other in comm.allgather(np.array(mine)):
                    worst = max(worst, float(np.abs(other - mine).max() / np.abs(mine).max()))
    return worst


def optimizer_step(engine, optimizer, step):
    """What the trainer does after forward_backward: global-norm clipping, then AdamW. Returns the norm."""
    return trainer_optimizer_step(engine, optimizer, learning_rate(step, engine.cfg.train), TRAIN["grad_clip"])


def summed_gradient(engine):
    """The dp-summed gradient as a FlatBuffer: under ZeRO-1 each rank holds only its slice of the sum,
    so the slices are gathered here (test-side, outside the counted traffic)."""
    if not engine.data_parallel.sharded:
        return engine.grads
    from mpi4py import MPI

    full = FlatBuffer(engine.specs, engine.grads.data.dtype)
    counts = [b - a for a, b in engine.data_parallel.ranges]
    lo, hi = engine.shard
    full.data[lo:hi] = engine.data_parallel.grad_shard
    engine.grid.dp.comm.Allgatherv(MPI.IN_PLACE, [full.data, counts, [a for a, _ in engine.data_parallel.ranges], MPI.DOUBLE])
    return full


def free_communicators(engine):
    for group in (engine.grid.tp, engine.grid.pp, engine.grid.dp):
        if group.comm is not None:
            group.comm.Free()


@pytest.mark.mpi
def test_layout_matches_single_rank_and_communication_formulas(case):
    with abort_on_error():  # anything but a failure raised on every rank together ends the job
        run_and_compare(case)


def run_and_compare(case):
    comm = world()
    rank = comm.Get_rank()
    reference = on_root(lambda: Engine(case.config(parallel=False)))
    reference_optimizer = on_root(lambda: AdamW(reference.params, reference.specs, reference.cfg.train))
    engine = Engine(case.config(), comm)
    optimizer = AdamW(engine.params, engine.specs, engine.cfg.train, shard=engine.shard)
    expected = expected_traffic(case)
    initial = gather_global(engine, engine.params)  # each shard drawn on its own: the same under any layout
    worst = on_root(lambda: worst_relative_error(initial, gather_global(reference, reference.params)))
    assert_all_ranks(rank != 0 or worst[1] == 0.0, lambda: f"initial parameters differ: {worst}")
    for step in range(STEPS):
        tokens = global_batch(case, step)
        ref = on_root(lambda: (reference.forward_backward(single_rank_micro_batches(tokens, case)),
                               gather_global(reference, reference.grads)))
        engine.grid.counter.reset()
        loss = engine.forward_backward(micro_batches(tokens, case, engine.grid.coords.dp))
        summed = summed_gradient(engine)
        grads = gather_global(engine, summed)
        disagreement = replica_disagreement(engine, summed)
        ref_loss = comm.bcast(ref[0] if rank == 0 else None)
        assert_all_ranks(abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss),
                         lambda: f"step {step}: loss {loss!r}, single rank {ref_loss!r}")
        worst = on_root(lambda: worst_relative_error(grads, ref[1]))
        assert_all_ranks(rank != 0 or worst[1] <= TOLERANCE,
                         lambda: f"step {step}: gradient of {worst[0]} off by {worst[1]:.2e} (relative)")
        assert_all_ranks(disagreement <= 1e-13, lambda: f"step {step}: replicas differ by {disagreement:.2e}")
        ref_norm = comm.bcast(on_root(lambda: optimizer_step(reference, reference_optimizer, step)))
        grad_norm = optimizer_step(engine, optimizer, step)
        traffic = summed_traffic(engine)  # the step's: forward, backward and the optimizer's all-gather
        assert_all_ranks(traffic == expected,
                         lambda: f"step {step}: counted {traffic}, docs/COMMUNICATION.md says {expected}")
        assert_all_ranks(abs(grad_norm - ref_norm) <= TOLERANCE * ref_norm,
                         lambda: f"step {step}: gradient norm {grad_norm!r}, single rank {ref_norm!r}")
    params = gather_global(engine, engine.params)
    worst = on_root(lambda: worst_relative_error(params, gather_global(reference, reference.params)))
    assert_all_ranks(rank != 0 or worst[1] <= TOLERANCE, lambda: f"parameters after {STEPS} steps: {worst}")
    free_communicators(engine)


def zero_layouts(world_size):
    return [(tp, pp, dp) for tp, pp, dp in layouts(world_size) if dp > 1]


@pytest.mark.mpi(min_size=2)
def test_zero_stage_1_gives_the_losses_of_zero_stage_0():
    """ZeRO-1 against the replicated optimizer on the same ranks, every dp layout of this world size:
    losses within 1e-12 relative over several steps (float64). The gradients of the two are the same
    sums (at dp = 2 a + b either way); the norm's sum of squares is taken over other partial sums
    (the dp slices instead of whole tensors), which may move the clip coefficient by an ulp."""
    comm = world()
    with abort_on_error():
        for tp, pp, dp in zero_layouts(comm.Get_size()):
            losses = {}
            for zero in (0, 1):
                case = Case(tp, pp, dp, "cola", zero_stage=zero)
                engine = Engine(case.config(), comm)
                optimizer = AdamW(engine.params, engine.specs, engine.cfg.train, shard=engine.shard)
                losses[zero] = []
                for step in range(STEPS + 2):
                    tokens = global_batch(case, step)
                    losses[zero].append(engine.forward_backward(micro_batches(tokens, case, engine.grid.coords.dp)))
                    optimizer_step(engine, optimizer, step)
                free_communicators(engine)
            worst = max(abs(a - b) / abs(a) for a, b in zip(losses[0], losses[1]))
            assert_all_ranks(worst <= 1e-12, lambda: f"tp{tp}-pp{pp}-dp{dp}: zero_stage 1 losses {losses[1]} "
                                                     f"differ from zero_stage 0 {losses[0]} by {worst:.2e}")


def test_formulas_reduce_to_the_papers_numbers():
    """With one rank r for every factor and no GQA: 7·b·s·r (btp), (5d + 2 d_ff)·b·s (vanilla), 2·b·s·d (Megatron)."""
    N, C, F, r = 16, 32, 48, 8
    fwd, bwd, calls_online, _ = layer_traffic("btp", N, C, C, F, r, r)
    assert (fwd, bwd) == (7 * N * r + 2 * N, 7 * N * r)
    assert layer_traffic("btp", N, C, C, F, r, r, norm="sync")[2] == calls_online + 2
    assert layer_traffic("vanilla", N, C, C, F, r, r)[0] == (5 * C + 2 * F) * N
    assert layer_traffic("megatron", N, C, C, F, r, r)[:2] == (2 * N * C, 2 * N * C)


# ---------------------------------------------------------------------------- bad layouts, failure reporting

@pytest.mark.mpi
def test_world_size_other_than_tp_pp_dp_is_a_config_error_on_every_rank():
    n = world().Get_size()

    def check():
        for parallel in ({"dp": n + 1}, {"tp": 2, "dp": n}, {"pp": 2, "dp": 2 * n}):
            with pytest.raises(ConfigError, match=f"but {n} MPI rank"):
                config_from_dict({"model": dict(MODEL, n_kv_heads=2), "parallel": parallel}, world_size=n)
            # the engine refuses a grid that does not fit its communicator before communicating
            cfg = config_from_dict({"model": dict(MODEL, n_kv_heads=2), "parallel": parallel})
            with pytest.raises(ConfigError, match=f"but {n} MPI rank"):
                Engine(cfg, world())

    collectively(check)


@pytest.mark.mpi(min_size=2)
def test_a_failure_on_one_rank_fails_every_rank():
    rank = world().Get_rank()
    assert_all_ranks(True, "never shown")
    with pytest.raises(AssertionError, match="rank 1: only rank one disagrees"):
        assert_all_ranks(rank != 1, "only rank one disagrees")

    def fails_on_rank_one():
        if rank == 1:
            pytest.fail("pytest.fail on rank 1")  # BaseException-derived: must be caught as well

    with pytest.raises(AssertionError, match="rank 1: Failed: pytest.fail on rank 1"):
        collectively(fails_on_rank_one)


@pytest.mark.mpi_skip  # it starts an MPI job of its own
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_pytest_exit_status_is_nonzero_on_every_rank_when_one_rank_fails(tmp_path):
    (tmp_path / "test_one_rank_fails.py").write_text(textwrap.dedent("""
        from mpi4py import MPI
        import pytest

        @pytest.mark.mpi
        def test_fails_on_rank_one():
            assert MPI.COMM_WORLD.Get_rank() != 1
    """))
    # each rank records its own pytest exit status; tests/conftest.py is loaded as a plugin (tests.conftest: the
    # repository root is on the children's PYTHONPATH)
    runner = textwrap.dedent(f"""
        import pytest
        code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "--with-mpi", {str(tmp_path)!r}])
        from mpi4py import MPI
        open({str(tmp_path)!r} + f"/status_{{MPI.COMM_WORLD.Get_rank()}}", "w").write(str(int(code)))
    """)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    run = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", runner], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    statuses = {r: (tmp_path / f"status_{r}").read_text() for r in (0, 1) if (tmp_path / f"status_{r}").exists()}
    assert statuses == {0: "1", 1: "1"}, (statuses, run.stdout[-2000:], run.stderr[-2000:])
    assert "tests failed on rank(s) [1]" in run.stderr


@pytest.mark.mpi(min_size=2)
def test_zero_stage_1_all_gathers_bf16_pieces_over_mpi():
    """The bf16 compute buffer of ZeRO-1 under mixed precision (a type MPI has no name for) all-gathered
    over MPI, pieces of unequal length, counted as group rank 0's piece in bf16 bytes."""
    import ml_dtypes

    from boostmpi.parallel.comm import CommCounter, Group

    comm = world()
    n, size = 7, comm.Get_size()
    counts = [len(range(n)[r::size]) for r in range(size)]  # near-equal, the first ones longer
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    want = (np.arange(n) + 0.5).astype(ml_dtypes.bfloat16)
    buf = np.zeros(n, dtype=ml_dtypes.bfloat16)
    me = comm.Get_rank()
    buf[starts[me]:starts[me] + counts[me]] = want[starts[me]:starts[me] + counts[me]]
    counter = CommCounter()
    with abort_on_error():
        Group("dp", comm, counter).allgather_pieces(buf, counts)
    counted = comm.allreduce(counter.bytes["dp"])  # each group's traffic is counted once, by one member
    ok = np.array_equal(buf.view(np.uint16), want.view(np.uint16)) and counted == 2 * counts[0]
    assert_all_ranks(ok, lambda: f"{buf} != {want} or counted {counted} bytes")
