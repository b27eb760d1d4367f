"""The run configuration: five TOML sections resolved into frozen dataclasses (docs/FORMATS.md, Configuration).

Values come in layers, later wins: the defaults below < the TOML file < `--set section.key=value` overrides. A key
declared with `_derived(...)` has no default of its own: unless set explicitly it is computed from other keys, so a
`Config` always holds concrete values. `train.global_batch_size = 0` likewise means "micro_batch_size * grad_accum *
dp"; a positive value instead determines `grad_accum`. Each key's declaration carries its meaning (`doc`):
docs/FORMATS.md's tables of the keys are `key_tables()`, which `python -m boostmpi.config` prints.

Every check happens in `Config.validate`, so a bad configuration stops a run with one `ConfigError` line that names
the key, before any training work starts. The `Config` remembers which keys were set explicitly: `replace` applies
its changes on top of those and derives the rest again, exactly as if they had been given on the command line.
"""

import difflib
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import TypeVar, cast

import tomllib

from boostmpi.errors import ConfigError
from boostmpi.gpu.attention import BACKENDS as ATTENTION_BACKENDS
from boostmpi.model.params import LINEAR_DIMS, RANK_OF, sizes_split_evenly, tp_strategy
from boostmpi.precision import NAMES as PRECISIONS, device_problem
from boostmpi.toml_io import read_toml, toml_value

ARCHS = ("full", "svd", "cola")
LOWRANK_ARCHS = ("svd", "cola")

Value = bool | int | float | str  # a configuration value: every key holds one of these types
Section = dict[str, Value]  # key -> value of one section
_T = TypeVar("_T", bool, int, float, str)


def _key(default: _T, check: str | None = None, choices: tuple[str, ...] | None = None, name: str | None = None,
         *, doc: str) -> _T:
    """A key with a default; `check` names an entry of _RANGE_CHECKS; `name` is the key's name in the
    configuration when it cannot be the attribute's (a Python keyword: `async` is attribute `async_`); `doc` says
    what the key means: docs/FORMATS.md's tables are `key_tables()`, which `python -m boostmpi.config` prints."""
    return field(default=default, metadata={"check": check, "choices": choices, "key": name, "doc": doc})


def _key_of(f: Field[Value]) -> str:
    """The configuration name of a dataclass field."""
    return str(f.metadata.get("key") or f.name)


def _derived(rule: Callable[[Section], _T], describe: str, check: str | None = None, *, doc: str) -> _T:
    """A key that, unless set, is `rule(values of its section so far)`; `describe` says how. The rule reads checked
    values (its `int(...)` only tells a type checker); the default None is never seen: `_build` sets every key."""
    return cast(_T, field(default=None, metadata={"check": check, "derive": rule, "describe": describe, "doc": doc}))


