"""A real training step on one GPU, phase by phase, beside `boostmpi sim` and the GPU-step trace.

    python bench/gpu_vs_model.py [--profile h200] [--layers 2] [--batch 1] [--seq 4096] [--steps 3]
        [--json FILE] [--timings FILE]

The configuration: the paper's 7B width (d 4096, 32 heads, d_ff 11008, rank 1024, vocabulary
32000), cola, bf16, T --seq, micro-batch --batch, --layers layers, one GPU (tp 1), the trainer's
defaults otherwise. One step is `Engine.forward_backward` then the trainer's `optimizer_step`
(gradient norm, clipping at 1.0, AdamW), as `boostmpi train` runs it.

Measured (CUDA events on the current stream around each call, the outermost call only; one
untimed step, then the median over --steps of each phase's summed time):
  attention  the attention backend's forward and backward (`boostmpi.gpu.attention.current()`'s,
             where that seam exists; else the own kernels' `attention_forward` / `_backward`);
  gemm       every GEMM (`boostmpi.gpu.blas.matmul`);
  fused      every other fused kernel of `boostmpi.gpu.kernels` (RMSNorm, SiLU/gate, RoPE,
             cross-entropy, btp's kernels) outside the optimizer;
  optimizer  `optimizer_step` (norm, clipping, AdamW);
  other      the step's time outside these (CuPy's own elementwise, reductions, copies, gathers);
  step       the whole step (events around it).
The wrappers are set on the module attributes the engine calls through, by this script only:
nothing in the product changes.

Beside it: `boostmpi.sim.model.predict` for the same configuration on --profile (its breakdown's
"attention" where the profile prices attention apart, else attention is inside "elementwise"),
and bench/gpu_trace.py's pricing of the same step traced on the CuPy stand-in in shapes-only mode
(a child process: the stand-in and the real CuPy cannot share one). Printed: each phase's
measured ms, model ms and model / measured.

`--timings FILE` reads the measured phases ({"phases": {name: seconds}, "device": ...}, what --json
writes) instead of a GPU, so the comparison's arithmetic runs anywhere. Without a GPU and without
--timings it says so in one line and exits 2.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PHASES = ("attention", "gemm", "fused", "optimizer", "other", "step")
MODEL = dict(arch="cola", vocab_size=32000, d_model=4096, n_heads=32, d_ff=11008, rank=1024)


def flush_print(*args):
    print(*args, flush=True)


def config(layers, batch, seq):
    from boostmpi.config import config_from_dict

    return config_from_dict({"model": dict(MODEL, n_layers=layers, seq_len=seq),
                             "train": {"device": "gpu", "dtype": "bfloat16", "micro_batch_size": batch}})


# ------------------------------------------------------------------ the GPU
class PhaseTimer:
    """Event pairs around the outermost wrapped call, by phase."""

    def __init__(self, cupy, elapsed=None):
        self.cupy, self.depth, self.events, self.on, self.wrapped = cupy, 0, [], False, []
        # seconds between two recorded events (a test's stand-in has no device clock)
        self.elapsed = elapsed or (lambda start, stop: cupy.cuda.get_elapsed_time(start, stop) / 1e3)

    def wrap(self, owner, attr, phase):
        original = getattr(owner, attr)
        timer = self
        self.wrapped.append((owner, attr, original))

        def wrapper(*args, **kwargs):
            if not timer.on or timer.depth:
                return original(*args, **kwargs)
            start, stop = timer.cupy.cuda.Event(), timer.cupy.cuda.Event()
            timer.depth += 1
            start.record()
            try:
                return original(*args, **kwargs)
            finally:
                stop.record()
                timer.depth -= 1
                timer.events.append((phase, start, stop))

        wrapper.__wrapped__ = original
        setattr(owner, attr, wrapper)

    def restore(self):
        while self.wrapped:
            owner, attr, original = self.wrapped.pop()
            setattr(owner, attr, original)

    def collect(self):
        self.cupy.cuda.Device().synchronize()
        out = dict.fromkeys(PHASES[:-2], 0.0)
        self.calls = dict.fromkeys(PHASES[:-2], 0)
        for phase, start, stop in self.events:
            out[phase] += self.elapsed(start, stop)
            self.calls[phase] += 1
        self.events = []
        return out


def install(timer):
    """Wrap the functions the engine's GPU step calls through (module attributes, looked up per call)."""
    import types

    from boostmpi.gpu import blas, kernels
    from boostmpi.train import trainer

    timer.wrap(blas, "matmul", "gemm")
    for name in ("attention_forward", "attention_backward"):
        timer.wrap(kernels, name, "attention")
    try:
        from boostmpi.gpu import attention
    except ImportError:
        attention = None
    if attention is not None and hasattr(attention, "current"):
        current = attention.current

        def timed_current():
            backend = current()
            proxy = types.SimpleNamespace(**{k: getattr(backend, k) for k in ("name", "deterministic")
                                             if hasattr(backend, k)})
            proxy.forward, proxy.backward = backend.forward, backend.backward
            timer.wrap(proxy, "forward", "attention")
            timer.wrap(proxy, "backward", "attention")
            return proxy

        timer.wrapped.append((attention, "current", current))
        attention.current = timed_current
    skip = {"attention_forward", "attention_backward", "adamw_step", "sum_squares_ranges"}
    for name, fn in list(vars(kernels).items()):
        if (isinstance(fn, types.FunctionType) and fn.__module__ == kernels.__name__ and not name.startswith("_")
                and name not in skip and ("forward" in name or "backward" in name or name.startswith(
                    ("rmsnorm", "residual", "rescale", "btp_", "silu", "gate", "softmax_xent", "rope")))):
            timer.wrap(kernels, name, "fused")
    timer.wrap(trainer, "optimizer_step", "optimizer")
    return trainer


