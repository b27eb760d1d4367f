"""Opening a checkpoint on one process, whatever layout wrote it (shared by the user tools).

A checkpoint holds global (unsharded) tensors and the configuration of the run that wrote it.
The tools read it back with the parallel layout forced to one process (tp = pp = dp = 1) on
the CPU, in float32 unless the run trained in float64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from boostmpi import checkpoint as ckpt
from boostmpi.config import Config, config_from_dict
from boostmpi.errors import CheckpointError, ConfigError
from boostmpi.model.params import all_global_specs
from boostmpi.precision import cpu_dtype_name

if TYPE_CHECKING:
    from boostmpi.checkpoint.reading import SavedConfig
    from boostmpi.parallel.engine import Engine


def checkpoint_dir(path: str) -> str:
    """The verified-complete checkpoint folder named by a run directory, its checkpoints/latest
    file, a step folder or its model.h5."""
    return ckpt.resolve(path)


def single_process_config(saved: object, dtype: str | None = None) -> Config:
    """The Config of a checkpoint's recorded configuration (a dict), laid out for one CPU process.

    `dtype` None keeps float64 when the run used it and otherwise computes in float32 (the CPU
    has no bfloat16). The batch is re-derived (global_batch_size = 0, grad_accum = 1) so that a
    run's data-parallel batch does not contradict dp = 1.
    """
    if not isinstance(saved, dict):
        raise ConfigError(f"the recorded configuration is a {type(saved).__name__}, not a table of sections")
    d = {name: dict(values) if isinstance(values, dict) else values for name, values in saved.items()}
    if dtype is None:
        dtype = cpu_dtype_name(cast(str, d.get("train", {}).get("dtype")))
    d.setdefault("parallel", {}).update(tp=1, pp=1, dp=1, virtual_stages=1)
    d.setdefault("train", {}).update(device="cpu", dtype=dtype, global_batch_size=0, grad_accum=1)
    return config_from_dict(d)


class LoadedCheckpoint(NamedTuple):
    tensors: dict[str, np.ndarray]  # name -> global tensor
    cfg: Config  # the one-process Config
    step: int
    directory: str  # the checkpoint folder
    saved_config: SavedConfig  # the configuration as the run recorded it (its own layout)


def load_checkpoint(path: str, dtype: str | None = None) -> LoadedCheckpoint:
    """A LoadedCheckpoint, read whole or refused in one line: held against pruning for the whole read, its
    files verified against the checksums recorded when they were written (checkpoint.hold)."""
    with ckpt.hold(path) as held:
        where = held.path("model.h5")
        try:
            cfg = single_process_config(held.config, dtype)
        except ConfigError as exc:
            raise CheckpointError(f"{where}: its recorded configuration is not usable ({exc})") from exc
        datasets = held.datasets()
        for spec in all_global_specs(cfg):  # presence and shape from the metadata, before any tensor is read
            if spec.name not in datasets:
                raise CheckpointError(f"{where} has no tensor {spec.name}, which its configuration ({cfg.model.arch}) needs")
            if tuple(datasets[spec.name].shape) != tuple(spec.global_shape):
                raise CheckpointError(f"{where}: tensor {spec.name} has shape {tuple(datasets[spec.name].shape)}, "
                                      f"its configuration says {tuple(spec.global_shape)}")
        stored = held.tensors([spec.name for spec in all_global_specs(cfg)])
        tensors = {name: np.asarray(value, dtype=np.dtype(cfg.train.dtype)) for name, value in stored.items()}
        return LoadedCheckpoint(tensors, cfg, held.step, held.dir, held.config)


def load_checkpoint_engine(path: str, dtype: str | None = None) -> tuple[Engine, Config, int]:
    """(Engine on one CPU process holding the checkpoint's weights, its Config, step)."""
    from boostmpi.parallel.engine import Engine

    loaded = load_checkpoint(path, dtype)
    engine = Engine(loaded.cfg)
    ckpt.read_params(loaded.tensors, engine.specs, engine.params)
    return engine, loaded.cfg, loaded.step
