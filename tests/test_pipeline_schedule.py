"""The 1F1B schedule (boostmpi/parallel/pipeline.py) without a model: call sequences recorded with
fakes, their invariants, and a simulated multi-stage run with blocking receives that must finish.
"""

import pytest

from boostmpi.parallel.pipeline import one_f_one_b, run_schedule

SHAPES = [(stages, micro) for stages in (1, 2, 3, 4, 5) for micro in (1, 2, 3, 4, 7, 8)]


def recorded_calls(n_stages, stage, n_micro):
    """What the schedule makes a stage call, recorded by fake forward/backward functions."""
    calls = []
    run_schedule(one_f_one_b(n_stages, stage, n_micro),
                 forward=lambda mb: calls.append(("F", mb)), backward=lambda mb: calls.append(("B", mb)))
    return calls


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
    order = simulate([one_f_one_b(n_stages, s, n_micro) for s in range(n_stages)])
    assert len(order) == 2 * n_stages * n_micro


def test_simulator_detects_a_deadlock():
    # two stages each waiting for the other: stage 0 wants B(0) before it ever runs F(0)
    bad = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad)