def measure(cfg, steps, elapsed=None):
    """({phase: median seconds}, {phase: calls per step}, the engine after the steps)."""
    import cupy

    timer = PhaseTimer(cupy, elapsed)
    trainer = install(timer)
    try:
        return _steps(cfg, steps, timer, trainer, cupy)
    finally:
        timer.restore()


def _steps(cfg, steps, timer, trainer, cupy):
    import numpy as np

    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW

    eng = Engine(cfg)
    opt = AdamW(eng.params, eng.specs, cfg.train, eng.xp)
    rng = np.random.default_rng(0)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
    batch = [(rng.integers(0, cfg.model.vocab_size, shape), rng.integers(0, cfg.model.vocab_size, shape))]
    runs = []
    for step in range(steps + 1):
        timer.on = step > 0
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        eng.forward_backward(batch)
        trainer.optimizer_step(eng, opt, 1e-4, 1.0)
        stop.record()
        phases = timer.collect()
        phases["step"] = timer.elapsed(start, stop)
        phases["other"] = phases["step"] - sum(phases[p] for p in PHASES[:-2])
        if step > 0:
            runs.append(phases)
        flush_print(f"  step {step}{' (warm-up)' if step == 0 else ''}: {phases['step'] * 1e3:.1f} ms")
    return {p: statistics.median(r[p] for r in runs) for p in PHASES}, timer.calls, eng


def calibrate_module():
    """bench/gpu_calibrate.py (bench is not a package): its GPU check, loader and one-line refusal."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_calibrate", REPO / "bench" / "gpu_calibrate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ the models
_TRACE_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import gpu_trace
from boostmpi.config import config_from_dict
from boostmpi.sim.machines import load_machine
cfg = config_from_dict(json.loads(sys.argv[2]))
rec = gpu_trace.Recorder()
gpu_trace.install(rec, run_kernels=True)
gpu_trace._meta_init()
ops = gpu_trace.run_steps(rec, cfg, None, steps=2)["ops"]
kernels = {}
for op in ops:
    if op.kind == "kernel":
        kernels.setdefault(op.name, []).append(op.nbytes)
print(json.dumps({"priced": gpu_trace.price(ops, load_machine(sys.argv[3]), 1), "kernels": kernels}))
"""


