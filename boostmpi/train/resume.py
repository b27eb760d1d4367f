"""What a resumed run compares with its checkpoint (docs/OPERATIONS.md, "What a resumed run checks").

A run continues only what it can continue exactly. Every setting that changes the run from the
checkpoint on is compared with the configuration the checkpoint recorded: the global batch (and so its
parts micro_batch_size, grad_accum, dp), train.seed (the data order), data.shuffle, train.steps below the
checkpoint's step. A difference is refused in one line naming it (exit status 2), except a new global
batch asked for explicitly with train.global_batch_size, which is applied and logged at the checkpoint's
step. The data itself is compared by the data position (trainer, TrainLoader.load_state_dict).

Free to change without asking: the layout (tp, pp, dp, zero_stage, tp_mode, virtual_stages) with the
global batch held, micro_batch_size and grad_accum with the global batch held, the attention backend,
recompute, the checkpoint settings, and everything else not named above (a new learning rate from a
checkpoint is a documented use of --resume).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from boostmpi.errors import ConfigError

if TYPE_CHECKING:
    from boostmpi.checkpoint.reading import SavedConfig
    from boostmpi.config import Config


def _refusal(message: str) -> ConfigError:
    err = ConfigError(message)
    err.all_ranks = True  # every rank compares the same two configurations: each raises, rank 0 prints
    return err


def check_resume(cfg: Config, saved: SavedConfig, step: int, path: str) -> list[str]:
    """Compare `cfg` with `saved`, the configuration (a dict) recorded by checkpoint `path` of step `step`.
    Returns the lines to log for the changes applied because they were asked for; raises the refusal."""
    t = cfg.train
    saved_train, saved_data = saved.get("train", {}), saved.get("data", {})
    if t.steps < step:
        raise _refusal(f"cannot resume {path} with train.steps = {t.steps}: the checkpoint is already at step {step}; "
                       f"set train.steps to at least {step}, or resume from an earlier checkpoint with --resume")
    if "seed" in saved_train and saved_train["seed"] != t.seed:
        raise _refusal(f"cannot resume {path} with train.seed = {t.seed}: it was trained with train.seed = "
                       f"{saved_train['seed']}, and another seed changes the order of the data from here on; set "
                       f"train.seed={saved_train['seed']}, or start a new run (a new train.run_dir)")
    if "shuffle" in saved_data and saved_data["shuffle"] != cfg.data.shuffle:
        raise _refusal(f"cannot resume {path} with data.shuffle = {str(cfg.data.shuffle).lower()}: it was trained "
                       f"with data.shuffle = {str(saved_data['shuffle']).lower()}, and the order of the data would "
                       f"change from here on; set data.shuffle={str(saved_data['shuffle']).lower()}, or start a new run")
    return _check_global_batch(cfg, saved, step, path)


def _check_global_batch(cfg: Config, saved: SavedConfig, step: int, path: str) -> list[str]:
    """The global batch (micro_batch_size x grad_accum x dp, or train.global_batch_size) may change only when
    train.global_batch_size is set explicitly: then it is logged at the checkpoint's step."""
    saved_train, saved_dp = saved.get("train", {}), saved.get("parallel", {}).get("dp")
    before, now = saved_train.get("global_batch_size"), cfg.train.global_batch_size
    if before is None or before == now:
        return []
    if cfg._explicit is None or "global_batch_size" in cfg._explicit.get("train", {}):
        return [f"the global batch changes from {before} to {now} sequences at step {step} (train.global_batch_size"
                + (f"; dp {saved_dp} -> {cfg.parallel.dp})" if saved_dp not in (None, cfg.parallel.dp) else ")")]
    parts = [("parallel", "dp", saved_dp, cfg.parallel.dp),
             ("train", "micro_batch_size", saved_train.get("micro_batch_size"), cfg.train.micro_batch_size),
             ("train", "grad_accum", saved_train.get("grad_accum"), cfg.train.grad_accum)]
    changed = " and ".join(f"{section}.{key} = {value} instead of {old}" for section, key, old, value in parts
                           if old is not None and old != value) or f"train.global_batch_size = {now}"
    raise _refusal(f"resuming {path} with {changed} would change the global batch from {before} to {now} sequences "
                   f"(micro_batch_size x grad_accum x dp); {keep_batch_hint(cfg, cast(int, before))}, or set "
                   f"train.global_batch_size={now} to change it")


def keep_batch_hint(cfg: Config, before: int) -> str:
    """How to keep a global batch of `before` sequences on this run's dp: grad_accum follows the global
    batch, but micro_batch_size x dp must divide it."""
    dp, micro = cfg.parallel.dp, cfg.train.micro_batch_size
    keep = f"set train.global_batch_size={before} to keep it (grad_accum follows)"
    if before % (micro * dp) == 0:
        return keep
    fitting = [m for m in range(micro, 0, -1) if before % (m * dp) == 0]
    if not fitting:
        return (f"a global batch of {before} sequences cannot be split over dp = {dp} ranks (it is not a multiple "
                f"of {dp}); resume on a dp that divides it")
    return (f"{keep}, and train.micro_batch_size={fitting[0]}: micro_batch_size x dp = {micro} x {dp} does not "
            f"divide {before}")
