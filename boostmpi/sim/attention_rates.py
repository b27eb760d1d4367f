"""Attention rates of a machine profile, per backend, and the price of one attention call.

A profile rates each attention backend it can run in a table of its own (docs/SIM.md, "Attention"):

    [attention.cudnn]                      # backend: cudnn (NVIDIA only), torch or own
    source = "bench/log/attention.md ..."  # required: the bench/log entry or URL the rates come from
    d128 = { forward = 5.85e14, backward = 4.89e14, shape = [4, 4096, 32, 32, 128] }
    d64 = { forward = ..., backward = ..., shape = [...] }

FLOP/s by direction, either per head dim (`d<Dh>` tables) or for every head dim (`forward` and
`backward` at the top of the table). `own` rates each variant of its kernels (`wmma.d128 = {...}`,
`fma.d64 = {...}`). `shape` = (B, T, H, Hkv, Dh) is what the rate was measured at; a rate with a
shape is carried to another sequence length by `tile_efficiency` (below); one without is used as is.

FLOPs are the causal count, stated here once and used by `boostmpi sim`, `bench/attention.py` and
`bench/gpu_trace.py` alike: forward 4·B·H·T²·Dh / 2 (QKᵀ and PV over the lower triangle),
backward 2.5× the forward (FlashAttention-2's five T×T products to the forward's two).
"""

import math
from dataclasses import dataclass

from boostmpi.errors import UserError

BACKENDS = ("cudnn", "torch", "own")
OWN_VARIANTS = ("wmma", "fma")
DIRECTIONS = ("forward", "backward")
BACKWARD_RATIO = 2.5
# The sequence model: a causal kernel walks 64-row tiles; tile i visits i key tiles, the diagonal one
# half used, and pays a fixed cost of TILE_OVERHEAD tile visits (loading its rows, writing its
# result and statistics). Useful work n²/2 of n(n+1)/2 + TILE_OVERHEAD·n visits: the efficiency
# n / (n + 1 + 2·TILE_OVERHEAD) at n = T/64. TILE_OVERHEAD = 2 is fitted to the own kernels' H200
# table (bench/log/attention.md; tests/test_sim_attention.py checks every shape of it within 25%).
TILE = 64
TILE_OVERHEAD = 2


def causal_flops(B, H, T, Dh, direction="forward"):
    """FLOPs of one causal attention call of B x H heads (q heads) of T x Dh, counted as above."""
    forward = 4.0 * B * H * T * T * Dh / 2
    return forward * (BACKWARD_RATIO if direction == "backward" else 1.0)


def tile_efficiency(T):
    """The fraction of a causal kernel's tile visits that is useful work at sequence length T."""
    n = max(1, math.ceil(T / TILE))
    return n / (n + 1 + 2 * TILE_OVERHEAD)


@dataclass(frozen=True)
class Rate:
    forward: float  # FLOP/s
    backward: float
    shape: tuple[int, ...] | None = None  # (B, T, H, Hkv, Dh) the rates were measured at, or None (a published rate)


@dataclass(frozen=True)
class RateTable:
    source: str
    rates: dict  # (variant or None, head dim or None) -> Rate


def _fail(source, text):
    raise UserError(f"machine profile {source}: {text}")


def _rate(body, where, source, highest, head_dim):
    if not isinstance(body, dict):
        _fail(source, f"{where} must be a table of forward, backward (FLOP/s) and shape")
    unknown = sorted(set(body) - {"forward", "backward", "shape"})
    if unknown:
        _fail(source, f"{where} has unknown key {unknown[0]!r} (forward, backward, shape)")
    out = {}
    for direction in DIRECTIONS:
        value = body.get(direction)
        if value is None:
            _fail(source, f"missing key {where}.{direction}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0 < value <= highest:
            _fail(source, f"{where}.{direction} must be a rate in FLOP/s above 0 and at most the profile's "
                          f"highest peak ({highest:.4g}), got {value!r}")
        out[direction] = float(value)
    shape = body.get("shape")
    if shape is not None:
        if not (isinstance(shape, list) and len(shape) == 5 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                   and x > 0 for x in shape)):
            _fail(source, f"{where}.shape must be [B, T, H, Hkv, Dh], five positive integers, got {shape!r}")
        if shape[2] % shape[3]:
            _fail(source, f"{where}.shape: H = {shape[2]} is not a multiple of Hkv = {shape[3]}")
        if head_dim is not None and shape[4] != head_dim:
            _fail(source, f"{where}.shape has head dim {shape[4]}, not {head_dim}")
        shape = tuple(shape)
    return Rate(out["forward"], out["backward"], shape)


def _rates(body, where, source, highest, variant):
    """{(variant, Dh or None): Rate} of one table body: forward/backward, or d<Dh> tables."""
    if not isinstance(body, dict):
        _fail(source, f"{where} must be a table")
    if "forward" in body or "backward" in body:
        return {(variant, None): _rate(body, where, source, highest, None)}
    out = {}
    for key, entry in body.items():
        if not (key.startswith("d") and key[1:].isdigit() and int(key[1:]) > 0):
            _fail(source, f"{where} has unknown key {key!r} (forward and backward, or d<head dim> tables such as d128)")
        out[(variant, int(key[1:]))] = _rate(entry, f"{where}.{key}", source, highest, int(key[1:]))
    if not out:
        _fail(source, f"{where} holds no rate (forward and backward, or d<head dim> tables)")
    return out


