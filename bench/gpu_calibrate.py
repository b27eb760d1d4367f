"""Measure one GPU and write a `boostmpi sim` machine profile from what was measured.

    python bench/gpu_calibrate.py --out PROFILE.toml [--base h100-sxm] [--name NAME] [--repeats 5]
    python bench/gpu_calibrate.py --timings RAW.json --out PROFILE.toml   (no GPU: the arithmetic only)

What it measures, each with CUDA events (bench/gpu_step.py's `gpu_time`: warm-up calls, then the
median of --repeats timed ones):
  GEMMs     bf16 cuBLAS (the engine's `boostmpi.gpu.blas.matmul`, random operands) at every shape the
            performance model prices for one layer of the paper's 7B and 13B layouts (bench/
            gpu_trace.py's PAPER; micro-batch 4, T 4096), cola and full, forward and both backward
            products, tensor-parallel sizes 1, 2, 4 and 8 (boostmpi.sim.plans: the same plan
            `boostmpi sim` prices), each distinct shape once; plus 8192^3 in bf16 and float32;
  copy      a device-to-device copy of 1 GiB (bytes read + written per second);
  fused     RMSNorm forward and backward at the 7B width in bf16 (bench/gpu_step.py's
            `rmsnorm_bandwidth`), and the fused AdamW kernel over 2^26 float32 parameters;
  launch    10,000 launches of a one-element kernel, back to back;
  attention every attention backend (cudnn, torch, own-wmma, own-fma, with PyTorch's SDPA as the
            reference) at the paper's per-GPU shapes, by calling bench/attention.py's `run` (loaded
            from its path: bench is not a package).
The profile: peak_flops = the best measured GEMM rate of each dtype, the GEMM overheads fitted to
every measured shape with `boostmpi.sim.calibrate.fit_gemm_overheads` and gemm_efficiency with them
(`fit_gemm`; each shape's residual, log(model / measured), is printed and kept in the raw JSON),
memory bandwidth =
the copy's, elementwise_efficiency = the fused kernels' mean bandwidth over the copy's,
optimizer_passes from the AdamW time, kernel_launch_s measured, and one `[attention.<backend>]`
rate table per backend that ran, in the layout of boostmpi/sim/attention_rates.py (`d<Dh>` entries,
own's per variant, each with the shape it was measured at), FLOP/s by bench/attention.py's causal
count.
What one GPU cannot measure (tile sizes, links, GPUs per node) comes from the --base profile and
says so. A `[sources]` table names the source of every key; the header names the device, driver,
CUDA runtime, CuPy, cuDNN and PyTorch versions and the date.

Beside PROFILE.toml it writes PROFILE.json: every raw measurement (the --timings input: rerunning
with it gives the same profile) and the residuals. Without a GPU (CuPy missing, no device, or the
test suite's CuPy stand-in) it says so in one line and exits 2 without writing anything.
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TP_SIZES = (1, 2, 4, 8)
LAYOUTS = ("7b", "13b")
ARCHS = ("cola", "full")
MICRO_BATCH = 4
MAX_GEMM_SHAPES = 200  # the distinct shapes of the lists above: 162
PEAK_SIZE = 8192
COPY_BYTES = 1 << 30
ADAMW_PARAMS = 1 << 26
LAUNCHES = 10_000
ATTENTION_BUDGET_S = 90  # bench/attention.py's --budget-s: what is left unmeasured then is an error row
ATTENTION_BACKENDS = ("sdpa", "cudnn", "torch", "own-wmma", "own-fma")
AUTO_ORDER = ("cudnn", "torch", "own-wmma")  # what train.attention = "auto" picks on NVIDIA, in order


def flush_print(*args):
    print(*args, flush=True)


# ------------------------------------------------------------------ what is measured
def load_bench(name):
    """bench/<name>.py as a module (bench is not a package)."""
    path = REPO / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAPER_MODEL_KEYS = ("d_model", "n_layers", "n_heads", "d_ff", "rank")


def paper_layouts():
    """{"7b": {"model": {...}}, "13b": ...}: the model dimensions of configs/paper_7b.toml and
    configs/paper_13b.toml (the layers bench/gpu_trace.py --paper prices), read as TOML data."""
    import tomllib

    layouts = {}
    for name in ("7b", "13b"):
        with open(REPO / "configs" / f"paper_{name}.toml", "rb") as f:
            model = tomllib.load(f)["model"]
        layouts[name] = {"model": {key: model[key] for key in PAPER_MODEL_KEYS}}
    return layouts


def gemm_shapes():
    """[(m, n, k, batch, label)]: each distinct GEMM `boostmpi sim` prices for one layer of the paper's
    layouts, forward (m, n, k), dx (m, k, n) and dw (k, n / dw_split, m), in first-seen order."""
    from boostmpi.config import config_from_dict
    from boostmpi.sim.operations import Gemm, shape_of
    from boostmpi.sim.plans import layer_plan, plan_strategy

    seen, out = set(), []
    for name, layout in paper_layouts().items():
        for arch in ARCHS:
            for tp in TP_SIZES:
                model = dict(layout["model"], arch=arch, vocab_size=32000, seq_len=4096)
                mode = "btp" if arch == "cola" else "vanilla"
                cfg = config_from_dict({"model": model, "parallel": {"tp": tp, "tp_mode": mode, "grouped": True},
                                        "train": {"device": "gpu", "dtype": "bfloat16",
                                                  "micro_batch_size": MICRO_BATCH}})
                for op in layer_plan(shape_of(cfg, "flash"), plan_strategy(cfg)):
                    if not isinstance(op, Gemm):
                        continue
                    for kind, (m, n, k) in (("fwd", (op.m, op.n, op.k)), ("dx", (op.m, op.k, op.n)),
                                            ("dw", (op.k, op.n // op.dw_split, op.m))):
                        key = (m, n, k, op.batch)
                        if key not in seen:
                            seen.add(key)
                            out.append((*key, f"{name} {arch} tp{tp} {op.name} {kind}"))
    if len(out) > MAX_GEMM_SHAPES:
        raise RuntimeError(f"{len(out)} GEMM shapes, more than MAX_GEMM_SHAPES = {MAX_GEMM_SHAPES}")
    return out


def no_gpu_reason():
    """None when CuPy reaches a real GPU, else why not (one line)."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not importable ({exc})"
    if getattr(cupy, "__standin__", False) or "cupy_standin" in (getattr(cupy, "__file__", "") or ""):
        return "this `cupy` is the test suite's stand-in (testing/cupy_standin), not a GPU"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as exc:  # noqa: BLE001 - any failure to reach a device is the one-line reason
        return f"CuPy reaches no CUDA device ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    return None


