"""Attention forward and backward of each backend side by side on one GPU, against PyTorch's SDPA.

    python bench/attention.py [--backends cudnn,torch,own-wmma,own-fma,sdpa] [--shapes table,paper]
        [--repeats 5] [--warmup 2] [--budget-s SECONDS] [--json FILE] [--markdown FILE] [--timings FILE]

Backends: `cudnn`, `torch` and `own` are `boostmpi.gpu.attention.make(name)` (the engine's attention
backends, deterministic); `cudnn-nd` / `torch-nd` are `make(name, deterministic=False)` (what
`train.deterministic = false` runs: each library's faster backward, whose summation order may change
run to run); `own-wmma` / `own-fma` are the own kernels with BOOSTMPI_ATTENTION_TENSOR_CORES=1 / 0 set
around every call (`boostmpi.gpu.tensor_cores.use_wmma` reads it per call); `sdpa` is PyTorch's
`scaled_dot_product_attention` called directly in this process on zero-copy DLPack views of the same
CuPy arrays, inside `sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION])` (never the
math kernel) with `enable_gqa=True` and its autograd graph for the backward: the reference every
backend is compared to. bfloat16, causal, softmax scale 1/sqrt(Dh), q [B,T,H,Dh], k and v
[B,T,Hkv,Dh] (GQA without repeated K/V).

Shapes (B, T, H, Hkv, Dh): "table" = the five shapes measured on the first H200 run
(bench/log/attention.md); "paper" = the paper's models on one GPU at their tensor-parallel size,
heads split by tp (B 4, T 4096, Dh = d / heads, Hkv = H): 1B (d 2048, 32 heads, tp 1), 3B (3072, 24,
tp 2), 7B (4096, 32, tp 4), 13B (5120, 40, tp 4).

Timing: CUDA events on the current stream around each call (bench/gpu_step.py's `gpu_time` style),
`--warmup` untimed calls, then the median of `--repeats` timed ones. The backward is timed alone: each
timed backward gets a fresh forward context made before its start event (a PyTorch context holds an
autograd graph that one backward consumes). Before timing, each backend's first forward and backward
are compared with SDPA's (`rel_err_vs_sdpa`: the largest over o, dq, dk, dv of |x - ref| / |ref|,
Frobenius norms, in float32), and their wall time is `first_call_s` (kernel compilation, graph building
and planning included).

FLOPs, the convention of `boostmpi sim`'s time model (boostmpi/sim/costs.py `flash_seconds`):
forward = 2 matmuls (QK^T, PV) x 2·B·H·T²·Dh / 2 (the causal lower triangle, the diagonal and tile
padding not counted) = 2·B·H·T²·Dh; backward = 2.5 x forward (FlashAttention-2's five T x T
products to the forward's two, the recomputed QK^T included). The kernel rates (`fwd_tflops`,
`bwd_tflops`) use this causal count. `boostmpi sim`'s *model* FLOPs (MFU, `sim.model.
model_flops_per_step`: PaLM's 12·L·d·T per token) count the full T x T square instead, with the
backward 2x the forward: per call that is 2x this forward count, and 1.6x this backward count.

Ratios `vs_sdpa_fwd` / `vs_sdpa_bwd` = this backend's seconds / SDPA's seconds on the same shape in the
same process (1.0 = as fast; the target for cudnn and torch is <= 1.1); None where SDPA did not run.

A backend that cannot run a shape (package missing, shape unsupported, out of memory, any exception)
gives a row with `error` (one line) and the run goes on; memory is freed between shapes. `--budget-s`
bounds the whole run: what is left when it is spent gives rows with `error` "skipped: ...". Every row
is printed as it completes, and `--json` / `--markdown` are rewritten after each row.

`--timings FILE` runs nothing: it reads seconds per (backend, shape) from FILE (a `--json` output, or a
list of rows with backend, B, T, H, Hkv, Dh, fwd_s, bwd_s and optionally error) and does the same
arithmetic. Importable (bench is not a package): load this file with importlib and call
`run(backends, shapes, repeats, timer)`; `timer(backend, shape, repeats)` returns (fwd_s, bwd_s) or a
dict with fwd_s, bwd_s and optionally rel_err_vs_sdpa, or raises for an error row.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BACKENDS = ("cudnn", "torch", "own-wmma", "own-fma", "sdpa")  # the default list
# "own": the own kernels as the environment chooses them; "cudnn-nd" / "torch-nd": the library backends
# made with deterministic=False (train.deterministic = false: their faster, run-to-run varying backward)
NONDETERMINISTIC = {"cudnn-nd": "cudnn", "torch-nd": "torch"}
KNOWN = BACKENDS + ("own",) + tuple(NONDETERMINISTIC)
REFERENCE = "sdpa"
TENSOR_CORES_ENV = "BOOSTMPI_ATTENTION_TENSOR_CORES"
OWN_VARIANTS = {"own-wmma": "1", "own-fma": "0"}  # the own kernels, by the environment variable's value

# (label, (B, T, H, Hkv, Dh))
TABLE = [("7B on one GPU", (4, 4096, 32, 32, 128)), ("GQA", (4, 4096, 32, 8, 128)), ("GQA, Dh 64", (4, 4096, 32, 8, 64)),
         ("13B-style", (4, 2048, 40, 40, 128)), ("bench/gpu_step.py", (8, 1024, 16, 16, 64))]
# the paper's models: (name, d_model, heads, tensor-parallel size); B 4, T 4096 on one GPU
PAPER_MODELS = (("1B", 2048, 32, 1), ("3B", 3072, 24, 2), ("7B", 4096, 32, 4), ("13B", 5120, 40, 4))
BATCH, SEQ = 4, 4096


def paper_shapes():
    out = []
    for name, d, heads, tp in PAPER_MODELS:
        H = heads // tp
        out.append((f"{name} at tp {tp}", (BATCH, SEQ, H, H, d // heads)))
    return out


SHAPES = {"table": TABLE, "paper": paper_shapes()}


def shapes_for(names):
    """[(label, (B, T, H, Hkv, Dh))] of the named lists, in order, each shape once."""
    out, seen = [], set()
    for name in names:
        if name not in SHAPES:
            raise ValueError(f"unknown shape list {name!r} (known: {', '.join(SHAPES)})")
        for label, shape in SHAPES[name]:
            if shape not in seen:
                seen.add(shape)
                out.append((label, shape))
    return out


def causal_flops(B, T, H, Dh):
    """(forward, backward) FLOPs of one causal attention call, `boostmpi sim`'s count (module docstring)."""
    forward = 2 * (2.0 * B * H * T * T * Dh) / 2
    return forward, 2.5 * forward


