"""The torch attention backend (boostmpi/gpu/attention_torch.py) on a real GPU: what the tests
without a GPU cannot show. Needs CuPy and a PyTorch built for the same CUDA/ROCm major release.

    python bench/torch_attention_check.py [--repeats 10] [--append bench/log/torch_attention.md]

For each shape (bfloat16, causal, on a CuPy stream of its own):
  - correct: o, dq, dk, dv against PyTorch's math SDPA in float32 on the same values (K/V repeated
    for the reference only), max |error| / max |reference| <= 2e-2;
  - zero-copy: the leaf tensors the backend made share q, k, v's device memory (and whether o is
    SDPA's output itself or a copy, reported only);
  - deterministic: two forward and backward passes with the default deterministic=True give the
    same bits;
  - which of PyTorch's flash / memory-efficient / cuDNN kernels accept the shape (each alone);
  - time: forward and backward (CUDA events, median of --repeats) of the backend, deterministic
    and not, and of SDPA called directly on PyTorch tensors of the same shape.
Prints a markdown block; exits 1 if any check failed. Written without a GPU: its first run on one is
also its test.
"""

import argparse
import datetime
import math
import os
import platform
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from gpu_step import gpu_time  # noqa: E402

# small shapes, then the 7B model's per-GPU attention at batch 1 (the float32 math reference holds T x T scores)
SHAPES = [(2, 256, 8, 8, 64), (2, 256, 8, 2, 128), (1, 4096, 32, 8, 128), (1, 4096, 32, 32, 128)]
TOLERANCE = 2e-2


def gpu_ms(fn, repeats):
    return gpu_time(fn, repeats) * 1e3  # the median of CUDA-event times, after two warm-up calls


