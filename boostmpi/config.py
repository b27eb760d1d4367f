"""The run configuration: five TOML sections resolved into frozen dataclasses (docs/FORMATS.md, Configuration).

Values come in layers, later wins: the defaults below < the TOML file < `--set section.key=value`
overrides. A key declared with `_derived(...)` has no default of its own: unless set
explicitly it is computed from other keys, so a `Config` always holds concrete values.
`train.global_batch_size = 0` likewise means "micro_batch_size * grad_accum * dp"; a positive
value instead determines `grad_accum`.

Every check happens in `Config.validate`, so a bad configuration stops a run with one
`ConfigError` line that names the key, before any training work starts. The `Config` remembers
which keys were set explicitly: `replace` applies its changes on top of those and derives the
rest again, exactly as if they had been given on the command line.
"""

import difflib
import math
import numbers
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import tomllib

from boostmpi.errors import ConfigError
from boostmpi.gpu.attention import BACKENDS as ATTENTION_BACKENDS
from boostmpi.model.params import LINEAR_DIMS, RANK_OF, sizes_split_evenly, tp_strategy
from boostmpi.precision import NAMES as PRECISIONS, device_problem

ARCHS = ("full", "svd", "cola")
LOWRANK_ARCHS = ("svd", "cola")

def _key(default, check=None, choices=None, name=None):
    """A key with a default; `check` names an entry of _RANGE_CHECKS; `name` is the key's name in the
    configuration when it cannot be the attribute's (a Python keyword: `async` is attribute `async_`)."""
    return field(default=default, metadata={"check": check, "choices": choices, "key": name})


def _key_of(f):
    """The configuration name of a dataclass field."""
    return f.metadata.get("key") or f.name