def _shape_key(backend, shape):
    return f"{backend} {','.join(str(n) for n in shape)}"


class RecordedError(RuntimeError):
    """An error row read back from a timings file: its text as recorded."""


def _one_line(exc):
    if isinstance(exc, RecordedError):
        return str(exc)
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}".strip().rstrip(":")
    return line[:300]


def make_row(backend, label, shape, fwd_s, bwd_s, reference=None, error=None, extra=None):
    """One result row; `reference` = SDPA's (fwd_s, bwd_s) on this shape, or None."""
    B, T, H, Hkv, Dh = shape
    row = {"backend": backend, "label": label, "B": B, "T": T, "H": H, "Hkv": Hkv, "Dh": Dh, "dtype": "bfloat16",
           "causal": True, "fwd_s": None, "bwd_s": None, "fwd_tflops": None, "bwd_tflops": None,
           "vs_sdpa_fwd": None, "vs_sdpa_bwd": None, "rel_err_vs_sdpa": None, "first_call_s": None, "error": error}
    if error is not None:
        return row
    fwd_flops, bwd_flops = causal_flops(B, T, H, Dh)
    row.update(fwd_s=fwd_s, bwd_s=bwd_s, fwd_tflops=fwd_flops / fwd_s / 1e12, bwd_tflops=bwd_flops / bwd_s / 1e12)
    if reference is not None:
        row.update(vs_sdpa_fwd=fwd_s / reference[0], vs_sdpa_bwd=bwd_s / reference[1])
    row.update(extra or {})
    return row