def _version(module):
    try:
        return getattr(__import__(module), "__version__", "?")
    except Exception:  # noqa: BLE001 - absent or broken: not part of this environment
        return None


def device_facts():
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    cudnn = None
    try:
        from cupy_backends.cuda.libs import cudnn as _cudnn

        cudnn = str(_cudnn.getVersion())
    except Exception:  # noqa: BLE001
        pass
    try:
        import cudnn as frontend

        cudnn = f"{cudnn or '?'} (frontend {frontend.__version__})"
    except Exception:  # noqa: BLE001
        pass
    return {"name": props["name"].decode(), "sm_count": int(props["multiProcessorCount"]),
            "memory_bytes": int(props["totalGlobalMem"]), "gpus": int(cupy.cuda.runtime.getDeviceCount()),
            "driver": cupy.cuda.runtime.driverGetVersion(), "runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cupy": cupy.__version__, "cudnn": cudnn, "torch": _version("torch"), "host": platform.node()}


def measure(repeats, attention_shapes):
    """Every raw measurement on this GPU, as the --timings JSON holds them."""
    import cupy
    import ml_dtypes
    import numpy as np

    from boostmpi.gpu import adamw_kernels, blas, kernels

    step = load_bench("gpu_step")

    def timed(fn, reps=repeats):
        return step.gpu_time(fn, reps)

    raw = {"device": device_facts(), "gemm": [], "peak": {}}
    flush_print(f"device: {raw['device']['name']} ({raw['device']['sm_count']} SMs), driver {raw['device']['driver']}, "
                f"runtime {raw['device']['runtime']}, CuPy {raw['device']['cupy']}")
    bf16 = ml_dtypes.bfloat16
    shapes = gemm_shapes()
    rng = cupy.random.default_rng(0)  # random operands: cuBLAS runs constant data at higher clocks (less power)
    started = time.perf_counter()
    for i, (m, n, k, batch, label) in enumerate(shapes):
        lead = (batch,) if batch > 1 else ()
        a = rng.standard_normal(lead + (m, k), dtype=np.float32).astype(bf16)
        b = rng.standard_normal(lead + (k, n), dtype=np.float32).astype(bf16)
        out = cupy.empty(lead + (m, n), dtype=bf16)
        raw["gemm"].append([m, n, k, batch, timed(lambda: blas.matmul(a, b, out)), label])
        del a, b, out
        if (i + 1) % 25 == 0 or i + 1 == len(shapes):
            flush_print(f"  GEMM {i + 1}/{len(shapes)} ({time.perf_counter() - started:.0f} s)")
    for name, dtype in (("bfloat16", bf16), ("float32", np.float32)):
        a = rng.standard_normal((PEAK_SIZE, PEAK_SIZE), dtype=np.float32).astype(dtype)
        out = cupy.empty_like(a)
        raw["peak"][name] = [PEAK_SIZE, timed(lambda: blas.matmul(a, a, out))]
        del a
    flush_print(f"  GEMM {PEAK_SIZE}^3: bf16 {2 * PEAK_SIZE ** 3 / raw['peak']['bfloat16'][1] / 1e12:.0f} TFLOP/s, "
                f"float32 {2 * PEAK_SIZE ** 3 / raw['peak']['float32'][1] / 1e12:.0f} TFLOP/s")

    src = cupy.ones(COPY_BYTES // 4, dtype=np.float32)
    dst = cupy.empty_like(src)
    raw["copy"] = {"bytes": 2 * COPY_BYTES, "seconds": timed(lambda: dst.__setitem__(Ellipsis, src))}
    del src, dst
    forward, copy, backward = step.rmsnorm_bandwidth(dtype="bfloat16")
    raw["fused"] = {"rmsnorm_forward": forward, "rmsnorm_backward": backward, "copy_same_bytes": copy}
    p, g, mo, v = (cupy.ones(ADAMW_PARAMS, dtype=np.float32) for _ in range(4))
    bounds = cupy.asarray(np.array([0, ADAMW_PARAMS], dtype=np.int64))
    raw["adamw"] = {"params": ADAMW_PARAMS, "seconds": timed(
        lambda: adamw_kernels.adamw_step(p, g, mo, v, bounds, 1e-4, 0.9, 0.95, 1e-8, 0.1, 1.0, 1))}
    del p, g, mo, v
    flush_print(f"  copy {raw['copy']['bytes'] / raw['copy']['seconds'] / 1e9:.0f} GB/s, rmsnorm bf16 forward "
                f"{forward / 1e9:.0f} GB/s ({forward / copy:.0%} of copy), backward {backward / 1e9:.0f} GB/s")

    tiny = cupy.ElementwiseKernel("", "float32 y", "y = 1.0f", "boostmpi_calibrate_tiny")
    y = cupy.empty(1, dtype=np.float32)
    tiny(y)
    raw["launch"] = {"launches": LAUNCHES, "seconds": step.gpu_time(lambda: [tiny(y) for _ in range(LAUNCHES)], 3, 1)}
    flush_print(f"  launch {raw['launch']['seconds'] / LAUNCHES * 1e6:.2f} us per kernel")
    cupy.get_default_memory_pool().free_all_blocks()

    attention = load_bench("attention")

    def on_row(row):
        what = row["error"] or f"fwd {row['fwd_tflops']:.0f} / bwd {row['bwd_tflops']:.0f} TFLOP/s"
        flush_print(f"  attention {row['backend']} {row['B']}x{row['T']} H{row['H']} Dh{row['Dh']}: {what}")

    raw["attention"] = attention.run(list(ATTENTION_BACKENDS), attention_shapes(attention), repeats, on_row=on_row,
                                     budget_s=ATTENTION_BUDGET_S)
    return raw


def paper_attention_shapes(attention):
    return attention.shapes_for(["paper"])


# ------------------------------------------------------------------ the arithmetic (tested with --timings)
def gemm_residuals(machine, gemms):
    """[(label, m, n, k, batch, measured FLOP/s, log(model seconds / measured seconds))]."""
    from boostmpi.sim.costs import gemm_seconds

    out = []
    for m, n, k, batch, seconds, label in gemms:
        model = gemm_seconds(m, n, k, batch, 2, machine, "bfloat16")
        out.append((label, m, n, k, batch, 2.0 * m * n * k * batch / seconds, math.log(model / seconds)))
    return out


def attention_rates(rows, source):
    """{backend: RateTable} in the profile layout (boostmpi/sim/attention_rates.py): per backend (own per
    variant) and head dim, the rates of the largest shape that ran (the causal count; `shape` records it
    so the model carries the rate to other sequence lengths)."""
    from boostmpi.sim.attention_rates import Rate, RateTable

    best = {}
    for row in rows:
        if row.get("error") or row["backend"] == "sdpa":
            continue
        backend, variant = (("own", row["backend"][4:]) if row["backend"].startswith("own-") else (row["backend"], None))
        shape = (row["B"], row["T"], row["H"], row["Hkv"], row["Dh"])
        flops = row["fwd_tflops"] * 1e12 * row["fwd_s"]
        key = (backend, variant, row["Dh"])
        if key not in best or flops > best[key][0]:
            best[key] = (flops, Rate(row["fwd_tflops"] * 1e12, row["bwd_tflops"] * 1e12, shape))
    tables = {}
    for (backend, variant, dh), (_, rate) in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1] or "", kv[0][2])):
        tables.setdefault(backend, {})[(variant, dh)] = rate
    return {backend: RateTable(f"{source}: bench/attention.py's rows", rates) for backend, rates in tables.items()}


