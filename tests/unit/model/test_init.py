"""Initialisation that scales: each rank draws exactly the elements of its shards from a counter-based
stream keyed by (seed, parameter name) and element offset, so every layout sees the same global tensors
and no rank draws a whole tensor."""

import numpy as np
import pytest

from boostmpi.config import config_from_dict
from boostmpi.model import params as P

MODEL = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, attn_rank=8, mlp_rank=12)


@pytest.mark.parametrize("arch,tp_mode,tp,pp", [("cola", "btp", 2, 1), ("cola", "btp", 4, 2), ("svd", "vanilla", 2, 2),
                                                 ("full", "vanilla", 4, 1)])
def test_shards_of_every_layout_assemble_the_global_tensors(arch, tp_mode, tp, pp, monkeypatch):
    kv = 4 if tp == 4 else 2
    cfg = config_from_dict({"model": dict(MODEL, arch=arch, n_kv_heads=kv), "parallel": {"tp": tp, "pp": pp, "tp_mode": tp_mode}})
    drawn = []
    real = P._normals
    monkeypatch.setattr(P, "_normals", lambda key, start, count: drawn.append(count) or real(key, start, count))
    assembled = {}
    for stage in range(pp):
        for t in range(tp):
            for s in P.param_specs(cfg, t, stage):
                drawn.clear()
                piece = P.init_local(s, seed=5)
                assert piece.shape == s.local_shape
                assert sum(drawn) == (s.local_numel if s.init == "normal" else 0), s.name  # its elements only
                full = assembled.setdefault(s.name, np.full(s.global_shape, np.nan))
                full[s.local_slice()] = piece
    monkeypatch.setattr(P, "_normals", real)
    for s in P.all_global_specs(cfg):
        np.testing.assert_array_equal(assembled[s.name], P.init_global(s, seed=5), err_msg=s.name)


def test_any_run_of_elements_equals_the_same_run_of_the_whole_stream():
    key = P._stream_key(9, "layers/0/q/A")
    whole = P._normals(key, 0, 101)
    for start, count in ((0, 1), (1, 1), (3, 10), (50, 51), (100, 1)):
        np.testing.assert_array_equal(P._normals(key, start, count), whole[start:start + count])
    assert abs(whole.mean()) < 0.3 and 0.8 < whole.std() < 1.2


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_data_parallel_replicas_share_the_drawing_and_hold_the_single_rank_weights(zero_stage, monkeypatch):
    """With dp ranks (tp = 1) every rank draws about 1/dp of the model's elements, and after the
    exchange holds all of them, equal to the one-rank initialisation bit for bit."""
    from boostmpi.parallel.engine import Engine
    from tests.support.mpi_helpers import abort_on_error, assert_all_ranks, world

    comm = world()
    n = comm.Get_size()
    cfg = config_from_dict({"model": dict(MODEL, arch="cola"), "parallel": {"dp": n, "zero_stage": zero_stage},
                            "train": {"dtype": "float64", "seed": 11}}, world_size=n)
    drawn = []
    real = P._normals
    monkeypatch.setattr(P, "_normals", lambda key, start, count: drawn.append(count) or real(key, start, count))
    with abort_on_error():
        engine = Engine(cfg, comm)
    monkeypatch.setattr(P, "_normals", real)
    normal = sum(s.local_numel for s in engine.specs if s.init == "normal")
    problems = [f"{s.name} differs from the one-rank initialisation" for s in engine.specs
                if not np.array_equal(engine.params[s.name], P.init_global(s, seed=11))]
    share = sum(drawn) / normal
    if not 0.5 / n <= share <= 1.5 / n:
        problems.append(f"this rank drew {share:.2f} of the normal elements, not about 1/{n}")
    engine.grid.dp.comm.Free()
    assert_all_ranks(not problems, lambda: "; ".join(problems))
