"""Machine profiles: the numbers the performance model knows about a device, a node and its links.

A profile is a TOML file (the built-in ones live in `boostmpi/sim/profiles/`; docs/SIM.md says
where each number comes from). `load_machine(name_or_path)` takes a built-in name, an alias such
as `perlmutter`, or a path to a user's TOML file, and returns a validated `Machine`. A missing
key, a wrong type, a number out of its range (a rate or size not positive, a latency negative, an
efficiency outside (0, 1]) or an unknown machine name is a `UserError` naming the problem.

Attention is priced per backend from the profile's `[attention.<backend>]` rate tables
(`boostmpi/sim/attention_rates.py`); `attention_rate(machine, backend, variant, Dh, direction)`
looks one rate up.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from boostmpi.errors import UserError
from boostmpi.sim.attention_rates import RateTable, attention_rate, parse_tables, tables_to_toml  # noqa: F401 (attention_rate: the lookup bench/gpu_trace.py uses)
from boostmpi.toml_io import toml_value

PROFILE_DIR = Path(__file__).with_name("profiles")

# site names -> the built-in profile of their GPUs
ALIASES = {
    "perlmutter": "a100-80gb",  # the "gpu&hbm80g" nodes; the 40 GB nodes are a100-40gb
    "polaris": "a100-40gb",
    "frontier": "mi250x-gcd",
    "selene": "a100-80gb-dgx",
    "dgx-a100": "a100-80gb-dgx",
    "a100": "a100-80gb",
    "h100": "h100-sxm",
    "h200": "h200",
    "mi250x": "mi250x-gcd",
}

DTYPES = ("float64", "float32", "bfloat16")


def profile_for_device(name: str, total_bytes: int) -> str | None:
    """The built-in profile of a GPU by the name its driver reports (`cudaGetDeviceProperties`'s
    `name`: "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "AMD Instinct MI250X") and its memory,
    or None for a device without one (then no MFU is reported). An A100 with more than 48 GB is the
    80 GB part; an H100 must be the SXM part (HBM3; the PCIe card has lower peaks)."""
    name = name.upper()
    if "A100" in name:
        return "a100-80gb" if total_bytes > 48 * 10 ** 9 else "a100-40gb"
    if "H200" in name:
        return "h200"
    if "H100" in name and ("SXM" in name or "HBM3" in name):
        return "h100-sxm"
    if "MI250X" in name:
        return "mi250x-gcd"
    return None


@dataclass(frozen=True)
class Machine:
    name: str
    description: str
    device: str  # "gpu" or "cpu": what one "GPU" of the model is (a CPU core for calibrated profiles)
    # [memory]
    memory_capacity_bytes: float  # per device
    memory_bandwidth: float  # bytes/s, peak of one device
    elementwise_efficiency: float  # fraction of memory_bandwidth that streaming kernels reach
    # [compute]
    peak_flops: dict[str, float]  # dtype name -> dense FLOP/s of one device
    gemm_efficiency: float  # fraction of peak a large, well-shaped GEMM reaches
    gemm_tile_m: int  # output tile of one compute unit (tile and wave quantisation)
    gemm_tile_n: int
    gemm_k_overhead: float  # prologue/epilogue cost of one tile, in k-steps: efficiency k/(k + this)
    gemm_mn_overhead: float  # per-dim overhead of thin GEMMs (packing on CPUs): m/(m + this)
    compute_units: int  # SMs / CUs / cores that run tiles concurrently
    attention: str  # "flash" (fused kernel, no T x T tensor), "matmul" (scores materialised, boostmpi's
    # tiled softmax) or "fused_softmax" (scores materialised, a fused softmax kernel: pre-flash frameworks)
    kernel_launch_s: float  # fixed cost of one kernel (or one NumPy call)
    optimizer_passes: float  # full passes over a master-dtype buffer of one AdamW step
    # [node]
    gpus_per_node: int
    # [network]
    intra_node_bandwidth: float  # bytes/s: collective bus bandwidth inside a node
    intra_node_latency: float  # seconds per collective step inside a node
    inter_node_bandwidth: float  # bytes/s per device across nodes
    inter_node_latency: float
    # [compute], optional: "engine" (boostmpi's own kernels, kernels/*.cu: their launches and passes,
    # docs/SIM.md), "fused" (another framework's: one fused kernel per elementwise step each way) or
    # "eager" (eager PyTorch, op by op)
    elementwise: str = "engine"
    # [compute], optional: bytes per parameter that a separate gradient-accumulation pass moves after
    # every micro-batch's backward; 0 when the weight-gradient GEMMs accumulate into the master-dtype
    # gradient themselves (boostmpi's engine, Megatron-LM's gradient-accumulation fusion)
    grad_accumulation_bytes: float = 0.0
    # [compute], optional, ZeRO-3 only: bytes per parameter that the stack's own copies move on the
    # compute stream around each all-gather of the weights (e.g. out of the gather's buffer into the
    # parameters) and around each reduce-scatter of the gradients (e.g. into the reduce-scatter's
    # buffer, cast to its dtype); 0: none (the collectives read and write the tensors in place)
    zero3_gather_copy_bytes: float = 0.0
    zero3_reduce_copy_bytes: float = 0.0
    # [network], optional: how a pipeline's sends and receives are issued: "batched" (a send and the
    # matching receive of the other direction in one call: two transfers on a step's path) or
    # "blocking" (each send and receive its own blocking call in schedule order: four)
    pipeline_p2p: str = "batched"
    # optional: "nvidia", "amd" or "other"; which attention backend `train.attention = "auto"` runs
    # (cudnn on NVIDIA, torch elsewhere) and which backends a profile may rate (cudnn: NVIDIA only)
    vendor: str = "other"
    # [attention.<backend>]: backend -> attention_rates.RateTable (FLOP/s by direction, variant, head dim)
    attention_rates: dict[str, RateTable] = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise UserError(f"machine {self.name} has no compute.peak_flops.{dtype}")
        return self.peak_flops[dtype]


# TOML location of every field: (section or None for the top level, key, type)
_LAYOUT = {
    "name": (None, "name", str),
    "description": (None, "description", str),
    "device": (None, "device", str),
    "memory_capacity_bytes": ("memory", "capacity_bytes", float),
    "memory_bandwidth": ("memory", "bandwidth", float),
    "elementwise_efficiency": ("memory", "elementwise_efficiency", float),
    "peak_flops": ("compute", "peak_flops", dict),
    "gemm_efficiency": ("compute", "gemm_efficiency", float),
    "gemm_tile_m": ("compute", "gemm_tile_m", int),
    "gemm_tile_n": ("compute", "gemm_tile_n", int),
    "gemm_k_overhead": ("compute", "gemm_k_overhead", float),
    "gemm_mn_overhead": ("compute", "gemm_mn_overhead", float),
    "compute_units": ("compute", "compute_units", int),
    "attention": ("compute", "attention", str),
    "kernel_launch_s": ("compute", "kernel_launch_s", float),
    "elementwise": ("compute", "elementwise", str),
    "optimizer_passes": ("compute", "optimizer_passes", float),
    "gpus_per_node": ("node", "gpus_per_node", int),
    "intra_node_bandwidth": ("network", "intra_node_bandwidth", float),
    "intra_node_latency": ("network", "intra_node_latency", float),
    "inter_node_bandwidth": ("network", "inter_node_bandwidth", float),
    "inter_node_latency": ("network", "inter_node_latency", float),
    "grad_accumulation_bytes": ("compute", "grad_accumulation_bytes", float),
    "zero3_gather_copy_bytes": ("compute", "zero3_gather_copy_bytes", float),
    "zero3_reduce_copy_bytes": ("compute", "zero3_reduce_copy_bytes", float),
    "pipeline_p2p": ("network", "pipeline_p2p", str),
    "vendor": (None, "vendor", str),
}
assert set(_LAYOUT) | {"attention_rates"} == {f.name for f in fields(Machine)}

_CHOICES = {"device": ("gpu", "cpu"), "attention": ("flash", "matmul", "fused_softmax"),
            "elementwise": ("engine", "fused", "eager"), "pipeline_p2p": ("batched", "blocking"),
            "vendor": ("nvidia", "amd", "other")}
# keys a profile may leave out, and their values then (profiles written before the key existed)
_OPTIONAL = {"elementwise": "engine", "grad_accumulation_bytes": 0.0, "pipeline_p2p": "batched",
             "zero3_gather_copy_bytes": 0.0, "zero3_reduce_copy_bytes": 0.0, "vendor": "other"}
# the range of every number a profile holds (peak_flops' rates: positive; attention rates:
# attention_rates.parse_tables)
_POSITIVE = {"memory_capacity_bytes", "memory_bandwidth", "gemm_tile_m", "gemm_tile_n", "compute_units",
             "optimizer_passes", "gpus_per_node", "intra_node_bandwidth", "inter_node_bandwidth"}
_NON_NEGATIVE = {"grad_accumulation_bytes", "zero3_gather_copy_bytes", "zero3_reduce_copy_bytes", "kernel_launch_s",
                 "intra_node_latency", "inter_node_latency", "gemm_k_overhead", "gemm_mn_overhead"}
_FRACTION = {"elementwise_efficiency", "gemm_efficiency"}  # in (0, 1]
assert not (_POSITIVE | _NON_NEGATIVE | _FRACTION) - set(_LAYOUT)
assert {k for k, (_, _, kind) in _LAYOUT.items() if kind in (int, float)} == _POSITIVE | _NON_NEGATIVE | _FRACTION


def builtin_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_machine(name_or_path: str | Path) -> Machine:
    """A built-in profile name, an alias (`perlmutter`, `frontier`, ...) or a TOML file path."""
    text = str(name_or_path)
    key = ALIASES.get(text.lower(), text.lower())
    if key in builtin_names():
        return machine_from_file(PROFILE_DIR / f"{key}.toml")
    path = Path(text)
    if path.suffix == ".toml" or path.exists():
        return machine_from_file(path)
    known = ", ".join(builtin_names() + sorted(ALIASES))
    raise UserError(f"unknown machine {text!r} (built-in: {known}; or give a profile .toml path)")


def machine_from_file(path: str | Path) -> Machine:
    from boostmpi.toml_io import read_toml

    return machine_from_dict(read_toml(path, "machine profile", UserError), source=str(path))


def machine_from_dict(document: Mapping[str, object], source: str = "profile") -> Machine:
    """A validated Machine from the TOML document layout (sections memory, compute, node, network)."""
    values: dict[str, ProfileValue] = {}
    for field_name, (section, key, kind) in _LAYOUT.items():
        where = f"{section}.{key}" if section else key
        table = document if section is None else document.get(section, {})
        if isinstance(table, dict) and key not in table and field_name in _OPTIONAL:
            table = {key: _OPTIONAL[field_name]}
        if not isinstance(table, dict) or key not in table:
            raise UserError(f"machine profile {source}: missing key {where}")
        value = table[key]
        checked = values[field_name] = _checked(value, kind, where, source)
        if field_name in _CHOICES and value not in _CHOICES[field_name]:
            raise UserError(f"machine profile {source}: {where} must be one of "
                            f"{', '.join(_CHOICES[field_name])}, got {value!r}")
        if not isinstance(checked, (int, float)):  # the ranges below are of numbers only
            continue
        if field_name in _POSITIVE and not checked > 0:
            raise UserError(f"machine profile {source}: {where} must be positive, got {value!r}")
        if field_name in _NON_NEGATIVE and checked < 0:
            raise UserError(f"machine profile {source}: {where} must be 0 or more, got {value!r}")
        if field_name in _FRACTION and not 0 < checked <= 1:
            raise UserError(f"machine profile {source}: {where} is a fraction of a peak: it must be in (0, 1], "
                            f"got {value!r}")
    rates = parse_tables(document.get("attention", {}), values, source)
    return Machine(**values, attention_rates=rates)  # type: ignore[arg-type]  # each value _checked against its field's type


ProfileValue = str | int | float | dict[str, float]
"""A value of a profile's field, as `_checked` admits it."""


def _checked(value: object, kind: type, where: str, source: str) -> ProfileValue:
    if kind is dict:
        if not isinstance(value, dict) or not value:
            raise UserError(f"machine profile {source}: {where} must be a table of dtype = FLOP/s")
        rates: dict[str, float] = {}
        for dtype, rate in value.items():
            if dtype not in DTYPES:
                raise UserError(f"machine profile {source}: {where}.{dtype} is not a dtype "
                                f"({', '.join(DTYPES)})")
            rates[dtype] = _checked_number(rate, float, f"{where}.{dtype}", source)
            if not rates[dtype] > 0:
                raise UserError(f"machine profile {source}: {where}.{dtype} must be positive, got {rate!r}")
        return rates
    if kind is not str:
        return _checked_number(value, kind, where, source)
    if not isinstance(value, str):
        raise UserError(f"machine profile {source}: {where} must be {kind.__name__}, got {value!r}")
    return value


def _checked_number(value: object, kind: type, where: str, source: str) -> float:
    """`value` as `kind` (int or float): an int that is not a bool, or a finite number."""
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if kind is not int and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise UserError(f"machine profile {source}: {where} must be {kind.__name__}, got {value!r}")


def machine_to_toml(machine: Machine, comments: Mapping[str, str] | None = None) -> str:
    """TOML text of `machine` in the profile layout; `comments` maps field name -> a note."""
    comments = comments or {}
    sections: dict[str | None, list[tuple[str, str, ProfileValue]]] = {}
    for field_name, (section, key, kind) in _LAYOUT.items():
        sections.setdefault(section, []).append((field_name, key, getattr(machine, field_name)))
    sections[None].sort(key=lambda entry: entry[0] == "vendor")  # name, description, device, vendor
    lines = []
    for section, entries in sections.items():
        if section is not None:
            lines += ["", f"[{section}]"]
        for field_name, key, value in entries:
            if isinstance(value, dict):
                text = "{ " + ", ".join(f"{k} = {_number(v)}" for k, v in value.items()) + " }"
            elif isinstance(value, str):
                text = toml_value(value)
            else:
                text = _number(value)
            note = comments.get(field_name)
            lines.append(f"{key} = {text}" + (f"  # {note}" if note else ""))
    lines += tables_to_toml(machine.attention_rates, _number)
    return "\n".join(lines).lstrip("\n") + "\n"


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
        # the shortest digits that read back as the same float (a measured rate keeps every digit),
        # in exponent form: e.g. 3.12e+14, valid TOML
        return np.format_float_scientific(value, unique=True, trim="-")
    return repr(float(value))