def run(backends, shapes, repeats, timer=None, warmup=2, budget_s=None, on_row=None, clock=time.monotonic):
    """Rows (see the module docstring) of every backend on every shape, shape by shape; SDPA first on
    each shape when asked for, so every row's ratio is known when the row is made. `shapes`: (B, T, H,
    Hkv, Dh) tuples or (label, tuple) pairs. `on_row(row)` is called as each row completes."""
    unknown = [b for b in backends if b not in KNOWN]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)} (known: {', '.join(KNOWN)})")
    order = [b for b in backends if b == REFERENCE] + [b for b in backends if b != REFERENCE]
    if timer is None:
        timer = GpuTimer(warmup)
    start = clock()
    rows = []

    def emit(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)

    for item in shapes:
        label, shape = (None, tuple(item)) if len(item) == 5 else (item[0], tuple(item[1]))
        reference = None
        for backend in order:
            if budget_s is not None and clock() - start >= budget_s:
                emit(make_row(backend, label, shape, None, None,
                              error=f"skipped: the --budget-s {budget_s:g} s budget was spent"))
                continue
            try:
                measured = timer(backend, shape, repeats)
                if isinstance(measured, dict):
                    fwd_s, bwd_s = measured["fwd_s"], measured["bwd_s"]
                    extra = {k: v for k, v in measured.items() if k not in ("fwd_s", "bwd_s")}
                else:
                    (fwd_s, bwd_s), extra = measured, None
                if not (fwd_s > 0 and bwd_s > 0):
                    raise ValueError(f"timer gave non-positive seconds {fwd_s!r} / {bwd_s!r}")
            except Exception as exc:  # noqa: BLE001 - any failure is this backend's row, the run goes on
                emit(make_row(backend, label, shape, None, None, error=_one_line(exc)))
                continue
            if backend == REFERENCE:
                reference = (fwd_s, bwd_s)
            emit(make_row(backend, label, shape, fwd_s, bwd_s, reference, extra=extra))
        release = getattr(timer, "release", None)
        if release is not None:
            release()
    return rows


# ---------------------------------------------------------------- injected timings
class FileTimer:
    """Seconds read from a JSON file instead of a GPU: a `--json` output ({"rows": [...]}) or a list of
    rows; a row with `error` set raises that error (an error row again)."""

    def __init__(self, path):
        data = json.loads(Path(path).read_text())
        rows = data["rows"] if isinstance(data, dict) else data
        self.path, self.rows = path, {}
        for row in rows:
            self.rows[_shape_key(row["backend"], (row["B"], row["T"], row["H"], row["Hkv"], row["Dh"]))] = row

    def __call__(self, backend, shape, repeats):
        row = self.rows.get(_shape_key(backend, shape))
        if row is None:
            raise LookupError(f"no timing for {_shape_key(backend, shape)} in {self.path}")
        if row.get("error"):
            raise RecordedError(row["error"])
        out = {"fwd_s": float(row["fwd_s"]), "bwd_s": float(row["bwd_s"])}
        for key in ("rel_err_vs_sdpa", "first_call_s"):
            if row.get(key) is not None:
                out[key] = row[key]
        return out


# ---------------------------------------------------------------- the GPU
@contextmanager
def _environment(name, value):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is None:
            pass
        elif old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


QUEUED = {"on": False}  # --queued: set by main


def cuda_time(run, repeats, warmup, setup=None):
    """Median seconds of `run(setup())` between two CUDA events on the current stream; `setup` (untimed)
    is issued before the start event. Each call is waited for before the next is issued (its latency,
    the host's time to issue it included), unless --queued: then the calls are issued back to back and
    waited for once at the end, so that the host's time hides behind the device's wherever the device
    is the slower of the two (the way a training step issues them)."""
    import cupy

    for _ in range(warmup):
        run(setup() if setup else None)
    cupy.cuda.get_current_stream().synchronize()
    pairs, kept = [], []
    for _ in range(repeats):
        arg = setup() if setup else None
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        kept.append(run(arg))
        stop.record()
        pairs.append((start, stop))
        if not QUEUED["on"]:
            stop.synchronize()
            kept.clear()
        del arg
    pairs[-1][1].synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(start, stop) / 1e3 for start, stop in pairs)