def _derived(rule, describe, check=None):
    """A key that, unless set, is `rule(values of its section so far)`; `describe` says how."""
    return field(default=None, metadata={"check": check, "derive": rule, "describe": describe})


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
    arch: str = _key("cola", choices=ARCHS)
    vocab_size: int = _key(256, "positive")
    d_model: int = _key(256, "positive")
    n_layers: int = _key(4, "positive")
    n_heads: int = _key(4, "positive")
    n_kv_heads: int = _derived(lambda m: m["n_heads"], "= model.n_heads", "positive")
    # the LLaMA 8/3 expansion rounded up to a multiple of 16 (ceil written in integers)
    d_ff: int = _derived(lambda m: 16 * -(-8 * m["d_model"] // 48),
                         "16 * ceil(8 * model.d_model / 3 / 16)", "positive")
    # rank <= 0 or too large is checked only for low-rank archs: a full model never uses it
    rank: int = _derived(lambda m: m["d_model"] // 4, "model.d_model // 4")
    attn_rank: int = _derived(lambda m: m["rank"], "= model.rank")
    mlp_rank: int = _derived(lambda m: m["rank"], "= model.rank")
    seq_len: int = _key(256, "positive")
    rope_theta: float = _key(10000.0, "positive")
    norm_eps: float = _key(1e-6, "positive")
    # cola already has a nonlinearity inside every factorised linear
    mlp_gate_act: bool = _derived(lambda m: m["arch"] != "cola", "true unless model.arch = cola")
    # dropout on the attention probabilities, as GPT runs of Megatron use it (sim only: the engine has none)
    attention_dropout: float = _key(0.0, "fraction")

    @property
    def head_dim(self):
        return self.d_model // self.n_heads

    @property
    def kv_dim(self):
        return self.n_kv_heads * self.head_dim

    @property
    def is_lowrank(self):
        return self.arch in LOWRANK_ARCHS

    def linear_shapes(self):
        """name -> (d_in, d_out, rank) for each linear of a layer; rank is None for arch full."""
        size = {"d_model": self.d_model, "n_heads": self.d_model, "n_kv_heads": self.kv_dim, "d_ff": self.d_ff}
        return {name: (size[d_in], size[d_out], getattr(self, RANK_OF[name]) if self.is_lowrank else None)
                for name, (d_in, d_out) in LINEAR_DIMS.items()}


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = _key(1, "positive")
    pp: int = _key(1, "positive")
    dp: int = _key(1, "positive")
    tp_mode: str = _key("btp", choices=("btp", "vanilla"))
    norm: str = _key("online", choices=("online", "sync"))
    grouped: bool = _key(True)  # grouped low-rank GEMMs
    overlap: bool = _key(True)
    comm: str = _key("auto", choices=("auto", "mpi", "nccl"))
    watchdog_s: float = _key(600.0, "nonnegative")  # seconds a collective may wait; 0 = off
    zero_stage: int = _key(0, "zero_stage")  # 1: AdamW state sharded over the data-parallel group
    virtual_stages: int = _key(1, "positive")  # interleaved 1F1B: layer chunks per pipeline rank
    # Megatron's sequence parallelism in the regions outside tensor parallelism (sim only)
    sequence_parallel: bool = _key(False)


@dataclass(frozen=True)
class TrainConfig:
    run_dir: str = _key("runs/default", "path")
    steps: int = _key(100, "positive")
    micro_batch_size: int = _key(8, "positive")
    grad_accum: int = _key(1, "positive")
    global_batch_size: int = _key(0, "nonnegative")  # 0 = micro_batch_size * grad_accum * dp
    lr: float = _key(1e-3, "positive")
    min_lr_ratio: float = _key(0.1, "fraction")
    warmup_steps: int = _key(10, "nonnegative")
    weight_decay: float = _key(0.1, "nonnegative")
    beta1: float = _key(0.9, "beta")
    beta2: float = _key(0.95, "beta")
    adam_eps: float = _key(1e-8, "positive")
    grad_clip: float = _key(1.0, "nonnegative")  # 0 = off
    seed: int = _key(1337, "nonnegative")  # numpy seeds must be >= 0
    device: str = _key("cpu", choices=("cpu", "gpu"))
    dtype: str = _key("float32", choices=PRECISIONS)
    recompute: str = _key("none", choices=("none", "layer", "lowrank", "selective"))
    # which implementation runs attention on a GPU (boostmpi/gpu/attention.py); the CPU path ignores it
    attention: str = _key("auto", choices=ATTENTION_BACKENDS)
    log_every: int = _key(1, "positive")
    val_every: int = _key(0, "nonnegative")  # 0 = only at the end
    val_windows: int = _key(16, "positive")


@dataclass(frozen=True)
class DataConfig:
    # a shard path or glob, or the word "builtin" for the built-in corpus
    train: str = _key("builtin", "path")
    val: str = _key("builtin", "path")
    builtin_dir: str = _key("data/builtin", "path")  # where the built-in shards are prepared
    shuffle: bool = _key(True)  # windows in a new seeded order every epoch (false: in file order)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = _key(0, "nonnegative")  # steps; 0 = only at the end
    keep: int = _key(0, "nonnegative")  # 0 = keep all complete checkpoints, else the newest N
    # true: written from a snapshot by a background thread while training goes on (one save at a time)
    async_: bool = _key(False, name="async")


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
            "data": DataConfig, "checkpoint": CheckpointConfig}
_FIELDS = {name: {_key_of(f): f for f in fields(cls)} for name, cls in SECTIONS.items()}

# section -> key -> default; None marks a derived key
DEFAULTS = {name: {key: f.default for key, f in keys.items()} for name, keys in _FIELDS.items()}

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # section -> key -> value as the user set it; None = every value counts as explicit
    _explicit: dict[str, dict[str, object]] | None = field(default=None, compare=False, repr=False)

    @property
    def tokens_per_step(self):
        t = self.train
        return t.micro_batch_size * t.grad_accum * self.parallel.dp * self.model.seq_len

    def to_dict(self):
        return {name: {key: getattr(getattr(self, name), f.name) for key, f in _FIELDS[name].items()}
                for name in SECTIONS}

    def to_toml(self):
        lines = ["# boostmpi configuration, every key resolved"]
        for name, values in self.to_dict().items():
            lines += ["", f"[{name}]"] + [f"{key} = {_toml_value(v)}" for key, v in values.items()]
        return "\n".join(lines) + "\n"

    def replace(self, **changes):
        """A new validated Config with `{"section.key": value}` changes; derived keys follow."""
        explicit = self._explicit if self._explicit is not None else self.to_dict()
        explicit = {name: dict(values) for name, values in explicit.items()}
        for dotted, value in changes.items():
            section, key = _split_dotted(dotted)
            explicit.setdefault(section, {})[key] = _checked_type(section, key, value)
        return _build(explicit, world_size=None)

    def validate(self, world_size=None):
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

    def _origin(self, section, key):
        """' (derived: ...)' when the value was not set but derived, else ''."""
        describe = _FIELDS[section][key].metadata.get("describe")
        explicit = self._explicit is None or key in self._explicit.get(section, {})
        return "" if explicit or describe is None else f" (derived: {describe})"

    def _show(self, section, key):
        value = getattr(getattr(self, section), _FIELDS[section][key].name)
        return f"{section}.{key} = {_toml_value(value)}{self._origin(section, key)}"

    # -- checks ---------------------------------------------------------------------------

    def _check_key(self, section, f):
        key, value = _key_of(f), getattr(getattr(self, section), f.name)
        _checked_type(section, key, value)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise _error(f"{section}.{key} must be one of {', '.join(choices)}, got {value!r}")
        check = f.metadata.get("check")
        if check:
            holds, requirement = _RANGE_CHECKS[check]
            if not holds(value):
                raise _error(f"{section}.{key} {requirement}, got {_toml_value(value)}"
                             f"{self._origin(section, key)}")

    def _check_model(self):
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
            if rank <= 0:
                raise _error(f"model.{key} must be positive, got {rank}{self._origin('model', key)}")
            if rank > min(d_in, d_out):
                raise _error(f"{self._show('model', key)} is larger than min(d_in, d_out) = "
                             f"{min(d_in, d_out)} of the {name} projection ({d_in} -> {d_out}); "
                             "a low-rank factor cannot have a higher rank")

    def _check_parallel(self, world_size):
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

    def _check_interleaving(self):
        p = self.parallel
        if p.pp == 1:
            raise _error(f"parallel.virtual_stages = {p.virtual_stages} needs parallel.pp > 1: interleaving cuts a "
                         "pipeline into more stages than it has ranks")
        if p.pp * p.virtual_stages > self.model.n_layers:
            raise _error(f"parallel.pp * parallel.virtual_stages = {p.pp * p.virtual_stages} is larger than "
                         f"model.n_layers = {self.model.n_layers}: every virtual stage needs at least one layer")

    def sim_only(self):
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

    def check_runnable(self):
        """Raise ConfigError when the engine cannot run this configuration though `sim` prices it."""
        problem = self.sim_only()
        if problem:
            raise _error(problem)
        return self

    def _check_train(self):
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


def read_toml(path, what="config file", error=ConfigError):
    """A TOML file as a dict; a missing, unreadable or invalid file is one `error` naming it."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise error(f"{what} {path} not found") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{what} {path} is not valid TOML: {' '.join(str(exc).split())}") from None


def load_config(path, overrides=(), world_size=None):
    """Read a TOML file, apply `section.key=value` overrides, resolve and validate."""
    return config_from_dict(read_toml(path), overrides, world_size)


def config_from_dict(d, overrides=(), world_size=None):
    """A validated Config from `{"model": {...}, ...}` (any subset of sections and keys)."""
    explicit = _checked_sections(d if d is not None else {})
    for dotted, value in parse_overrides(overrides).items():
        section, key = dotted.split(".")
        explicit.setdefault(section, {})[key] = value
    return _build(explicit, world_size)


def parse_overrides(overrides):
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


def _parse_value(text):
    try:
        document = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    # text with a newline could smuggle in more keys: then it is no single TOML value
    return document["v"] if set(document) == {"v"} else text


def _build(explicit, world_size):
    values = {}
    for name, keys in _FIELDS.items():
        given = explicit.get(name, {})
        section = values[name] = {}
        for key, f in keys.items():  # declaration order: a derived key follows what it uses
            if key in given:
                section[key] = given[key]
            elif "derive" in f.metadata:
                section[key] = f.metadata["derive"](section)
            else:
                section[key] = f.default
            if f.metadata["check"] == "path" and isinstance(section[key], str):  # ~ and ~user, as a shell would
                section[key] = os.path.expanduser(section[key])
    _resolve_batch(values["train"], values["parallel"]["dp"], explicit.get("train", {}))
    cfg = Config(**{name: cls(**{_FIELDS[name][k].name: v for k, v in values[name].items()})
                    for name, cls in SECTIONS.items()}, _explicit=explicit)
    return cfg.validate(world_size)


def _resolve_batch(train, dp, given):
    """Fill in whichever of global_batch_size and grad_accum was left to be derived.

    Inconsistent or indivisible values are left as they are for `validate` to report.
    """
    per_accum = train["micro_batch_size"] * dp
    if train["global_batch_size"] == 0:
        train["global_batch_size"] = per_accum * train["grad_accum"]
    elif (train["global_batch_size"] > 0 and "grad_accum" not in given and per_accum > 0
          and train["global_batch_size"] % per_accum == 0):
        train["grad_accum"] = train["global_batch_size"] // per_accum


def _checked_sections(document):
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


def _split_dotted(dotted):
    section, _, key = dotted.partition(".")
    if not key:
        homes = [s for s, keys in _FIELDS.items() if dotted in keys]
        hint = f" (did you mean {homes[0]}.{dotted}?)" if homes else ""
        raise _error(f"key {dotted!r} must be written section.key{hint}")
    _check_section(section)
    return section, key


def _check_section(name):
    if name not in SECTIONS:
        close = difflib.get_close_matches(str(name), list(SECTIONS), n=1)
        hint = f" (did you mean [{close[0]}]?)" if close else f" (known: {', '.join(SECTIONS)})"
        raise _error(f"unknown section [{name}]{hint}")


def _checked_type(section, key, value):
    """`value` as the type of `section.key` (an int becomes a float for a float key)."""
    f = _FIELDS[section].get(key)
    if f is None:
        raise _error(f"unknown key {section}.{key}{_suggest_key(section, key)}")
    if f.type is bool:
        ok = isinstance(value, bool)
    elif f.type is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        top = 2**64 if key == "seed" else 2**63  # a seed may use all 64 bits; every other count fits int64
        if ok and not -2**63 <= value < top:
            raise _error(f"{section}.{key} = {value} does not fit in 64 bits (at most {top - 1})")
    elif f.type is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise _error(f"{section}.{key} must be a finite number, got {value!r}")
    else:
        ok = isinstance(value, str)
    if not ok:
        raise _error(f"{section}.{key} must be {_TYPE_WORDS[f.type]}, got {value!r} ({type(value).__name__})")
    return f.type(value)


def _suggest_key(section, key):
    known = list(_FIELDS[section])
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        return f" (did you mean {section}.{close[0]}?)"
    homes = [s for s, keys in _FIELDS.items() if key in keys]
    if homes:
        return f" (did you mean {homes[0]}.{key}?)"
    return f" (known keys of [{section}]: {', '.join(known)})"


def _error(message):
    # a value quoted into a message must not break the one-line promise
    return ConfigError(" ".join(str(message).splitlines()))


# -- a writer for the TOML subset a Config needs: one level of tables of scalars ---------------

_STRING_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest text that reads back to the same float
    if isinstance(value, str):
        escaped = (_STRING_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ch < " " or ch == "\x7f" else ch)
                   for ch in value)
        return '"' + "".join(escaped) + '"'
    return repr(value)  # only in messages about values of a wrong type


__all__ = ["ARCHS", "LOWRANK_ARCHS", "SECTIONS", "DEFAULTS", "Config", "ModelConfig",
           "ParallelConfig", "TrainConfig", "DataConfig", "CheckpointConfig", "load_config",
           "config_from_dict", "parse_overrides"]
