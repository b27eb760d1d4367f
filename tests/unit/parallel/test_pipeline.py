"""The pipeline as the engine runs it: `Engine.forward_backward`'s own loop, with its stage passes
and pipeline messages replaced by fakes that record the call sequence; its invariants, and a
simulated multi-rank run of those sequences with blocking receives that must finish, where every
message must be matched by its tag to the one the receiving step needs.

Plain 1F1B (one layer chunk per rank) and interleaved 1F1B (`parallel.virtual_stages` chunks per
rank). The same simulated run, with unit-cost stage passes on a logical clock, measures the
pipeline bubble: idle time over ideal compute time, (pp - 1) / (v m) by the formula.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from boostmpi.parallel import pipeline
from boostmpi.parallel.comm import HostCollectives
from boostmpi.parallel.data_parallel import DataParallel
from boostmpi.parallel.engine import Engine
from boostmpi.parallel.pipeline import one_f_one_b, schedule

SHAPES = [(stages, micro, 1) for stages in (1, 2, 3, 4, 5) for micro in (1, 2, 3, 4, 7, 8)]
# interleaved: micro-batches a multiple of the stages (one to three groups), two and three chunks
INTERLEAVED = [(stages, stages * groups, chunks) for stages in (2, 3, 4, 5) for groups in (1, 2, 3)
               for chunks in (2, 3)]
B, T, WIDTH = 2, 3, 4


class _Request:
    def wait(self):
        return None


class _PipelineGroup:
    """Records the engine's point-to-point calls; a receive fills its buffer with its tag."""

    def __init__(self, calls):
        self.calls = calls

    def isend(self, buf, dest, tag=0):
        self.calls.append(("send", dest, tag))
        return _Request()

    def irecv(self, buf, source, tag=0):
        self.calls.append(("recv", source, tag))
        buf[...] = tag
        return _Request()


class RecordingEngine(Engine):
    """The engine's forward_backward loop around fake stage passes: F(chunk, mb) and B(chunk, mb) are
    recorded in the order the loop runs them, between the pipeline messages it sends and receives."""

    def __init__(self, n_stages, stage, n_chunks=1):
        self.calls = []
        self.xp, self.cdtype = np, np.float32
        self.stage, self.n_stages, self.n_chunks = stage, n_stages, n_chunks
        self.first, self.last = stage == 0, stage == n_stages - 1
        group_of_one = SimpleNamespace(size=1, overlap=True)
        self.grid = SimpleNamespace(pp=_PipelineGroup(self.calls), dp=group_of_one, dp_size=1,
                                    coords=SimpleNamespace(tp=0), host=HostCollectives(None))
        self.tp_layers = SimpleNamespace(res_cols=(0, WIDTH))
        self.grads, self.params = SimpleNamespace(data=np.zeros(1)), None
        self.data_parallel = DataParallel(group_of_one, 0, 1, 0, [], {}, 0, np, np.float32)  # no buckets, no ZeRO-1
        self.accounted = []

    def _refresh_compute_params(self):
        pass

    def _account_saved(self, saved_of_chunks):
        self.accounted.append([saved["chunk"] for saved in saved_of_chunks])

    def _grad_sq(self):
        return 0.0

    def _stage_forward(self, x, y, h, keep=True, chunk=0):
        mb = int(x[0, 0])
        first, last = self.first and chunk == 0, self.last and chunk == self.n_chunks - 1
        assert (h is None) == first  # only the first virtual stage receives nothing
        self.calls.append(("F", chunk, mb))
        out = 0.0 if last else np.full((B * T, WIDTH), mb, dtype=self.cdtype)
        return out, {"mb": mb, "chunk": chunk, "layers": []}

    def _stage_backward(self, dh, saved, shape, scale, on_bucket_done, chunk=0):
        assert saved["chunk"] == chunk
        assert (dh is None) == (self.last and chunk == self.n_chunks - 1)
        self.calls.append(("B", chunk, saved["mb"]))
        return np.full((B * T, WIDTH), saved["mb"], dtype=self.cdtype)


def engine_calls(n_stages, stage, n_micro, n_chunks=1):
    """Everything Engine.forward_backward of `stage` did, in order: ("F"|"B", chunk, mb),
    ("send"|"recv", peer, tag)."""
    engine = RecordingEngine(n_stages, stage, n_chunks)
    micro = [(np.full((B, T), mb), np.full((B, T), mb)) for mb in range(n_micro)]
    engine.forward_backward(micro)
    return engine.calls


def recorded_calls(n_stages, stage, n_micro, n_chunks=1):
    """The stage passes the engine ran, in order."""
    return [c for c in engine_calls(n_stages, stage, n_micro, n_chunks) if c[0] in ("F", "B")]


ALL = SHAPES + INTERLEAVED