def _torch_view(torch, x):
    """A zero-copy torch tensor over the CuPy bfloat16 array `x` (DLPack has no NumPy-side bfloat16:
    it crosses as int16 and is viewed back)."""
    return torch.from_dlpack(x.view("int16")).view(torch.bfloat16)


class GpuTimer:
    """Times one backend on one shape on this process's GPU; the inputs (and SDPA's outputs, the
    reference) are made once per shape and dropped by `release()`."""

    def __init__(self, warmup=2):
        self.warmup = warmup
        self.shape = None
        self.inputs = None
        self.reference = None
        self.made = {}  # backend name -> backend object, or the exception make() raised

    def _inputs(self, shape):
        import cupy
        import ml_dtypes

        if self.shape != shape:
            self.release()
            B, T, H, Hkv, Dh = shape
            cupy.random.seed(0)

            def draw(heads):
                return cupy.random.standard_normal((B, T, heads, Dh), dtype=cupy.float32).astype(ml_dtypes.bfloat16)

            self.inputs = (draw(H), draw(Hkv), draw(Hkv), draw(H))  # q, k, v, do
            self.shape = shape
        return self.inputs

    def release(self):
        self.inputs = self.reference = self.shape = None
        gc.collect()
        try:
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            cupy.get_default_memory_pool().free_all_blocks()
            from boostmpi.gpu.pools import kept_pool

            kept_pool().free_all_blocks()
        except Exception:  # noqa: BLE001 - freeing is best effort; the next shape reports its own errors
            pass
        if "torch" in sys.modules:
            try:
                sys.modules["torch"].cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    def __call__(self, backend, shape, repeats):
        q, k, v, do = self._inputs(shape)
        if backend == REFERENCE:
            return self._sdpa(q, k, v, do, repeats)
        with _environment(TENSOR_CORES_ENV, OWN_VARIANTS.get(backend)):
            return self._backend(backend, q, k, v, do, repeats)

    def _make(self, backend):
        name = "own" if backend in OWN_VARIANTS else backend
        if name not in self.made:
            try:
                from boostmpi.gpu import attention

                self.made[name] = attention.make(NONDETERMINISTIC.get(name, name),
                                                 deterministic=name not in NONDETERMINISTIC)
            except Exception as exc:  # noqa: BLE001 - remembered: every shape's row says it
                self.made[name] = exc
        made = self.made[name]
        if isinstance(made, Exception):
            raise made
        return made

    def _backend(self, backend, q, k, v, do, repeats):
        import cupy

        be = self._make(backend)
        began = time.perf_counter()
        o, ctx = be.forward(q, k, v)
        grads = be.backward(do, ctx)
        cupy.cuda.get_current_stream().synchronize()
        first = time.perf_counter() - began  # compiling kernels, building and planning graphs included
        err = self._error((o, *grads))
        del o, ctx, grads
        fwd = cuda_time(lambda _: be.forward(q, k, v), repeats, self.warmup)
        bwd = cuda_time(lambda ctx: be.backward(do, ctx), repeats, self.warmup, setup=lambda: be.forward(q, k, v)[1])
        return {"fwd_s": fwd, "bwd_s": bwd, "rel_err_vs_sdpa": err, "first_call_s": first}

    def _error(self, outputs):
        """The largest relative error of (o, dq, dk, dv) against SDPA's, or None without SDPA."""
        if self.reference is None:
            return None
        import torch

        worst = 0.0
        for x, ref in zip(outputs, self.reference):
            diff = _torch_view(torch, x).float() - ref.float()
            worst = max(worst, float(diff.norm() / ref.float().norm().clamp_min(1e-30)))
        return worst

    def _sdpa(self, q, k, v, do, repeats):
        import cupy
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stream = cupy.cuda.get_current_stream().ptr
        on_stream = torch.cuda.stream(torch.cuda.ExternalStream(stream)) if stream else nullcontext()
        leaves = [_torch_view(torch, x).requires_grad_(True) for x in (q, k, v)]
        heads_first = [x.transpose(1, 2) for x in leaves]  # [B, H, T, Dh] views over [B, T, H, Dh] memory
        grad_out = _torch_view(torch, do).transpose(1, 2)
        allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

        def forward(_=None):
            return F.scaled_dot_product_attention(*heads_first, is_causal=True, enable_gqa=True)

        def backward(o):
            return torch.autograd.grad(o, leaves, grad_out)

        with on_stream, sdpa_kernel(allowed):
            began = time.perf_counter()
            o = forward()
            grads = backward(o)
            torch.cuda.synchronize()
            first = time.perf_counter() - began
            self.reference = (o.detach().transpose(1, 2), *grads)
            del o, grads
            fwd = cuda_time(forward, repeats, self.warmup)
            bwd = cuda_time(backward, repeats, self.warmup, setup=forward)
        return {"fwd_s": fwd, "bwd_s": bwd, "rel_err_vs_sdpa": 0.0, "first_call_s": first}