def attention_rows(raw, repeats):
    """bench/attention.py's rows for the attention seconds in `raw` (its `run` with a timer that reads
    them): the FLOP count and rates are that file's, whether the seconds were measured now or read back."""
    attention = load_bench("attention")
    recorded = {(r["backend"], r["B"], r["T"], r["H"], r["Hkv"], r["Dh"]): r for r in raw["attention"]}

    def timer(backend, shape, repeats):
        row = recorded.get((backend, *shape))
        if row is None:
            raise LookupError(f"no {backend} timing for shape {shape}")
        if row.get("error"):
            raise RuntimeError(row["error"])
        return float(row["fwd_s"]), float(row["bwd_s"])

    backends = [b for b in ATTENTION_BACKENDS if any(r["backend"] == b for r in raw["attention"])]
    shapes = list(dict.fromkeys(key[1:] for key in recorded))
    return attention.run(backends, shapes, repeats, timer)


def fit_gemm(machine, gemms, rounds=3):
    """`machine` with gemm_k_overhead and gemm_mn_overhead from `fit_gemm_overheads` and
    gemm_efficiency (the measured peak is itself a GEMM with overheads: the fraction of it the model's
    overhead-free rate is) as the geometric mean of the model's time over the measured, alternately."""
    from dataclasses import replace

    from boostmpi.sim.calibrate import fit_gemm_overheads

    measured = [("bfloat16", m, n, k, s, batch) for m, n, k, batch, s, _ in gemms]
    for _ in range(rounds):
        k0, c0 = fit_gemm_overheads(machine, measured)
        machine = replace(machine, gemm_k_overhead=k0, gemm_mn_overhead=c0)
        mean = sum(r[-1] for r in gemm_residuals(machine, gemms)) / len(gemms)
        machine = replace(machine, gemm_efficiency=machine.gemm_efficiency * math.exp(mean))
    if machine.gemm_efficiency > 1:  # the fit's overhead-free rate is above the best measured GEMM: that rate is the peak
        peak = dict(machine.peak_flops, bfloat16=machine.peak_flops["bfloat16"] * machine.gemm_efficiency)
        machine = replace(machine, peak_flops=peak, gemm_efficiency=1.0)
    return machine


