"""Global (unsharded) tensors in tests: the helpers the product does not need.

- `gather_global(engine, buffer)`: the global tensors of a FlatBuffer laid out like the engine's
  parameters, assembled on world rank 0 from every (tp, pp) rank of dp replica 0: how the parity
  tests compare a parallel layout with one process.
- `save_global(run_dir, step, cfg, tensors, moments, adam_t, state, **kwargs)`: a checkpoint of
  `cfg`'s layout written from one process out of global tensors and moments.
"""

import numpy as np

from boostmpi.backend import to_numpy
from boostmpi.model.params import FlatBuffer, param_specs
from boostmpi.parallel.grid import Coords, rank_of
from boostmpi import checkpoint as ckpt

_TAG = 77


def gather_global(engine, buffer):
    """{name: np.ndarray} of global tensors on world rank 0, None elsewhere. Every rank of the grid
    calls it; the ranks of dp replica 0 send their flat buffer to rank 0, which places each shard by
    its spec."""
    grid, cfg = engine.grid, engine.cfg
    c = grid.coords
    local = np.ascontiguousarray(to_numpy(buffer.data))
    if grid.world_rank != 0:
        if c.dp == 0:
            grid.host.send(local, dest=0, tag=_TAG)
        return None
    out = {}
    for s in range(grid.pp_size):
        for t in range(grid.tp_size):
            specs = param_specs(cfg, t, s)
            src = rank_of(Coords(dp=0, pp=s, tp=t), grid.tp_size, grid.pp_size)
            if src == 0:
                flat = local
            else:
                flat = np.empty(sum(sp.local_numel for sp in specs), dtype=local.dtype)
                grid.host.recv(flat, source=src, tag=_TAG)
            remote = FlatBuffer(specs, local.dtype, np, data=flat)
            for sp in specs:
                if sp.name not in out:
                    out[sp.name] = np.empty(sp.global_shape, dtype=local.dtype)
                out[sp.name][sp.local_slice()] = remote[sp.name]
    return out


def save_global(run_dir, step, cfg, tensors, moments, adam_t, state, **kwargs):
    """`checkpoint.save` from one process, for `cfg`'s layout, of global tensors ({name: array}) and
    moments ({name: m}, {name: v}); `kwargs` as for `save`."""
    return ckpt.save(run_dir, step, cfg, ckpt.global_rank_states(cfg, tensors, moments), adam_t, state, **kwargs)