# ---------------------------------------------------------------- what was run, on what
def _distribution_version(name):
    try:
        from importlib import metadata

        return metadata.version(name)
    except Exception:  # noqa: BLE001 - not installed (or installed without metadata)
        return None


def header(timings_file=None):
    """Device, driver, CUDA runtime, cuDNN, frontend, PyTorch and CuPy versions, date, command.

    The cuDNN frontend is never imported here (a backend loads it after preloading libcudnn): its
    version comes from package metadata, and cuDNN's from the frontend's `backend_version()` once a
    backend has imported it (`main` asks again at the end), else from `torch.backends.cudnn.version()`."""
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": platform.node(), "python": platform.python_version(),
            "command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv])}
    if timings_file is not None:
        info["timings"] = f"read from {timings_file}; nothing was run"
        return info
    try:
        import cupy

        info["cupy"] = cupy.__version__
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        info["device"] = f"{props['name'].decode()} (compute capability {props['major']}.{props['minor']})"
        info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_driver_api"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as exc:  # noqa: BLE001
        info["device"] = f"unavailable ({_one_line(exc)})"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except Exception:  # noqa: BLE001
        info["driver"] = None
    try:
        import torch

        info["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip})"
        info["cudnn"] = f"{torch.backends.cudnn.version()} (torch.backends.cudnn.version)"
    except Exception as exc:  # noqa: BLE001
        info["torch"] = info["cudnn"] = f"unavailable ({_one_line(exc)})"
    frontend = sys.modules.get("cudnn")
    info["cudnn_frontend"] = _distribution_version("nvidia-cudnn-frontend") or (
        getattr(frontend, "__version__", None) if frontend else None) or "not installed"
    if frontend is not None:
        try:
            info["cudnn"] = f"{frontend.backend_version()} (the frontend's backend_version)"
        except Exception:  # noqa: BLE001 - keep PyTorch's figure
            pass
    return info


# ---------------------------------------------------------------- output
def _cell(value, fmt):
    return "—" if value is None else format(value, fmt)


def markdown(info, rows, repeats, warmup):
    lines = [f"## attention: forward and backward per backend ({info['date']})", ""]
    lines += [f"- {key}: {value}" for key, value in info.items() if key != "date"]
    lines += [f"- timing: CUDA events, median of {repeats} after {warmup} warm-up calls"
              f"{' issued back to back (--queued)' if QUEUED['on'] else ', each waited for'}; bf16, causal; "
              "TFLOP/s by the causal count (forward 2·B·H·T²·Dh, backward 2.5x); x SDPA = seconds / "
              "SDPA's seconds in the same process", "",
              "| B, T, H, Hkv, Dh | backend | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd x SDPA | "
              "bwd x SDPA | rel. error vs SDPA | first call s | error |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['B']}, {r['T']}, {r['H']}, {r['Hkv']}, {r['Dh']}" + (f" ({r['label']})" if r.get("label") else "")
        ms = [None if r[key] is None else 1e3 * r[key] for key in ("fwd_s", "bwd_s")]
        lines.append(f"| {shape} | {r['backend']} | {_cell(ms[0], '.3f')} | {_cell(ms[1], '.3f')} | "
                     f"{_cell(r['fwd_tflops'], '.1f')} | {_cell(r['bwd_tflops'], '.1f')} | "
                     f"{_cell(r['vs_sdpa_fwd'], '.2f')} | {_cell(r['vs_sdpa_bwd'], '.2f')} | "
                     f"{_cell(r.get('rel_err_vs_sdpa'), '.1e')} | {_cell(r.get('first_call_s'), '.2f')} | "
                     f"{r['error'] or ''} |")
    return "\n".join(lines) + "\n"


def _write(path, text):
    """Replace `path` by `text` in one rename (a run cut short leaves the last complete file)."""
    if path in (None, ""):
        return
    if path == "-":
        print(text, flush=True)
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _print_row(row):
    shape = f"B{row['B']} T{row['T']} H{row['H']} Hkv{row['Hkv']} Dh{row['Dh']}"
    if row["error"]:
        print(f"{shape} {row['backend']:9s} error: {row['error']}", flush=True)
        return
    ratio = "" if row["vs_sdpa_fwd"] is None else f" | x SDPA {row['vs_sdpa_fwd']:.2f} / {row['vs_sdpa_bwd']:.2f}"
    err = "" if row.get("rel_err_vs_sdpa") is None else f" | rel. err {row['rel_err_vs_sdpa']:.1e}"
    print(f"{shape} {row['backend']:9s} fwd {row['fwd_s'] * 1e3:9.3f} ms {row['fwd_tflops']:7.1f} TFLOP/s | "
          f"bwd {row['bwd_s'] * 1e3:9.3f} ms {row['bwd_tflops']:7.1f} TFLOP/s{ratio}{err}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, of: " + ", ".join(KNOWN))
    ap.add_argument("--shapes", default="table,paper", help="comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=5, help="timed calls; the median is reported (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first (default %(default)s)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting new measurements after this many seconds")
    ap.add_argument("--json", metavar="FILE", help="write {header, rows} here, rewritten after each row")
    ap.add_argument("--markdown", metavar="FILE", help="write the result block here ('-': print it), rewritten after each row")
    ap.add_argument("--queued", action="store_true",
                    help="issue the timed calls back to back (the host's time hidden where the device is slower)")
    ap.add_argument("--timings", metavar="FILE", help="read seconds per (backend, shape) from FILE; run nothing")
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in KNOWN]
    if bad or not backends:
        ap.exit(2, f"error: --backends: unknown {', '.join(bad) or '(none given)'} (known: {', '.join(KNOWN)})\n")
    try:
        shapes = shapes_for([s.strip() for s in args.shapes.split(",") if s.strip()])
    except ValueError as exc:
        ap.exit(2, f"error: --shapes: {exc}\n")
    if args.repeats < 1 or args.warmup < 0:
        ap.exit(2, "error: --repeats must be >= 1 and --warmup >= 0\n")
    if args.budget_s is not None and args.budget_s <= 0:
        ap.exit(2, "error: --budget-s must be > 0\n")
    QUEUED["on"] = args.queued
    timer = None
    if args.timings:
        try:
            timer = FileTimer(args.timings)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.exit(2, f"error: --timings {args.timings}: {_one_line(exc)}\n")
    info = header(args.timings)
    print(" | ".join(f"{k}: {v}" for k, v in info.items()), flush=True)
    rows = []

    def on_row(row):
        rows.append(row)
        _print_row(row)
        _write(args.json, json.dumps({"header": info, "rows": rows}, indent=1) + "\n")
        if args.markdown != "-":
            _write(args.markdown, markdown(info, rows, args.repeats, args.warmup))

    run(backends, shapes, args.repeats, timer, warmup=args.warmup, budget_s=args.budget_s, on_row=on_row)
    if args.timings is None:  # again: a backend may have loaded the cuDNN frontend since
        info.update({k: v for k, v in header().items() if k in ("cudnn", "cudnn_frontend")})
    _write(args.json, json.dumps({"header": info, "rows": rows}, indent=1) + "\n")
    _write(args.markdown, markdown(info, rows, args.repeats, args.warmup))
    return rows


if __name__ == "__main__":
    main()
