"""Validation through a pipeline (`Engine.evaluate_batches`): the sums equal one rank's in float64, and
the batches are pipelined through the stages (about n + pp - 1 stage forwards for n batches, not n x pp),
shown on a logical timeline rebuilt from the order each rank ran its forwards and its host sums in.

Run with `timeout 600 mpiexec -n N python -m pytest --with-mpi -m mpi tests/unit/parallel/test_pipelined_eval.py`,
N = 2 (pp2, pp2 v2) or 4 (pp4, tp2 x pp2, pp2 x dp2, pp4 v2).
"""

import numpy as np
import pytest

from boostmpi.config import config_from_dict
from tests.support.mpi_helpers import abort_on_error, assert_all_ranks, on_root, world

MODEL = dict(vocab_size=61, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, attn_rank=8, mlp_rank=12, seq_len=8)
ROWS, BATCHES = 2, 8  # windows per batch and data-parallel rank; batches per evaluation

# name -> (tp, pp, virtual_stages, n_layers, dp)
CASES = {
    "pp2": (1, 2, 1, 4, 1),
    "pp2-v2": (1, 2, 2, 4, 1),
    "pp4": (1, 4, 1, 4, 1),
    "tp2-pp2": (2, 2, 1, 4, 1),
    "pp2-dp2": (1, 2, 1, 4, 2),
    "pp4-v2": (1, 4, 2, 8, 1),
}


def config(tp, pp, v, n_layers, dp):
    return config_from_dict({"model": dict(MODEL, n_layers=n_layers),
                             "parallel": {"tp": tp, "pp": pp, "dp": dp, "virtual_stages": v},
                             "train": {"dtype": "float64", "seed": 7, "micro_batch_size": ROWS, "grad_accum": pp}},
                            world_size=tp * pp * dp)


def windows(dp):
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, MODEL["vocab_size"], (BATCHES, dp * ROWS, MODEL["seq_len"] + 1))
    return tokens[..., :-1], tokens[..., 1:]


def batches_of(engine, dp):
    """This rank's entries: batch k of its data-parallel replica; the last replica has none in batch 5."""
    x, y = windows(dp)
    r = engine.grid.coords.dp
    rows = slice(r * ROWS, (r + 1) * ROWS)
    return [None if (k == 5 and r == dp - 1 and dp > 1) else (x[k, rows], y[k, rows]) for k in range(BATCHES)]


def run_case(name):
    from boostmpi.parallel.engine import Engine

    tp, pp, v, n_layers, dp = CASES[name]
    with abort_on_error():
        engine = Engine(config(tp, pp, v, n_layers, dp), world())
        got = engine.evaluate_batches(batches_of(engine, dp))

        def reference():
            one = Engine(config_from_dict({"model": dict(MODEL, n_layers=n_layers),
                                           "train": {"dtype": "float64", "seed": 7, "micro_batch_size": ROWS}}))
            x, y = windows(dp)
            skip = ROWS if dp > 1 else 0  # batch 5 without the last replica's rows
            return [one.evaluate(x[k, :dp * ROWS - skip], y[k, :dp * ROWS - skip]) if k == 5 else
                    one.evaluate(x[k], y[k]) for k in range(BATCHES)]

        want = world().bcast(on_root(reference))
    return engine, got, want


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_evaluation_equals_one_rank(name):
    tp, pp, v, n_layers, dp = CASES[name]
    if tp * pp * dp != world().Get_size():
        pytest.skip(f"{name} runs on {tp * pp * dp} ranks")
    _, got, want = run_case(name)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert_all_ranks(len(got) == BATCHES and worst <= 1e-12, lambda: f"sums {got}, one rank {want} ({worst:.1e})")


def makespan(events, n_stages):
    """Length of the logical timeline of every rank's recorded events, each forward one unit: a forward of
    (chunk c, batch i) on stage s starts after the rank's previous event and after (c, i) left stage s - 1
    (stage 0: (c - 1, i) left the last stage); a host sum is a barrier of every rank."""
    done, clock, index = {}, {s: 0 for s in events}, {s: 0 for s in events}
    while any(index[s] < len(events[s]) for s in events):
        moved = False
        for s in events:
            while index[s] < len(events[s]) and events[s][index[s]][0] == "F":
                _, c, i = events[s][index[s]]
                before = (s - 1, c, i) if s > 0 else ((n_stages - 1, c - 1, i) if c > 0 else None)
                if before is not None and before not in done:
                    break
                clock[s] = max(clock[s], done.get(before, 0)) + 1
                done[s, c, i] = clock[s]
                index[s] += 1
                moved = True
        if not moved:  # no forward can run: every rank still going waits at a host sum; release them together
            waiting = [s for s in events if index[s] < len(events[s])]
            assert len(waiting) == len(events) and all(events[s][index[s]][0] == "sum" for s in waiting), "deadlock"
            t = max(clock.values())
            for s in waiting:
                clock[s], index[s] = t, index[s] + 1
    return max(clock.values())


