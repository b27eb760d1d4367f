"""The 1F1B pipeline as the engine runs it: `Engine.forward_backward`'s own loop, with its stage
passes and pipeline messages replaced by fakes that record the call sequence; its invariants, and
a simulated multi-stage run of those sequences with blocking receives that must finish.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from boostmpi.parallel.comm import HostCollectives
from boostmpi.parallel.engine import Engine
from boostmpi.parallel.pipeline import one_f_one_b

SHAPES = [(stages, micro) for stages in (1, 2, 3, 4, 5) for micro in (1, 2, 3, 4, 7, 8)]
B, T, WIDTH = 2, 3, 4


class _Request:
    def wait(self):
        return None


class _PipelineGroup:
    """Records the engine's point-to-point calls; a receive fills its buffer with the micro-batch."""

    def __init__(self, calls):
        self.calls = calls

    def isend(self, buf, dest, tag=0):
        self.calls.append(("send", dest, tag))
        return _Request()

    def irecv(self, buf, source, tag=0):
        self.calls.append(("recv", source, tag))
        buf[...] = tag // 2
        return _Request()


class RecordingEngine(Engine):
    """The engine's forward_backward loop around fake stage passes: F(mb) and B(mb) are recorded
    in the order the loop runs them, between the pipeline messages it sends and receives."""

    def __init__(self, n_stages, stage):
        self.calls = []
        self.xp, self.cdtype = np, np.float32
        self.stage, self.n_stages = stage, n_stages
        self.first, self.last = stage == 0, stage == n_stages - 1
        group_of_one = SimpleNamespace(size=1, overlap=True)
        self.grid = SimpleNamespace(pp=_PipelineGroup(self.calls), dp=group_of_one, dp_size=1,
                                    coords=SimpleNamespace(tp=0), host=HostCollectives(None))
        self.tpx = SimpleNamespace(res_cols=(0, WIDTH))
        self.grads = SimpleNamespace(data=np.zeros(1))
        self._buckets = {}
        self.sharded = False  # no ZeRO-1 slices

    def _refresh_compute_params(self):
        pass

    def _account_saved(self, saved):
        pass

    def _grad_sq(self):
        return 0.0

    def _stage_forward(self, x, y, h, keep=True):
        mb = int(x[0, 0])
        assert h is None if self.first else (h == mb).all()  # what stage - 1 sent for this micro-batch
        self.calls.append(("F", mb))
        out = 0.0 if self.last else np.full((B * T, WIDTH), mb, dtype=self.cdtype)
        return out, {"mb": mb}

    def _stage_backward(self, dh, saved, shape, scale, on_bucket_done):
        mb = saved["mb"]
        assert dh is None if self.last else (dh == mb).all()
        self.calls.append(("B", mb))
        return np.full((B * T, WIDTH), mb, dtype=self.cdtype)


def engine_calls(n_stages, stage, n_micro):
    """Everything Engine.forward_backward of `stage` did, in order: ("F"|"B", mb), ("send"|"recv", peer, tag)."""
    engine = RecordingEngine(n_stages, stage)
    micro = [(np.full((B, T), mb), np.full((B, T), mb)) for mb in range(n_micro)]
    engine.forward_backward(micro)
    return engine.calls


def recorded_calls(n_stages, stage, n_micro):
    """The stage passes the engine ran, in order."""
    return [c for c in engine_calls(n_stages, stage, n_micro) if c[0] in ("F", "B")]


@pytest.mark.parametrize("n_stages,n_micro", SHAPES)
def test_messages_frame_each_pass(n_stages, n_micro):
    """A forward receives its input from the previous stage first and sends its output on; a
    backward receives its gradient from the next stage first and sends its own back."""
    for stage in range(n_stages):
        calls = engine_calls(n_stages, stage, n_micro)
        first, last = stage == 0, stage == n_stages - 1
        expected = []
        for kind, mb in one_f_one_b(n_stages, stage, n_micro):
            if kind == "F":
                expected += ([] if first else [("recv", stage - 1, 2 * mb)]) + [("F", mb)]
                expected += [] if last else [("send", stage + 1, 2 * mb)]
            else:
                expected += ([] if last else [("recv", stage + 1, 2 * mb + 1)]) + [("B", mb)]
                expected += [] if first else [("send", stage - 1, 2 * mb + 1)]
        assert calls == expected