# check name -> (predicate, what the message says the value must be)
_RANGE_CHECKS = {
    "positive": (lambda v: v > 0, "must be positive"),
    "nonnegative": (lambda v: v >= 0, "must be >= 0"),
    "fraction": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "beta": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "nonempty": (lambda v: v != "", "must not be empty"),
    "path": (lambda v: v != "" and not v.startswith("~"), "must not be empty, and a leading ~ must name an existing user"),
    "zero_stage": (lambda v: v in (0, 1, 2, 3), "must be 0 (optimizer state replicated over dp), 1 (sharded over dp), "
                   "2 (and gradients) or 3 (and parameters)"),
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str = _key("cola", choices=ARCHS, doc="`full`, `svd` or `cola` (see Model)")
    vocab_size: int = _key(256, "positive", doc="V, the vocabulary size")
    d_model: int = _key(256, "positive", doc="C, the width of the residual stream")
    n_layers: int = _key(4, "positive", doc="transformer layers")
    n_heads: int = _key(4, "positive", doc="H; must divide d_model, and d_model / n_heads must be even")
    n_kv_heads: int = _derived(lambda m: int(m["n_heads"]), "= model.n_heads", "positive",
                               doc="Hkv; must divide n_heads")
    d_ff: int = _derived(lambda m: 16 * -(-8 * int(m["d_model"]) // 48),  # ceil written in integers
                         "16 * ceil(8 * model.d_model / 3 / 16)", "positive",
                         doc="F, the MLP's hidden width: LLaMA's 8/3 expansion, rounded up to a multiple of 16")
    # rank <= 0 or too large is checked only for low-rank archs: a full model never uses it
    rank: int = _derived(lambda m: int(m["d_model"]) // 4, "model.d_model // 4", doc="the default of the two below")
    attn_rank: int = _derived(lambda m: int(m["rank"]), "= model.rank", doc="r of q, k, v, o (low-rank archs)")
    mlp_rank: int = _derived(lambda m: int(m["rank"]), "= model.rank", doc="r of gate, up, down (low-rank archs)")
    seq_len: int = _key(256, "positive", doc="T, tokens per sequence")
    rope_theta: float = _key(10000.0, "positive", doc="the base of RoPE's frequencies (see Model)")
    norm_eps: float = _key(1e-6, "positive", doc="added to the mean square in RMSNorm (see Model)")
    mlp_gate_act: bool = _derived(lambda m: m["arch"] != "cola", "true unless model.arch = cola",
                                  doc="SiLU on the gate (cola has one inside every factorised linear already)")
    attention_dropout: float = _key(0.0, "fraction", doc="dropout on the attention probabilities, as GPT runs of "
        "Megatron use it, in [0, 1]; priced by `sim` only (the engine has no dropout), `train` refuses a value "
        "above 0 in one line (docs/SIM.md)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def is_lowrank(self) -> bool:
        return self.arch in LOWRANK_ARCHS

    def linear_shapes(self) -> dict[str, tuple[int, int, int | None]]:
        """name -> (d_in, d_out, rank) for each linear of a layer; rank is None for arch full."""
        size = {"d_model": self.d_model, "n_heads": self.d_model, "n_kv_heads": self.kv_dim, "d_ff": self.d_ff}
        return {name: (size[d_in], size[d_out], getattr(self, RANK_OF[name]) if self.is_lowrank else None)
                for name, (d_in, d_out) in LINEAR_DIMS.items()}


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = _key(1, "positive", doc="tensor-parallel size; tp · pp · dp is the number of MPI ranks")
    pp: int = _key(1, "positive", doc="pipeline-parallel size, at most n_layers")
    dp: int = _key(1, "positive", doc="data-parallel size")
    tp_mode: str = _key("btp", choices=("btp", "vanilla"), doc="`btp` (bottleneck-aware: residual sharded along C, "
        "communication at rank r) or `vanilla` (Megatron-style on each factor); full rank always runs "
        "Megatron-style")
    norm: str = _key("online", choices=("online", "sync"), doc="btp's RMSNorm statistic: `online` rides in the "
        "rank-r all-reduce, `sync` is a separate one")
    grouped: bool = _key(True, doc="the linears reading one input run as one GEMM and one all-reduce")
    overlap: bool = _key(True, doc="non-blocking collectives overlap the backward's local GEMMs")
    comm: str = _key("auto", choices=("auto", "mpi", "nccl"), doc="`mpi`, `nccl`, or `auto` (NCCL on GPUs when "
        "available)")
    watchdog_s: float = _key(600.0, "nonnegative", doc="seconds a blocking call may wait before it ends the job; 0 "
        "turns it off")
    zero_stage: int = _key(0, "zero_stage", doc="0: optimizer state replicated over dp; 1: AdamW state sharded over "
        "dp (docs/MEMORY.md); 2 (and gradients) and 3 (and parameters) are priced by `sim` only, `train` refuses "
        "them in one line (docs/SIM.md)")
    virtual_stages: int = _key(1, "positive", doc="interleaved 1F1B: layer chunks per pipeline rank (1 = plain "
        "1F1B); needs pp > 1 and pp · virtual_stages ≤ n_layers; `train` also needs n_layers divisible by pp · "
        "virtual_stages and grad_accum a multiple of pp, which `sim` does not (docs/DESIGN.md, docs/SIM.md)")
    sequence_parallel: bool = _key(False, doc="Megatron's sequence parallelism in the regions outside tensor "
        "parallelism, for arch full at tp > 1; priced by `sim` only, `train` refuses it in one line (docs/SIM.md)")


@dataclass(frozen=True)
class TrainConfig:
    run_dir: str = _key("runs/default", "path", doc="the run directory (see Runs)")
    steps: int = _key(100, "positive", doc="optimizer steps")
    micro_batch_size: int = _key(8, "positive", doc="sequences per micro-batch per data-parallel rank")
    grad_accum: int = _key(1, "positive", doc="micro-batches per step")
    global_batch_size: int = _key(0, "nonnegative", doc="sequences per step; 0 = micro_batch_size · grad_accum · dp, "
        "a positive value fixes it and determines grad_accum")
    lr: float = _key(1e-3, "positive", doc="the peak learning rate: linear warm-up to it, then cosine decay")
    min_lr_ratio: float = _key(0.1, "fraction", doc="the cosine decay ends at lr · min_lr_ratio")
    warmup_steps: int = _key(10, "nonnegative", doc="steps of the linear warm-up")
    weight_decay: float = _key(0.1, "nonnegative", doc="AdamW's decoupled weight decay; applies to matrices only")
    beta1: float = _key(0.9, "beta", doc="AdamW's decay of the first moment")
    beta2: float = _key(0.95, "beta", doc="AdamW's decay of the second moment")
    adam_eps: float = _key(1e-8, "positive", doc="AdamW's epsilon")
    grad_clip: float = _key(1.0, "nonnegative", doc="global gradient-norm clipping; 0 = off")
    seed: int = _key(1337, "nonnegative", doc="weights and data order")  # numpy seeds must be >= 0
    device: str = _key("cpu", choices=("cpu", "gpu"), doc="`cpu` (NumPy) or `gpu` (CuPy)")
    dtype: str = _key("float32", choices=PRECISIONS, doc="`float64`, `float32`, or `bfloat16` (GPU: bf16 compute, fp32 master weights)")
    recompute: str = _key("none", choices=("none", "layer", "lowrank", "selective"), doc="`none`, `layer`, `lowrank` or `selective` (the attention core; docs/MEMORY.md)")
    attention: str = _key("auto", choices=ATTENTION_BACKENDS, doc="which implementation runs attention on a GPU: "
        "`cudnn` (cuDNN's fused attention, bf16 on NVIDIA sm_80+), `torch` (PyTorch's SDPA), `own` (the kernels of "
        "`kernels/attention.cu`), or `auto` (cudnn where it runs this run's shape, else torch, else own with one "
        "line saying what that costs); chosen once at start-up, the same on every rank (boostmpi/gpu/attention.py, "
        "docs/GPU.md). Accepted and ignored on the CPU; may change on resume")
    deterministic: bool = _key(True, doc="`false` lets cudnn and torch attention run their faster backward, whose "
        "sums may change run to run, so a resume is not bitwise (docs/GPU.md); own is always deterministic")
    cuda_graph: bool = _key(False, doc="`true` captures the training step once in a CUDA graph and replays it every step "
        "(one rank on an NVIDIA GPU, attention `cudnn` or `own`, dtype `float32` or `bfloat16`; docs/GPU.md)")
    log_every: int = _key(1, "positive", doc="steps between progress lines and `memory` records (the first and last "
        "steps always have both; a validation step prints a progress line too)")
    val_every: int = _key(0, "nonnegative", doc="steps between validations; 0 = at the end only")
    val_windows: int = _key(16, "positive", doc="validation windows")


@dataclass(frozen=True)
class DataConfig:
    train: str = _key("builtin", "path", doc="a shard path, a glob, or `builtin` (the built-in corpus)")
    val: str = _key("builtin", "path", doc="the same for validation")
    builtin_dir: str = _key("data/builtin", "path", doc="where the built-in corpus is prepared")
    shuffle: bool = _key(True, doc="a new seeded window order every epoch (false: file order)")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = _key(0, "nonnegative", doc="steps between checkpoints; 0 = at the end only")
    keep: int = _key(0, "nonnegative", doc="0 = keep every complete checkpoint, N = only the newest N")
    async_: bool = _key(False, name="async", doc="written by a background thread from a snapshot while training goes "
        "on, one save at a time (docs/CHECKPOINTS.md)")


SECTIONS: dict[str, type] = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
                              "data": DataConfig, "checkpoint": CheckpointConfig}
_FIELDS: dict[str, dict[str, Field[Value]]] = {name: {_key_of(f): f for f in fields(cls)}
                                               for name, cls in SECTIONS.items()}

# section -> key -> default; None marks a derived key
DEFAULTS: dict[str, dict[str, Value | None]] = {name: {key: cast(Value | None, f.default) for key, f in keys.items()}
                                                for name, keys in _FIELDS.items()}

_TYPE_WORDS: dict[object, str] = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # section -> key -> value as the user set it; None = every value counts as explicit
    _explicit: dict[str, Section] | None = field(default=None, compare=False, repr=False)

    @property
    def tokens_per_step(self) -> int:
        t = self.train
        return t.micro_batch_size * t.grad_accum * self.parallel.dp * self.model.seq_len

    def to_dict(self) -> dict[str, Section]:
        return {name: {key: getattr(getattr(self, name), f.name) for key, f in _FIELDS[name].items()}
                for name in SECTIONS}

    def to_toml(self) -> str:
        lines = ["# boostmpi configuration, every key resolved"]
        for name, values in self.to_dict().items():
            lines += ["", f"[{name}]"] + [f"{key} = {toml_value(v)}" for key, v in values.items()]
        return "\n".join(lines) + "\n"

    def replace(self, **changes: Value) -> "Config":
        """A new validated Config with `{"section.key": value}` changes; derived keys follow."""
        explicit = self._explicit if self._explicit is not None else self.to_dict()
        explicit = {name: dict(values) for name, values in explicit.items()}
        for dotted, value in changes.items():
            section, key = _split_dotted(dotted)
            explicit.setdefault(section, {})[key] = _checked_type(section, key, value)
        return _build(explicit, world_size=None)

    def validate(self, world_size: int | None = None) -> "Config":
        """Raise ConfigError for the first problem found; `world_size` = MPI ranks started (a run: then
        also what only `boostmpi sim` understands is refused, `check_runnable`)."""
        for name in SECTIONS:
            for f in _FIELDS[name].values():
                self._check_key(name, f)
        self._check_model()
        self._check_parallel(world_size)
        self._check_train()
        if world_size is not None:  # a run (train), not a prediction: only what the engine runs
            self.check_runnable()
        return self

    # -- messages -------------------------------------------------------------------------

    def _origin(self, section: str, key: str) -> str:
        """' (derived: ...)' when the value was not set but derived, else ''."""
        describe = _FIELDS[section][key].metadata.get("describe")
        explicit = self._explicit is None or key in self._explicit.get(section, {})
        return "" if explicit or describe is None else f" (derived: {describe})"

    def _show(self, section: str, key: str) -> str:
        value = getattr(getattr(self, section), _FIELDS[section][key].name)
        return f"{section}.{key} = {toml_value(value)}{self._origin(section, key)}"

    # -- checks ---------------------------------------------------------------------------

    def _check_key(self, section: str, f: Field[Value]) -> None:
        key, value = _key_of(f), getattr(getattr(self, section), f.name)
        _checked_type(section, key, value)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise _error(f"{section}.{key} must be one of {', '.join(choices)}, got {value!r}")
        check = f.metadata.get("check")
        if check:
            holds, requirement = _RANGE_CHECKS[check]
            if not holds(value):
                raise _error(f"{section}.{key} {requirement}, got {toml_value(value)}"
                             f"{self._origin(section, key)}")

    def _check_model(self) -> None:
        m = self.model
        if m.d_model % m.n_heads:
            raise _error(f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}")
        if m.n_heads % m.n_kv_heads:
            raise _error(f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = "
                         f"{m.n_kv_heads}: each kv head serves a whole group of q heads")
        if m.head_dim % 2:
            raise _error(f"model.d_model / model.n_heads = {m.head_dim} (the head dim) must be even: "
                         "RoPE rotates pairs of dims")
        if not m.is_lowrank:
            return
        for name, (d_in, d_out, rank) in m.linear_shapes().items():
            key = RANK_OF[name]
            assert rank is not None  # a low-rank arch gives every linear a rank
            if rank <= 0:
                raise _error(f"model.{key} must be positive, got {rank}{self._origin('model', key)}")
            if rank > min(d_in, d_out):
                raise _error(f"{self._show('model', key)} is larger than min(d_in, d_out) = "
                             f"{min(d_in, d_out)} of the {name} projection ({d_in} -> {d_out}); "
                             "a low-rank factor cannot have a higher rank")

    def _check_parallel(self, world_size: int | None) -> None:
        m, p = self.model, self.parallel
        ranks = p.tp * p.pp * p.dp
        if world_size is not None and ranks != world_size:
            started = f"{world_size} MPI rank was" if world_size == 1 else f"{world_size} MPI ranks were"
            raise _error(f"parallel.tp * parallel.pp * parallel.dp = {ranks} but {started} started")
        if p.pp > m.n_layers:
            raise _error(f"parallel.pp = {p.pp} is larger than model.n_layers = {m.n_layers}: "
                         "every pipeline stage needs at least one layer")
        if p.virtual_stages > 1:
            self._check_interleaving()
        if p.sequence_parallel and p.tp > 1 and tp_strategy(self) != "megatron":
            raise _error(f"parallel.sequence_parallel = true needs model.arch = \"full\" when parallel.tp > 1 "
                         f"(Megatron tensor parallelism; arch = \"{m.arch}\" with tp_mode = \"{p.tp_mode}\" "
                         "has no sequence-parallel regions)")
        if p.tp > m.vocab_size:
            raise _error(f"parallel.tp = {p.tp} is larger than model.vocab_size = {m.vocab_size}: "
                         "every tensor-parallel rank needs part of the vocabulary")
        if p.tp == 1:
            return
        if p.tp_mode == "btp" and not m.is_lowrank:
            raise _error(f"parallel.tp_mode = btp needs a low-rank arch; use tp_mode = \"vanilla\" "
                         f"for full (model.arch = \"full\", parallel.tp = {p.tp})")
        for key in sizes_split_evenly(tp_strategy(self)):  # the sharding rules of boostmpi/model/params.py
            if getattr(m, key) % p.tp:
                raise _error(f"{self._show('model', key)} is not divisible by parallel.tp = {p.tp}, "
                             f"which tp_mode = \"{p.tp_mode}\" with arch = \"{m.arch}\" needs")

    def _check_interleaving(self) -> None:
        p = self.parallel
        if p.pp == 1:
            raise _error(f"parallel.virtual_stages = {p.virtual_stages} needs parallel.pp > 1: interleaving cuts a "
                         "pipeline into more stages than it has ranks")
        if p.pp * p.virtual_stages > self.model.n_layers:
            raise _error(f"parallel.pp * parallel.virtual_stages = {p.pp * p.virtual_stages} is larger than "
                         f"model.n_layers = {self.model.n_layers}: every virtual stage needs at least one layer")

    def sim_only(self) -> str | None:
        """What `boostmpi sim` prices but the engine does not run, as one line naming it, or None:
        attention dropout, ZeRO stages 2 and 3, sequence parallelism, and interleaving with chunks of unequal size or
        micro-batches in part-groups (as some published runs are laid out)."""
        m, p, t = self.model, self.parallel, self.train
        if m.attention_dropout:
            return (f"model.attention_dropout = {m.attention_dropout} is priced by boostmpi sim only: train has no "
                    "dropout")
        if p.zero_stage > 1:
            return (f"parallel.zero_stage = {p.zero_stage} is priced by boostmpi sim only: train shards the "
                    "optimizer state (zero_stage = 1), not gradients or parameters")
        if p.sequence_parallel:
            return ("parallel.sequence_parallel = true is priced by boostmpi sim only: train keeps the regions "
                    "outside tensor parallelism whole on every tp rank")
        v = p.virtual_stages
        if v == 1:
            return None
        if m.n_layers % (p.pp * v):
            return (f"model.n_layers = {m.n_layers} is not divisible by parallel.pp * parallel.virtual_stages = "
                    f"{p.pp * v}: train needs every virtual stage to have the same number of layers "
                    "(boostmpi sim prices unequal ones)")
        if t.grad_accum % p.pp:
            return (f"{self._show('train', 'grad_accum')} is not a multiple of parallel.pp = {p.pp}, which train's "
                    f"interleaved 1F1B (parallel.virtual_stages = {v}) needs (boostmpi sim prices it)")
        return None

    def check_runnable(self) -> "Config":
        """Raise ConfigError when the engine cannot run this configuration though `sim` prices it."""
        problem = self.sim_only()
        if problem:
            raise _error(problem)
        return self

    def _check_train(self) -> None:
        m, t, dp = self.model, self.train, self.parallel.dp
        per_accum = t.micro_batch_size * dp
        if t.global_batch_size % per_accum:
            raise _error(f"train.global_batch_size = {t.global_batch_size} is not divisible by "
                         f"train.micro_batch_size * parallel.dp = {per_accum}: "
                         "micro-batches do not divide the batch")
        if t.global_batch_size != per_accum * t.grad_accum:
            raise _error(f"train.grad_accum = {t.grad_accum} contradicts train.global_batch_size = "
                         f"{t.global_batch_size}, which needs grad_accum = "
                         f"{t.global_batch_size // per_accum} (micro_batch_size = "
                         f"{t.micro_batch_size}, dp = {dp}); set only one of them")
        if device_problem(t.dtype, t.device):
            raise _error(device_problem(t.dtype, t.device))
        if t.recompute == "lowrank" and not m.is_lowrank:
            raise _error("train.recompute = lowrank needs a low-rank arch (svd|cola): "
                         "full-rank layers have no bottleneck (model.arch = \"full\")")
        if t.recompute == "lowrank" and self.parallel.tp_mode == "vanilla" and self.parallel.tp > 1:
            raise _error("train.recompute = lowrank needs parallel.tp_mode = \"btp\" when parallel.tp > 1: "
                         "vanilla TP all-reduces full-width outputs, so its recompute cannot be communication-free")


# -- building a Config --------------------------------------------------------------------


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] | str = (),
                world_size: int | None = None) -> Config:
    """Read a TOML file, apply `section.key=value` overrides, resolve and validate."""
    return config_from_dict(read_toml(path), overrides, world_size)


def config_from_dict(d: Mapping[str, object] | None, overrides: Iterable[str] | str = (),
                     world_size: int | None = None) -> Config:
    """A validated Config from `{"model": {...}, ...}` (any subset of sections and keys)."""
    explicit = _checked_sections(d if d is not None else {})
    for dotted, value in parse_overrides(overrides).items():
        section, key = dotted.split(".")
        explicit.setdefault(section, {})[key] = value
    return _build(explicit, world_size)


def parse_overrides(overrides: Iterable[str] | str) -> dict[str, Value]:
    """`["train.steps=10", "model.arch=svd"]` -> `{"train.steps": 10, "model.arch": "svd"}`.

    A value is read as a TOML value, or else taken as a bare string (`train.run_dir=runs/x`).
    Keys and types are checked; a key given twice keeps its last value.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    parsed = {}
    for item in overrides:
        dotted, has_value, text = item.partition("=")
        if not has_value:
            raise _error(f"override {item!r} must look like section.key=value")
        dotted = dotted.strip()
        section, key = _split_dotted(dotted)
        parsed[f"{section}.{key}"] = _checked_type(section, key, _parse_value(text.strip()))
    return parsed


def _parse_value(text: str) -> object:
    try:
        document = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    # text with a newline could smuggle in more keys: then it is no single TOML value
    return document["v"] if set(document) == {"v"} else text


def _build(explicit: dict[str, Section], world_size: int | None) -> Config:
    values: dict[str, Section] = {}
    for name, keys in _FIELDS.items():
        given = explicit.get(name, {})
        section = values.setdefault(name, {})
        for key, f in keys.items():  # declaration order: a derived key follows what it uses
            if key in given:
                section[key] = given[key]
            elif "derive" in f.metadata:
                section[key] = f.metadata["derive"](section)
            else:
                section[key] = cast(Value, f.default)
            value = section[key]
            if f.metadata["check"] == "path" and isinstance(value, str):  # ~ and ~user, as a shell would
                section[key] = os.path.expanduser(value)
    _resolve_batch(values["train"], cast(int, values["parallel"]["dp"]), explicit.get("train", {}))
    cfg = Config(**{name: cls(**{_FIELDS[name][k].name: v for k, v in values[name].items()})
                    for name, cls in SECTIONS.items()}, _explicit=explicit)
    return cfg.validate(world_size)


def _resolve_batch(train: Section, dp: int, given: Section) -> None:
    """Fill in whichever of global_batch_size and grad_accum was left to be derived (inconsistent or indivisible
    values are left as they are for `validate` to report)."""
    micro, accum, batch = (cast(int, train[k]) for k in ("micro_batch_size", "grad_accum", "global_batch_size"))
    per_accum = micro * dp
    if batch == 0:
        train["global_batch_size"] = per_accum * accum
    elif batch > 0 and "grad_accum" not in given and per_accum > 0 and batch % per_accum == 0:
        train["grad_accum"] = batch // per_accum


def _checked_sections(document: object) -> dict[str, Section]:
    """Copy of `document` as section -> key -> value, with every name and type checked."""
    if not isinstance(document, dict):
        raise _error(f"a configuration must be a table of sections, got {type(document).__name__}")
    explicit = {}
    for name, table in document.items():
        if not isinstance(table, dict):
            if name in SECTIONS:
                raise _error(f"[{name}] must be a table of keys, got {table!r} ({type(table).__name__})")
            homes = [s for s, keys in _FIELDS.items() if name in keys]
            if homes:
                raise _error(f"key {name} is outside any section (did you mean {homes[0]}.{name}?)")
        _check_section(name)
        explicit[name] = {key: _checked_type(name, key, value) for key, value in table.items()}
    return explicit


def _split_dotted(dotted: str) -> tuple[str, str]:
    section, _, key = dotted.partition(".")
    if not key:
        homes = [s for s, keys in _FIELDS.items() if dotted in keys]
        hint = f" (did you mean {homes[0]}.{dotted}?)" if homes else ""
        raise _error(f"key {dotted!r} must be written section.key{hint}")
    _check_section(section)
    return section, key


def _check_section(name: object) -> None:
    if name not in SECTIONS:
        close = difflib.get_close_matches(str(name), list(SECTIONS), n=1)
        hint = f" (did you mean [{close[0]}]?)" if close else f" (known: {', '.join(SECTIONS)})"
        raise _error(f"unknown section [{name}]{hint}")


def _checked_type(section: str, key: str, value: object) -> Value:
    """`value` as the type of `section.key` (an int becomes a float for a float key)."""
    f = _FIELDS[section].get(key)
    if f is None:
        raise _error(f"unknown key {section}.{key}{_suggest_key(section, key)}")
    if f.type is bool:
        ok = isinstance(value, bool)
    elif f.type is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        top = 2**64 if key == "seed" else 2**63  # a seed may use all 64 bits; every other count fits int64
        if ok and not -2**63 <= cast(int, value) < top:
            raise _error(f"{section}.{key} = {value} does not fit in 64 bits (at most {top - 1})")
    elif f.type is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok and not math.isfinite(cast(float, value)):
            raise _error(f"{section}.{key} must be a finite number, got {value!r}")
    else:
        ok = isinstance(value, str)
    if not ok:
        raise _error(f"{section}.{key} must be {_TYPE_WORDS[f.type]}, got {value!r} ({type(value).__name__})")
    return cast(Callable[[object], Value], f.type)(value)  # f.type: bool, int, float or str


def _suggest_key(section: str, key: str) -> str:
    known = list(_FIELDS[section])
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        return f" (did you mean {section}.{close[0]}?)"
    homes = [s for s, keys in _FIELDS.items() if key in keys]
    if homes:
        return f" (did you mean {homes[0]}.{key}?)"
    return f" (known keys of [{section}]: {', '.join(known)})"


def _error(message: object) -> ConfigError:
    # a value quoted into a message must not break the one-line promise
    return ConfigError(" ".join(str(message).splitlines()))


def key_tables() -> str:
    """docs/FORMATS.md's tables of the keys, one per section: each key's default (or how it is derived) and meaning."""
    lines = []
    for name, keys in _FIELDS.items():
        lines += ["", f"`[{name}]`", "", "| key | default | meaning |", "|---|---|---|"]
        for key, f in keys.items():
            describe, value = f.metadata.get("describe"), toml_value(f.default)
            default = f"derived: {describe.removeprefix('= ')}" if describe else (
                f"`{value}`" if isinstance(f.default, str) else value)
            lines.append(f"| `{key}` | {default} | {f.metadata['doc']} |")
    return "\n".join(lines[1:]) + "\n"


__all__ = ["ARCHS", "LOWRANK_ARCHS", "SECTIONS", "DEFAULTS", "Config", "ModelConfig",
           "ParallelConfig", "TrainConfig", "DataConfig", "CheckpointConfig", "load_config",
           "config_from_dict", "parse_overrides", "key_tables"]


if __name__ == "__main__":
    print(key_tables(), end="")