def build_profile(raw, base, name, source):
    """(Machine, {field: source}, residuals) from `raw`."""
    from dataclasses import replace

    dev = raw["device"]
    gemm_rates = [2.0 * m * n * k * batch / s for m, n, k, batch, s, _ in raw["gemm"]]
    peak = {dt: 2.0 * size ** 3 / s for dt, (size, s) in raw["peak"].items()}
    peak["bfloat16"] = max([peak.get("bfloat16", 0.0)] + gemm_rates)
    copy = raw["copy"]["bytes"] / raw["copy"]["seconds"]
    fused = raw["fused"]
    efficiency = (fused["rmsnorm_forward"] + fused["rmsnorm_backward"]) / 2 / fused["copy_same_bytes"]
    stream = copy * efficiency
    rates = attention_rates(attention_rows(raw, 1), source)
    measured = dict(
        name=name, device="gpu", attention="flash",
        vendor="amd" if any(w in dev["name"] for w in ("AMD", "Instinct", "gfx")) else "nvidia",
        description=f"{dev['name']}, measured by bench/gpu_calibrate.py on {dev['host']} ({raw.get('date', '?')})",
        memory_capacity_bytes=float(dev["memory_bytes"]), memory_bandwidth=copy, elementwise_efficiency=efficiency,
        peak_flops=peak, gemm_efficiency=1.0, compute_units=dev["sm_count"],
        attention_rates=rates or base.attention_rates,
        kernel_launch_s=raw["launch"]["seconds"] / raw["launch"]["launches"],
        optimizer_passes=raw["adamw"]["seconds"] * stream / (raw["adamw"]["params"] * 4),
        gpus_per_node=max(dev["gpus"], 1))
    machine = fit_gemm(replace(base, **measured), raw["gemm"])
    sources = {f: source for f in measured if f not in ("name", "device", "attention", "description", "attention_rates")}
    fitted = f"{source}: fitted to {len(raw['gemm'])} GEMM shapes"
    sources.update(gemm_k_overhead=fitted, gemm_mn_overhead=fitted, gemm_efficiency=fitted)
    if not rates:
        sources["attention_rates"] = f"not measured (no attention backend ran): from the {base.name} profile"
    for field in ("gemm_tile_m", "gemm_tile_n", "intra_node_bandwidth", "intra_node_latency", "inter_node_bandwidth",
                  "inter_node_latency", "elementwise", "grad_accumulation_bytes", "zero3_gather_copy_bytes",
                  "zero3_reduce_copy_bytes", "pipeline_p2p"):
        sources[field] = f"not measured (one GPU): from the {base.name} profile"
    return machine, sources, gemm_residuals(machine, raw["gemm"])