@pytest.mark.parametrize("n_stages,n_micro,n_chunks", ALL)
def test_each_rank_runs_every_micro_batch_once_each_way_per_chunk(n_stages, n_micro, n_chunks):
    for stage in range(n_stages):
        calls = recorded_calls(n_stages, stage, n_micro, n_chunks)
        assert calls == schedule(n_stages, stage, n_micro, n_chunks)
        for chunk in range(n_chunks):
            forwards = [mb for kind, c, mb in calls if kind == "F" and c == chunk]
            backwards = [mb for kind, c, mb in calls if kind == "B" and c == chunk]
            # in order, once each: every rank runs a chunk's micro-batches in the order they arrive
            assert forwards == list(range(n_micro))
            assert backwards == list(range(n_micro))
            for mb in range(n_micro):
                assert calls.index(("F", chunk, mb)) < calls.index(("B", chunk, mb))


@pytest.mark.parametrize("n_stages,n_micro,n_chunks", SHAPES)
def test_plain_schedule_is_one_f_one_b(n_stages, n_micro, n_chunks):
    for stage in range(n_stages):
        assert recorded_calls(n_stages, stage, n_micro) == [(k, 0, mb) for k, mb in one_f_one_b(n_stages, stage, n_micro)]


@pytest.mark.parametrize("n_stages,n_micro,n_chunks", ALL)
def test_warm_up_and_activations_in_flight(n_stages, n_micro, n_chunks):
    """Warm-up forwards, then strict alternation; the most chunk activations held at once is the
    warm-up + 1: pp - s micro-batches under plain 1F1B, (v - 1) pp + 2 (pp - s - 1) + 1 chunks
    interleaved (all of them when fewer)."""
    for stage in range(n_stages):
        calls = recorded_calls(n_stages, stage, n_micro, n_chunks)
        if n_chunks == 1:
            warmup = min(n_stages - stage - 1, n_micro)
        else:
            warmup = min((n_chunks - 1) * n_stages + 2 * (n_stages - stage - 1), n_chunks * n_micro)
        assert all(kind == "F" for kind, _, _ in calls[:warmup])
        units = n_chunks * n_micro
        steady = calls[warmup:warmup + 2 * (units - warmup)]
        assert [kind for kind, _, _ in steady] == ["F", "B"] * (units - warmup)
        in_flight, peak = 0, 0
        for kind, _, _ in calls:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(warmup + 1, units), (stage, calls)


def test_schedules_by_hand():
    assert one_f_one_b(1, 0, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b(3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert one_f_one_b(3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    # two ranks, two chunks, two micro-batches: rank 1 starts the backward as soon as chunk 1 of
    # micro-batch 0 is through (a warm-up of (v - 1) pp = 2 units); rank 0 runs every forward first
    assert schedule(2, 1, 2, 2) == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1),
                                    ("B", 0, 0), ("B", 0, 1)]
    assert schedule(2, 0, 2, 2) == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
                                    ("B", 1, 0), ("B", 1, 1), ("B", 0, 0), ("B", 0, 1)]
    with pytest.raises(ValueError, match="divisible"):
        schedule(2, 0, 3, 2)


@pytest.mark.parametrize("n_stages,n_micro,n_chunks", [(2, 2, 2), (3, 6, 3), (1, 3, 1), (4, 8, 2)])
def test_saved_bytes_are_accounted_for_the_first_micro_batch_of_every_chunk(n_stages, n_micro, n_chunks):
    for stage in range(n_stages):
        engine = RecordingEngine(n_stages, stage, n_chunks)
        engine.forward_backward([(np.full((B, T), mb), np.full((B, T), mb)) for mb in range(n_micro)])
        assert engine.accounted == [list(range(n_chunks))]


# ---------------------------------------------------------------------------- simulated execution

def virtual_stage(n_stages, stage, chunk):
    return chunk * n_stages + stage


def simulate(calls_of, n_chunks=1, cost=None, latency=0.0):
    """Run every rank's recorded calls (engine_calls) together; return (global order of passes, finish
    time of each rank, busy time of each rank).

    Sends never block (they are non-blocking and waited at the end of the step); a receive blocks
    until the message with its (source, destination, tag) has been sent. Each message must carry
    what the receiving pass needs: a forward of virtual stage j the activation of the same
    micro-batch from j - 1, a backward the gradient from j + 1. `cost(kind)` is a pass's duration on
    a logical clock (a message arrives `latency` after its pass ends). Raises RuntimeError on a deadlock.
    """
    n_stages = len(calls_of)
    cost = cost or (lambda kind: 1.0)
    position = [0] * n_stages
    clock, busy = [0.0] * n_stages, [0.0] * n_stages
    mailbox = {}  # (source, dest, tag) -> (arrival time, (kind, virtual stage, mb) of the pass that sent it)
    pending = [None] * n_stages  # a received message, waiting for the pass that follows it
    last_pass = [None] * n_stages
    order = []
    while any(position[s] < len(calls_of[s]) for s in range(n_stages)):
        progressed = False
        for s in range(n_stages):
            calls = calls_of[s]
            while position[s] < len(calls):
                call = calls[position[s]]
                if call[0] == "recv":
                    key = (call[1], s, call[2])
                    if key not in mailbox:
                        break
                    arrival, pending[s] = mailbox.pop(key)
                    clock[s] = max(clock[s], arrival)
                elif call[0] == "send":
                    key = (s, call[1], call[2])
                    assert key not in mailbox, f"two messages in flight with one tag: {key}"
                    mailbox[key] = (clock[s] + latency, last_pass[s])
                else:
                    kind, chunk, mb = call
                    j = virtual_stage(n_stages, s, chunk)
                    if pending[s] is not None:
                        want = ("F", j - 1, mb) if kind == "F" else ("B", j + 1, mb)
                        assert pending[s] == want, f"rank {s} {call} received {pending[s]}, needs {want}"
                        pending[s] = None
                    clock[s] += cost(kind)
                    busy[s] += cost(kind)
                    last_pass[s] = (kind, j, mb)
                    order.append((s, kind, chunk, mb))
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: calls_of[s][position[s]] for s in range(n_stages) if position[s] < len(calls_of[s])}
            raise RuntimeError(f"deadlock: ranks wait at {stuck}")
    assert not mailbox, f"messages never received: {sorted(mailbox)}"
    return order, clock, busy