def timeline(name, evaluate):
    """(makespan, n_stages, n_chunks) of `evaluate(engine, batches)` for case `name`, in stage-chunk forwards."""
    from boostmpi.parallel.engine import Engine

    tp, pp, v, n_layers, dp = CASES[name]
    comm = world()
    with abort_on_error():
        engine = Engine(config(tp, pp, v, n_layers, dp), comm)
        batches = batches_of(engine, dp)
        which = {id(b[0]): k for k, b in enumerate(batches) if b is not None}
        events = []
        forward, host_sum = engine._stage_forward, engine.grid.host.sum

        def recorded_forward(x, y, h, keep=True, chunk=0):
            events.append(("F", chunk, which[id(x)]))
            return forward(x, y, h, keep=keep, chunk=chunk)

        def recorded_sum(values):
            events.append(("sum", 0, 0))
            return host_sum(values)

        engine._stage_forward, engine.grid.host.sum = recorded_forward, recorded_sum
        try:
            evaluate(engine, batches)
        finally:
            del engine._stage_forward, engine.grid.host.sum
        gathered = comm.gather((engine.stage, events), root=0)
    if comm.Get_rank() != 0:
        return None
    return makespan(dict(gathered), pp), pp, v


def pipelined(engine, batches):
    return engine.evaluate_batches(batches)


def one_batch_at_a_time(engine, batches):  # the mutant: each batch through every stage, then its sum
    return [engine.evaluate_batches([b])[0] for b in batches]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["pp2", "pp4", "pp2-v2", "pp4-v2"])
def test_batches_are_pipelined_through_the_stages(name):
    """n + pp·v - 1 chunk forwards at most on the logical timeline (one stage-chunk forward a unit); the
    mutant that evaluates one batch at a time through all stages takes n·pp·v and fails the same check."""
    tp, pp, v, n_layers, dp = CASES[name]
    if tp * pp * dp != world().Get_size():
        pytest.skip(f"{name} runs on {tp * pp * dp} ranks")
    bound = v * BATCHES + pp * v - 1
    for evaluate, should_pass in ((pipelined, True), (one_batch_at_a_time, False)):
        result = timeline(name, evaluate)
        ok = True
        if result is not None:
            span = result[0]
            ok = (span <= bound) == should_pass
            if should_pass and v == 1:
                ok = ok and span == BATCHES + pp - 1
            if not should_pass:
                ok = ok and span == BATCHES * pp * v
        assert_all_ranks(ok, lambda: f"{evaluate.__name__}: timeline {result}, bound {bound}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["pp2-v2", "pp4-v2"])
def test_batches_beyond_a_block_are_evaluated_a_block_at_a_time_with_the_same_sums(name, monkeypatch):
    from boostmpi.parallel import engine as engine_module

    tp, pp, v, n_layers, dp = CASES[name]
    if tp * pp * dp != world().Get_size():
        pytest.skip(f"{name} runs on {tp * pp * dp} ranks")
    with abort_on_error():
        engine = engine_module.Engine(config(tp, pp, v, n_layers, dp), world())
        batches = batches_of(engine, dp)
        whole = engine.evaluate_batches(batches)
        sums, host_sum = [], engine.grid.host.sum
        monkeypatch.setattr(engine.grid.host, "sum", lambda values: sums.append(len(values)) or host_sum(values))
        monkeypatch.setattr(engine_module, "EVAL_BLOCK", 3)
        blocked = engine.evaluate_batches(batches)
    # 8 batches in blocks of 3: three pipelined passes, one host sum each, the sums bit for bit
    assert_all_ranks(blocked == whole and sums == [3, 3, 2], lambda: f"blocked {blocked}, whole {whole}, sums {sums}")


@pytest.mark.mpi_skip  # one process
def test_a_forward_that_no_backward_follows_keeps_nothing_of_the_head():
    """Validation's forward (keep = False) runs the head lean: its cache holds neither the probabilities
    [tokens, vocabulary] nor the normed input, so nothing of a batch's head outlives its forward; a
    training forward (recompute = none) keeps the probabilities for its backward."""
    from boostmpi.parallel.engine import Engine

    eng = Engine(config(1, 1, 1, 2, 1))
    x, y = windows(1)
    _, saved = eng._stage_forward(x[0], y[0], None, keep=False)
    assert saved["head"].probs is None and saved["head"].logits is None and saved["head"].n is None
    _, saved = eng._stage_forward(x[0], y[0], None, keep=True)
    assert saved["head"].probs is not None