def _toml_string(text):
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def profile_text(machine, sources, raw):
    from boostmpi.sim.machines import machine_to_toml

    dev = raw["device"]
    header = [f"# {dev['name']}: measured by bench/gpu_calibrate.py on {dev['host']}, {raw.get('date', '?')}",
              f"# driver {dev['driver']}, CUDA runtime {dev['runtime']}, CuPy {dev['cupy']}, cuDNN {dev['cudnn']}, "
              f"PyTorch {dev['torch']}; {len(raw['gemm'])} GEMM shapes; raw measurements: {raw.get('raw_path', '?')}"]
    lines = ["", "[sources]"] + [f"{key} = {_toml_string(text)}" for key, text in sorted(sources.items())]
    return "\n".join(header) + "\n" + machine_to_toml(machine) + "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="profile TOML to write (the raw measurements go beside it, .json)")
    ap.add_argument("--timings", help="a raw JSON of an earlier run: no GPU, the arithmetic only")
    ap.add_argument("--base", help="profile for what one GPU cannot measure (default: the device's, else h100-sxm)")
    ap.add_argument("--name", help="profile name (default: from the device name)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from boostmpi.errors import UserError
    from boostmpi.sim.machines import load_machine, machine_from_file, profile_for_device

    out = Path(args.out)
    if not out.parent.is_dir():
        return refuse(f"the directory of --out {out} does not exist")
    if args.repeats < 1:
        return refuse(f"--repeats must be at least 1, got {args.repeats}")
    if args.timings:
        try:
            raw = json.loads(Path(args.timings).read_text())
            raw["device"]["name"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return refuse(f"--timings {args.timings}: not a raw measurement file ({exc})")
        raw_path = None
        raw["raw_path"] = args.timings  # the sources cite the measurements the profile is made from
    else:
        why = no_gpu_reason()
        if why:
            return refuse(f"bench/gpu_calibrate.py measures a GPU and {why}; nothing written")
        started = time.perf_counter()
        raw = measure(args.repeats, paper_attention_shapes)
        raw["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        raw["seconds"] = time.perf_counter() - started
        raw_path = out.with_suffix(".json")
        raw["raw_path"] = str(raw_path)
    dev = raw["device"]
    try:
        base = load_machine(args.base or profile_for_device(dev["name"], dev["memory_bytes"]) or "h100-sxm")
    except UserError as exc:
        return refuse(str(exc))
    name = args.name or "-".join(dev["name"].lower().replace("nvidia", "").split()) + "-measured"
    source = f"measured by bench/gpu_calibrate.py on {dev['name']} {raw.get('date', '?')} ({raw.get('raw_path', '?')})"
    try:
        machine, sources, residuals = build_profile(raw, base, name, source)
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        return refuse(f"cannot make a profile from these measurements: {exc}")
    flush_print(f"GEMM fit: k0 = {machine.gemm_k_overhead:g}, c0 = {machine.gemm_mn_overhead:g}, bf16 peak "
                f"{machine.peak_flops['bfloat16'] / 1e12:.0f} TFLOP/s; residual log(model / measured) per shape:")
    for label, m, n, k, batch, rate, res in residuals:
        flush_print(f"  {label:<34} {m:>6} x {n:>6} x {k:>6}{f' x{batch}' if batch > 1 else '':<4} "
                    f"{rate / 1e12:7.0f} TFLOP/s  residual {res:+.3f}")
    rms = math.sqrt(sum(r[-1] ** 2 for r in residuals) / max(len(residuals), 1))
    flush_print(f"  rms residual {rms:.3f} over {len(residuals)} shapes")
    raw["residuals"] = [list(r) for r in residuals]
    from boostmpi.files import write_file_atomically

    if raw_path is not None:
        write_file_atomically(raw_path, json.dumps(raw, indent=1))
    write_file_atomically(out, profile_text(machine, sources, raw))
    machine_from_file(out)  # what was written reads back
    flush_print(f"wrote {out}" + (f" and {raw_path}" if raw_path else ""))
    return 0


def refuse(message):
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