@pytest.mark.parametrize("n_stages,n_micro,n_chunks", ALL)
def test_simulated_pipeline_completes_and_every_message_meets_its_pass(n_stages, n_micro, n_chunks):
    order, _, _ = simulate([engine_calls(n_stages, s, n_micro, n_chunks) for s in range(n_stages)], n_chunks)
    assert len(order) == 2 * n_stages * n_micro * n_chunks
    # the data flow: F(j, mb) after F(j - 1, mb), B(j, mb) after B(j + 1, mb) and after F(j, mb)
    when = {(kind, virtual_stage(n_stages, s, c), mb): i for i, (s, kind, c, mb) in enumerate(order)}
    last = n_stages * n_chunks - 1
    for (kind, j, mb), i in when.items():
        if kind == "F" and j > 0:
            assert when["F", j - 1, mb] < i
        if kind == "B":
            assert when["F", j, mb] < i
            if j < last:
                assert when["B", j + 1, mb] < i


def test_simulator_detects_a_deadlock_and_a_wrong_message():
    # two stages each waiting for the other: stage 0 wants B(0) before it ever runs F(0)
    bad = [[("recv", 1, 1), ("B", 0, 0), ("F", 0, 0), ("send", 1, 0)],
           [("recv", 0, 0), ("F", 0, 0), ("B", 0, 0), ("send", 0, 1)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad)
    # micro-batch 1's activation sent under the tag micro-batch 0's receive waits for
    calls = [engine_calls(2, s, 2) for s in range(2)]
    swapped = [("send", 1, 2) if c == ("send", 1, 0) else ("send", 1, 0) if c == ("send", 1, 2) else c
               for c in calls[0]]
    with pytest.raises(AssertionError, match="needs"):
        simulate([swapped, calls[1]])


def bubble(n_stages, n_micro, n_chunks, backward_cost=2.0, latency=0.0):
    """Idle time over ideal compute time of the simulated run, with stage passes of fixed logical
    cost: a chunk's forward 1 / v, its backward `backward_cost` / v (a rank's layers cost the same
    whatever v), messages arriving as their pass ends."""
    cost = {"F": 1.0 / n_chunks, "B": backward_cost / n_chunks}
    _, clock, busy = simulate([engine_calls(n_stages, s, n_micro, n_chunks) for s in range(n_stages)],
                              n_chunks, cost=cost.get, latency=latency)
    return (max(clock) - max(busy)) / max(busy)


def test_interleaving_divides_the_bubble_by_the_chunks():
    """pp = 4, m = 8: the measured bubble within 10% of (pp - 1) / (v m); plain 1F1B's (pp - 1) / m."""
    pp, m = 4, 8
    for v in (1, 2, 4):
        for backward_cost in (1.0, 2.0):
            measured, formula = bubble(pp, m, v, backward_cost), (pp - 1) / (v * m)
            assert abs(measured - formula) <= 0.1 * formula, (v, backward_cost, measured, formula)
    assert bubble(4, 8, 2) < 0.6 * bubble(4, 8, 1)


def test_the_bubble_check_can_fail(monkeypatch):
    """Every rank warming up as long as rank 0 (a valid order, which completes) delays the last rank's
    first backward, and the bubble comes out far above (pp - 1) / (v m)."""
    real = pipeline.warmup_units
    monkeypatch.setattr(pipeline, "warmup_units", lambda S, s, M, v: real(S, 0, M, v))
    measured = bubble(4, 8, 2)
    assert measured > 2 * 3 / 16


def test_the_longer_warm_up_hides_message_latency(monkeypatch):
    """Messages taking a twentieth of a forward: the schedule's warm-up ((v - 1) pp + 2 (pp - s - 1))
    leaves a smaller bubble than the shortest one the data flow allows ((v - 1) pp + pp - s - 1)."""
    latency = 0.05
    ours = bubble(4, 8, 2, latency=latency)
    shortest = lambda S, s, M, v: min((v - 1) * S + S - s - 1, v * M)  # noqa: E731
    monkeypatch.setattr(pipeline, "warmup_units", shortest)
    assert bubble(4, 8, 2) == pytest.approx(3 / 16)  # without latency it is as good
    assert ours < 0.9 * bubble(4, 8, 2, latency=latency)
