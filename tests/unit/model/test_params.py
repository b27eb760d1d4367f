"""The sharding rules and the flat-buffer layout (boostmpi/model/params.py)."""

import numpy as np
import pytest

from boostmpi.config import config_from_dict
from boostmpi.errors import ConfigError
from boostmpi.model.params import FlatBuffer, param_specs, sizes_split_evenly, tp_strategy

SMALL = dict(d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2, vocab_size=50, seq_len=8,
             attn_rank=8, mlp_rank=12)


@pytest.mark.parametrize("arch,tp_mode", [("svd", "btp"), ("cola", "vanilla"), ("full", "vanilla")])
def test_grouped_factors_are_one_matrix_in_the_flat_buffer(arch, tp_mode):
    cfg = config_from_dict({"model": dict(SMALL, arch=arch), "parallel": {"tp_mode": tp_mode}})
    P = FlatBuffer(param_specs(cfg), np.float64)
    P.data[...] = np.arange(P.size)
    factor = "W" if arch == "full" else "A"
    for group in (("q", "k", "v"), ("gate", "up")):
        names = [f"layers/1/{lin}/{factor}" for lin in group]
        M = P.columns(names)
        assert np.shares_memory(M, P.data) and M.flags.c_contiguous  # a view, not a concatenated copy
        np.testing.assert_array_equal(M, np.concatenate([P[n] for n in names], axis=1))
        assert P.spans[names[0]] == P.spans[names[-1]]


def _config_or_none(model, tp, tp_mode):
    try:
        return config_from_dict({"model": model, "parallel": {"tp": tp, "tp_mode": tp_mode}}, world_size=tp)
    except ConfigError:
        return None


@pytest.mark.parametrize("arch,tp_mode", [("svd", "btp"), ("cola", "vanilla"), ("full", "vanilla")])
def test_accepted_layouts_split_every_sharded_parameter_evenly(arch, tp_mode):
    """Every accepted layout splits each sharded parameter into equal parts (the vocabulary may be uneven)."""
    tp = 2
    model = dict(SMALL, arch=arch)
    cfg = _config_or_none(model, tp, tp_mode)
    assert cfg is not None
    for t in range(tp):
        for s in param_specs(cfg, t, 0):
            if s.shard_dim is not None and s.name not in ("embed", "lm_head") or (s.name == "embed" and s.shard_dim == 1):
                assert s.global_shape[s.shard_dim] % tp == 0, s.name
    # what the config refuses when it does not divide by tp, read off the rules
    assert sizes_split_evenly(tp_strategy(cfg)) == {
        "btp": ["d_model", "n_heads", "n_kv_heads", "d_ff"],
        "vanilla": ["attn_rank", "mlp_rank"],
        "megatron": ["n_heads", "n_kv_heads", "d_ff"]}[tp_strategy(cfg)]