def trace(cfg, profile_path):
    """bench/gpu_trace.py's record of this step (stand-in, shapes-only), from a child: {"priced": its
    breakdown on the profile, "kernels": {fused kernel: [bytes read + written of each launch]}}."""
    env = dict(os.environ, BOOSTMPI_CUPY_STANDIN="1", BOOSTMPI_STANDIN_META="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-c", _TRACE_CHILD, str(REPO / "bench"), json.dumps(cfg.to_dict()),
                           str(profile_path)], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the trace child failed (exit {done.returncode}): {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def comparison(measured, breakdown, traced):
    """[{"phase", "measured", "sim", "sim_ratio", "trace", "trace_ratio"}] (seconds; ratio = model /
    measured). A model's "elementwise" is the fused kernels plus CuPy's own operations and copies:
    it is compared with the measured fused + other, and where that model has no "attention" entry
    (its attention is inside "elementwise") with the measured attention added, its attention row
    then "inside"."""
    models = {"sim": breakdown, "trace": traced}
    keys = ("gemm", "elementwise", "attention", "optimizer", "tp_comm", "pp_p2p", "pp_bubble_and_p2p", "dp_comm")
    rows = []
    for phase, key in (("attention", "attention"), ("gemm", "gemm"), ("fused", "elementwise"),
                       ("optimizer", "optimizer"), ("step", None)):
        base = measured[phase] + (measured["other"] if phase == "fused" else 0.0)
        row = {"phase": phase, "measured": base}
        for name, model in models.items():
            split = "attention" in model
            if phase == "step":
                seconds, denominator = sum(model.get(k, 0.0) for k in keys), base
            elif phase == "attention" and not split:
                seconds, denominator = "inside", None
            else:
                seconds = model.get(key)
                denominator = base + (measured["attention"] if phase == "fused" and not split else 0.0)
            row[name] = seconds
            row[f"{name}_ratio"] = seconds / denominator if isinstance(seconds, float) and denominator else None
            row[f"{name}_with_attention"] = phase == "fused" and not split
        rows.append(row)
    return rows


def table(rows):
    lines = ["| phase | measured ms | sim ms | sim / measured | trace ms | trace / measured |",
             "|---|---|---|---|---|---|"]
    label = {"fused": "fused + other (model: elementwise)"}
    for row in rows:
        cells = []
        for name in ("sim", "trace"):
            value, ratio = row[name], row[f"{name}_ratio"]
            if value == "inside":
                cells += ["(in elementwise)", ""]
            elif value is None:
                cells += ["n/a", ""]
            else:
                note = " (vs measured + attention)" if row[f"{name}_with_attention"] else ""
                cells += [f"{value * 1e3:.2f}", f"{ratio:.2f}{note}"]
        lines.append(f"| {label.get(row['phase'], row['phase'])} | {row['measured'] * 1e3:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h200", help="machine profile: a built-in name or a .toml (default h200)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="write the measured phases and both models' figures here")
    ap.add_argument("--timings", help="measured phases from an earlier --json: no GPU")
    args = ap.parse_args(argv)
    refuse = calibrate_module().refuse
    from boostmpi.errors import UserError
    from boostmpi.sim.machines import ALIASES, builtin_names, load_machine
    from boostmpi.sim.model import predict

    for name in ("layers", "batch", "seq", "steps"):
        if getattr(args, name) < 1:
            return refuse(f"--{name} must be at least 1, got {getattr(args, name)}")
    device = None
    if args.timings:
        try:
            recorded = json.loads(Path(args.timings).read_text())
            measured = {p: float(recorded["phases"][p]) for p in PHASES}
            device = recorded.get("device")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return refuse(f"--timings {args.timings}: not a phase timing file ({exc})")
    else:
        why = calibrate_module().no_gpu_reason()
        if why:
            return refuse(f"bench/gpu_vs_model.py times a step on a GPU and {why}")
    profile = args.profile
    if profile.lower() not in builtin_names() and profile.lower() not in ALIASES and not Path(profile).exists():
        if profile != "h200":
            return refuse(f"unknown machine profile {profile!r}")
        flush_print("no built-in h200 profile here: pricing with h100-sxm")
        profile = "h100-sxm"
    try:
        machine = load_machine(profile)
        cfg = config(args.layers, args.batch, args.seq)
    except UserError as exc:
        return refuse(str(exc))
    profile_path = Path(profile) if Path(profile).exists() else Path(
        __import__("boostmpi.sim.machines", fromlist=["PROFILE_DIR"]).PROFILE_DIR) / f"{machine.name}.toml"
    flush_print(f"7B width, {args.layers} layers, micro-batch {args.batch}, T {args.seq}, cola, bf16, one GPU; "
                f"priced on {machine.name}")
    if not args.timings:
        import cupy

        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        flush_print(f"device: {device}")
        measured, calls, _ = measure(cfg, args.steps)
        flush_print("calls per step: " + ", ".join(f"{p} {n}" for p, n in calls.items()))
    breakdown = dict(predict(cfg, machine).breakdown)
    flush_print("tracing the same step on the CuPy stand-in (shapes only)...")
    traced = trace(cfg, profile_path)["priced"]
    rows = comparison(measured, breakdown, traced)
    flush_print(table(rows))
    if args.json:
        from boostmpi.files import write_file_atomically

        write_file_atomically(Path(args.json), json.dumps(
            {"device": device, "profile": machine.name, "config": cfg.to_dict(), "phases": measured,
             "sim": breakdown, "trace": traced, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