def reference(q, k, v, do):
    """float32 math-kernel SDPA with K/V repeated: (o, dq, dk, dv) as torch tensors [B,T,*,Dh]."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (torch.from_dlpack(a).float().requires_grad_(True) for a in (q, k, v))
    G = q.shape[2] // k.shape[2]
    with sdpa_kernel([SDPBackend.MATH]):
        o = torch.nn.functional.scaled_dot_product_attention(
            qt.transpose(1, 2), kt.repeat_interleave(G, 2).transpose(1, 2), vt.repeat_interleave(G, 2).transpose(1, 2),
            is_causal=True, scale=1 / math.sqrt(q.shape[-1]))
    grads = torch.autograd.grad(o, (qt, kt, vt), grad_outputs=torch.from_dlpack(do).float().transpose(1, 2))
    return (o.transpose(1, 2),) + grads


def accepting_kernels(q, k, v):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (torch.from_dlpack(a).transpose(1, 2) for a in (q, k, v))
    ok = []
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            ok.append(name.split("_")[0].lower())
        except RuntimeError:
            pass
    return ",".join(ok) or "none"


def check_shape(shape, repeats):
    import cupy
    import ml_dtypes
    import numpy as np
    import torch

    from boostmpi.gpu.attention_torch import TorchAttention

    B, T, H, Hkv, Dh = shape
    if T >= 4096 and repeats == 0:
        return None
    rng = np.random.default_rng(sum(shape))
    q, do = (cupy.asarray(rng.standard_normal((B, T, H, Dh), dtype=np.float32).astype(ml_dtypes.bfloat16)) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((B, T, Hkv, Dh), dtype=np.float32).astype(ml_dtypes.bfloat16)) for _ in range(2))
    row = {"shape": shape, "failures": []}
    det, nondet = TorchAttention(), TorchAttention(deterministic=False)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        o, ctx = det.forward(q, k, v)
        shares = all(t.data_ptr() == a.data.ptr for t, a in zip((ctx.q, ctx.k, ctx.v), (q, k, v)))
        got = (o,) + det.backward(do, ctx)
        o_shares = o.data.ptr == ctx.out.data_ptr()  # SDPA's output returned without a copy
        o2, ctx2 = det.forward(q, k, v)
        again = (o2,) + det.backward(do, ctx2)
        ref = reference(q, k, v, do)
        errors = []
        for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
            r = cupy.from_dlpack(r.detach().contiguous())
            errors.append(float(cupy.abs(g.astype(cupy.float32) - r).max() / cupy.abs(r).max()))
            if not g.flags.c_contiguous or g.dtype != q.dtype or errors[-1] > TOLERANCE:
                row["failures"].append(f"{name}: error {errors[-1]:.2e}, contiguous {g.flags.c_contiguous}, {g.dtype}")
        same_bits = all(bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()) for a, b in zip(got, again))
        row.update(error=max(errors), zero_copy=f"in {'yes' if shares else 'NO'}, out {'yes' if o_shares else 'copied'}", deterministic=same_bits, kernels=accepting_kernels(q, k, v))
        if not shares:
            row["failures"].append("the leaf tensors do not share the CuPy arrays' memory")
        if not same_bits:
            row["failures"].append("two deterministic passes differ")
        if repeats:
            for label, backend in (("det", det), ("nondet", nondet)):
                row[f"{label}_fwd"] = gpu_ms(lambda: backend.forward(q, k, v), repeats)
                row[f"{label}_bwd"] = gpu_ms(lambda: backend.backward(do, backend.forward(q, k, v)[1]), repeats) - row[f"{label}_fwd"]
            qt, kt, vt = (torch.from_dlpack(a).transpose(1, 2).detach().requires_grad_(True) for a in (q, k, v))
            dot = torch.from_dlpack(do).transpose(1, 2)
            with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
                def sdpa():
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
                row["sdpa_fwd"] = gpu_ms(sdpa, repeats)
                row["sdpa_bwd"] = gpu_ms(lambda: torch.autograd.grad(sdpa(), (qt, kt, vt), dot), repeats) - row["sdpa_fwd"]
    stream.synchronize()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per case (0: checks only, small shapes)")
    ap.add_argument("--append", help="append the result block to this file")
    args = ap.parse_args()
    import cupy
    import torch

    from boostmpi.gpu import attention_torch

    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(cupy.cuda.Device().id)
    lines = [f"## torch attention backend check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"- device: {props['name'].decode()}, driver {runtime.driverGetVersion()}, "
             f"{'HIP' if runtime.is_hip else 'CUDA'} runtime {runtime.runtimeGetVersion()}",
             f"- CuPy {cupy.__version__}, PyTorch {torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip}, "
             f"cuDNN {torch.backends.cudnn.version()}), Python {platform.python_version()}",
             f"- command: python bench/torch_attention_check.py --repeats {args.repeats}", ""]
    problem = attention_torch.problem("bfloat16")
    if problem:
        print("\n".join(lines + [f"the torch backend cannot run here: {problem}"]))
        return 1
    lines += ["| B, T, H, Hkv, Dh | max rel. error | zero-copy | bitwise det. | kernels accepting | "
              "fwd ms det / nondet / SDPA | bwd ms det / nondet / SDPA |", "|---|---|---|---|---|---|---|"]
    failures = []
    for shape in SHAPES:
        row = check_shape(shape, args.repeats)
        if row is None:
            continue
        failures += [f"{shape}: {f}" for f in row["failures"]]
        times = ["{:.3f} / {:.3f} / {:.3f}".format(*(row.get(f"{c}_{d}", float("nan")) for c in ("det", "nondet", "sdpa")))
                 for d in ("fwd", "bwd")]
        lines.append(f"| {', '.join(map(str, shape))} | {row['error']:.2e} | {row['zero_copy']} | {row['deterministic']} | "
                     f"{row['kernels']} | {times[0]} | {times[1]} |")
    lines += ["", "all checks passed" if not failures else "FAILED:\n" + "\n".join("- " + f for f in failures), ""]
    text = "\n".join(lines)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