def parse_tables(document, values, source):
    """The profile's `attention` section, validated: {backend: RateTable}. `values` = the profile's
    other fields (its peaks bound every rate; only an NVIDIA profile may rate cudnn)."""
    if not isinstance(document, dict):
        _fail(source, "attention must be a table of [attention.<backend>] rate tables")
    highest = max(values["peak_flops"].values())
    tables = {}
    for backend, table in document.items():
        where = f"attention.{backend}"
        if backend not in BACKENDS:
            _fail(source, f"{where}: unknown attention backend (one of {', '.join(BACKENDS)})")
        if backend == "cudnn" and values.get("vendor") != "nvidia":
            _fail(source, f"{where}: cuDNN runs on NVIDIA GPUs only (the profile's vendor is {values.get('vendor')!r})")
        if not isinstance(table, dict):
            _fail(source, f"{where} must be a table")
        text = table.get("source")
        if not isinstance(text, str) or not text.strip():
            _fail(source, f"{where} has no source (the bench/log entry or URL its rates come from)")
        body = {k: v for k, v in table.items() if k != "source"}
        if backend == "own":
            unknown = sorted(set(body) - set(OWN_VARIANTS))
            if unknown or not body:
                _fail(source, f"{where} rates the own kernels per variant ({', '.join(OWN_VARIANTS)})"
                              + (f": unknown key {unknown[0]!r}" if unknown else ": none given"))
            rates = {}
            for variant, entry in body.items():
                rates.update(_rates(entry, f"{where}.{variant}", source, highest, variant))
        else:
            rates = _rates(body, where, source, highest, None)
        tables[backend] = RateTable(text, rates)
    return tables


def tables_to_toml(tables, number):
    """TOML lines of `tables` ({backend: RateTable}) in the profile layout; `number` formats a float."""
    lines = []
    for backend, table in tables.items():
        lines += ["", f"[attention.{backend}]", "source = " + _quoted(table.source)]
        for (variant, head_dim), rate in table.rates.items():
            key = ".".join(k for k in (variant, f"d{head_dim}" if head_dim else None) if k)
            fields = [f"forward = {number(rate.forward)}", f"backward = {number(rate.backward)}"]
            if rate.shape:
                fields.append(f"shape = [{', '.join(str(x) for x in rate.shape)}]")
            if key:
                lines.append(f"{key} = {{ {', '.join(fields)} }}")
            else:
                lines += fields
    return lines


def _quoted(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def resolve_backend(setting, machine):
    """The backend `train.attention` names on `machine`: "auto" is cudnn on an NVIDIA profile, torch
    on any other (AMD's included)."""
    setting = setting or "auto"
    if setting == "auto":
        return "cudnn" if machine.vendor == "nvidia" else "torch"
    if setting not in BACKENDS:
        raise UserError(f"train.attention = {setting!r}: one of auto, {', '.join(BACKENDS)}")
    return setting


def own_variant(machine, dtype):
    """The own kernels' variant a run takes: the tensor-core (WMMA) kernels for bfloat16 on NVIDIA,
    the FMA kernels otherwise (boostmpi/gpu/tensor_cores.py's default)."""
    return "wmma" if dtype == "bfloat16" and machine.vendor == "nvidia" else "fma"


def lookup(machine, backend, variant, head_dim):
    """(Rate, source) of `backend` (and, for own, `variant`) at `head_dim` on `machine`: the head dim's
    own entry, else the table's entry for every head dim, else the nearest head dim it rates (the
    smaller of two as near)."""
    table = machine.attention_rates.get(backend)
    if table is None:
        rated = ", ".join(machine.attention_rates) or "none"
        raise UserError(f"machine profile {machine.name} has no rate for attention backend {backend!r} "
                        f"([attention.{backend}]; it rates: {rated}): set train.attention to one it rates")
    if backend != "own":
        variant = None
    elif variant not in OWN_VARIANTS:
        raise UserError(f"the own attention kernels' variant must be one of {', '.join(OWN_VARIANTS)}, got {variant!r}")
    entries = {dh: rate for (v, dh), rate in table.rates.items() if v == variant}
    if not entries:
        raise UserError(f"machine profile {machine.name} has no rate for the own kernels' {variant} variant "
                        f"([attention.own.{variant}])")
    if head_dim in entries:
        return entries[head_dim], table.source
    if None in entries:
        return entries[None], table.source
    nearest = min(entries, key=lambda dh: (abs(dh - head_dim), dh))
    return entries[nearest], table.source


def attention_rate(machine, backend, variant, Dh, direction):
    """(FLOP/s, source) of one direction ("forward" or "backward") of `backend` at head dim `Dh` on
    `machine` (a `machines.Machine`), as its profile states it (at the shape it was measured at)."""
    if direction not in DIRECTIONS:
        raise UserError(f"attention direction must be forward or backward, got {direction!r}")
    rate, source = lookup(machine, backend, variant, Dh)
    return getattr(rate, direction), source


def attention_seconds(machine, backend, variant, B, H, T, Dh, direction):
    """Seconds of one causal attention call of B x H (q) heads of T x Dh: its causal FLOPs at the
    rate of its head dim, carried from the rate's measured sequence length to T by `tile_efficiency`."""
    rate, _ = lookup(machine, backend, variant, Dh)
    flops_per_s = getattr(rate, direction)
    if rate.shape is not None:
        flops_per_s *= tile_efficiency(T) / tile_efficiency(rate.shape[1])
    return causal_flops(B, H, T, Dh, direction) / flops_per_s
