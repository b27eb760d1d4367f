"""AdamW's bookkeeping: decoupled weight decay reaches exactly the parameters marked for it (over the
flat buffer or any slice of it), and a low-precision buffer is refused without master weights."""

import numpy as np
import pytest

from boostmpi.config import load_config
from boostmpi.model.params import FlatBuffer
from boostmpi.parallel.engine import Engine
from boostmpi.train.optim import AdamW
from tests.support.train_helpers import TINY_CONFIG


@pytest.mark.parametrize("part", [None, (0.3, 0.8)])
def test_weight_decay_reaches_exactly_the_parameters_marked_for_it(part):
    cfg = load_config(TINY_CONFIG, overrides=["train.dtype=float64", "train.weight_decay=0.1", "train.grad_clip=0"])
    engine = Engine(cfg)
    n = engine.params.size
    lo, hi = (0, n) if part is None else (int(part[0] * n), int(part[1] * n))
    before = engine.params.data.copy()
    optimizer = AdamW(engine.params, engine.specs, cfg.train, shard=(lo, hi))
    lr = 0.5
    optimizer.step(np.zeros(hi - lo), lr)  # no gradient: only the decay moves a weight
    expected = before.copy()
    for s in engine.specs:
        a, b = engine.params.spans[s.name]
        a, b = max(a, lo), min(b, hi)
        if s.decay and a < b:
            expected[a:b] = before[a:b] - before[a:b] * (lr * cfg.train.weight_decay)
    np.testing.assert_array_equal(engine.params.data, expected)
    decayed = sum(b - a for a, b in optimizer.decay_ranges)
    assert 0 < decayed < hi - lo  # norms and the like are left alone


def test_a_low_precision_buffer_needs_its_master_weights():
    import ml_dtypes

    cfg = load_config(TINY_CONFIG)
    engine = Engine(cfg)
    compute = FlatBuffer(engine.specs, ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="master weights"):
        AdamW(compute, engine.specs, cfg.train)
    master = np.zeros(compute.size, dtype=np.float32)
    assert AdamW(compute, engine.specs, cfg.train, master=master).m.dtype == np.float32