@pytest.mark.parametrize("n_stages,n_micro", SHAPES)
def test_each_stage_runs_every_micro_batch_once_each_way(n_stages, n_micro):
    for stage in range(n_stages):
        calls = recorded_calls(n_stages, stage, n_micro)
        assert calls == one_f_one_b(n_stages, stage, n_micro)
        forwards = [mb for kind, mb in calls if kind == "F"]
        backwards = [mb for kind, mb in calls if kind == "B"]
        # in order, once each (the pipeline's messages are matched by micro-batch order)
        assert forwards == list(range(n_micro))
        assert backwards == list(range(n_micro))
        for mb in range(n_micro):
            assert calls.index(("F", mb)) < calls.index(("B", mb))


@pytest.mark.parametrize("n_stages,n_micro", SHAPES)
def test_warm_up_and_activations_in_flight(n_stages, n_micro):
    for stage in range(n_stages):
        calls = recorded_calls(n_stages, stage, n_micro)
        warmup = min(n_stages - stage - 1, n_micro)
        assert all(kind == "F" for kind, _ in calls[:warmup])
        # after the warm-up the steady state alternates one forward, one backward
        if n_micro > warmup:
            steady = calls[warmup:warmup + 2 * (n_micro - warmup)]
            assert [kind for kind, _ in steady] == ["F", "B"] * (n_micro - warmup)
        in_flight, peak = 0, 0
        for kind, _ in calls:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(n_stages - stage, n_micro), (stage, calls)


def test_last_stage_alternates_and_first_stage_warms_up():
    assert one_f_one_b(1, 0, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b(3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert one_f_one_b(3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


# ---------------------------------------------------------------------------- simulated execution

def simulate(schedules):
    """Run every stage's schedule with the engine's message rules; return the global order of steps.

    Sends never block (they are non-blocking and waited at the end of the step); a receive blocks:
    stage s's F(mb) waits for stage s-1's F(mb), its B(mb) for stage s+1's B(mb) (the last stage
    needs only its own F(mb)). Raises RuntimeError on a deadlock: no stage can take its next step.
    """
    n_stages = len(schedules)
    done = set()  # (stage, kind, mb)
    position = [0] * n_stages
    order = []

    def ready(stage, kind, mb):
        if kind == "F":
            return stage == 0 or (stage - 1, "F", mb) in done
        if stage == n_stages - 1:
            return (stage, "F", mb) in done
        return (stage + 1, "B", mb) in done

    while any(position[s] < len(schedules[s]) for s in range(n_stages)):
        progressed = False
        for stage in range(n_stages):
            if position[stage] < len(schedules[stage]):
                kind, mb = schedules[stage][position[stage]]
                if ready(stage, kind, mb):
                    done.add((stage, kind, mb))
                    order.append((stage, kind, mb))
                    position[stage] += 1
                    progressed = True
        if not progressed:
            stuck = {s: schedules[s][position[s]] for s in range(n_stages) if position[s] < len(schedules[s])}
            raise RuntimeError(f"deadlock: stages wait at {stuck}")
    return order


@pytest.mark.parametrize("n_stages,n_micro", SHAPES)
def test_simulated_pipeline_completes_without_deadlock(n_stages, n_micro):
    order = simulate([recorded_calls(n_stages, s, n_micro) for s in range(n_stages)])
    assert len(order) == 2 * n_stages * n_micro


def test_simulator_detects_a_deadlock():
    # two stages each waiting for the other: stage 0 wants B(0) before it ever runs F(0)
    bad = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad)
