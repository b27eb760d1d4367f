"""What two allocators in one process cost: the torch attention backend (PyTorch's caching allocator
beside CuPy's pool) against the own kernels (CuPy's pool alone), on one GPU.

    python bench/torch_allocators.py [--shape 4,4096,32,8,128] [--layers 8] [--mlp 4] [--steps 5]
                                     [--append bench/log/torch_allocators.md]

Each case runs in a process of its own (fresh allocators, nothing else on the device) a loop shaped
like a training step at recompute = "none": for each of --layers layers, a CuPy transient of --mlp x
the attention output's bytes (the MLP's activations) is made and freed, q, k, v are made with CuPy
and the attention forward keeps its context; then, layer by layer in reverse, dO is made, the
backward runs and its gradients are freed. Measured per case (median over --steps steps after a
first, cold one; CUDA events around the step):
  - step time, and the first step's (where the allocators get their memory from the driver; a tiny
    forward and backward before it compiled the own kernels and loaded PyTorch's, and both
    allocators gave their memory back);
  - device memory in use by the process at the forward's end, where a step peaks (the driver's
    used bytes, `cudaMemGetInfo`, less those before the case started), and after the step;
  - at that peak: CuPy's pool, bytes in use / held, and PyTorch's caching allocator, bytes
    allocated / reserved (and its maximum reserved over the run);
  - held but unused at the peak: (CuPy held - in use) + (PyTorch reserved - allocated), memory one
    allocator keeps free that the other cannot take.
Prints a markdown block. Written without a GPU: its first run on one is also its test.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
GIB = 1024 ** 3


def run_case(case, shape, layers, mlp, steps):
    import cupy
    import ml_dtypes
    import numpy as np

    B, T, H, Hkv, Dh = shape
    bf16 = ml_dtypes.bfloat16
    pool, runtime = cupy.get_default_memory_pool(), cupy.cuda.runtime
    torch = None
    if case == "torch":
        import torch

        from boostmpi.gpu.attention_torch import TorchAttention

        backend = TorchAttention()
        forward, backward = backend.forward, backend.backward
    else:
        from boostmpi.gpu import kernels

        def forward(q, k, v):
            o, lse = kernels.attention_forward(q, k, v)
            return o, (q, k, v, o, lse)

        def backward(do, ctx):
            return kernels.attention_backward(do, *ctx)

    rng = cupy.random.default_rng(0)

    def randn(*s):
        return rng.standard_normal(s, dtype=cupy.float32).astype(bf16)

    # a tiny forward and backward first: the own kernels compile, PyTorch loads its kernels
    warm = forward(randn(1, 128, H, Dh), randn(1, 128, Hkv, Dh), randn(1, 128, Hkv, Dh))[1]
    backward(randn(1, 128, H, Dh), warm)
    del warm
    pool.free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cupy.cuda.Device().synchronize()
    base_free, total = runtime.memGetInfo()

    def used():
        cupy.cuda.Device().synchronize()
        return base_free - runtime.memGetInfo()[0]

    def step(sample):
        ctxs, peak = [], None
        for _ in range(layers):
            mlp_act = cupy.empty((B, T, mlp * H * Dh), dtype=bf16)
            mlp_act.fill(0)
            del mlp_act
            ctxs.append(forward(randn(B, T, H, Dh), randn(B, T, Hkv, Dh), randn(B, T, Hkv, Dh))[1])
        if sample:
            peak = {"device_used": used(), "cupy_used": pool.used_bytes(), "cupy_held": pool.total_bytes()}
            if torch is not None:
                peak.update(torch_allocated=torch.cuda.memory_allocated(), torch_reserved=torch.cuda.memory_reserved())
        while ctxs:
            grads = backward(randn(B, T, H, Dh), ctxs.pop())
            del grads
        return peak

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times, peaks = [], []
    for i in range(steps + 1):
        start.record()
        step(False)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
        peaks.append(step(True))  # a second, untimed step samples the peak (sampling synchronises)
    out = {"case": case, "first_ms": times[0], "step_ms": float(np.median(times[1:])), "after_step": used(),
           "peak": peaks[-1], "device_total": total}
    if torch is not None:
        out["torch_max_reserved"] = torch.cuda.max_memory_reserved()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4,4096,32,8,128", help="B,T,H,Hkv,Dh")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mlp", type=int, default=4, help="the transient per layer, in attention outputs")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--case", choices=("own", "torch"), help=argparse.SUPPRESS)  # one case, in a child
    ap.add_argument("--append")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.case:
        print(json.dumps(run_case(args.case, shape, args.layers, args.mlp, args.steps)))
        return 0
    rows = []
    for case in ("own", "torch"):
        cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--shape", args.shape,
               "--layers", str(args.layers), "--mlp", str(args.mlp), "--steps", str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            print(f"{case}: failed\n{done.stderr[-2000:]}")
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    import cupy
    import torch

    lines = [f"## two allocators, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"- device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, CuPy {cupy.__version__}, "
             f"PyTorch {torch.__version__}",
             f"- command: python bench/torch_allocators.py --shape {args.shape} --layers {args.layers} "
             f"--mlp {args.mlp} --steps {args.steps}", "",
             "| case | step ms (first) | device GiB at peak / after step | CuPy GiB used / held | "
             "PyTorch GiB allocated / reserved (max) | held unused GiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        p = r["peak"]
        torch_cell = "-" if "torch_reserved" not in p else (
            f"{p['torch_allocated'] / GIB:.2f} / {p['torch_reserved'] / GIB:.2f} ({r['torch_max_reserved'] / GIB:.2f})")
        unused = p["cupy_held"] - p["cupy_used"] + p.get("torch_reserved", 0) - p.get("torch_allocated", 0)
        lines.append(f"| {r['case']} | {r['step_ms']:.2f} ({r['first_ms']:.2f}) | {p['device_used'] / GIB:.2f} / "
                     f"{r['after_step'] / GIB:.2f} | {p['cupy_used'] / GIB:.2f} / {p['cupy_held'] / GIB:.2f} | "
                     f"{torch_cell} | {unused / GIB:.2f} |")
    text = "\n".join(lines + [""])
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
