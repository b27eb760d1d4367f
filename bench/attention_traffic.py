"""The fused attention kernels' global traffic and resources, against FlashAttention-2's.

Prints a markdown block:
  - registers, shared memory and spills per entry point from `ptxas -v` (sm_80, NVRTC) and the
    blocks that fit an SM; VGPRs, spills and the blocks that fit a CU from hipcc's resource
    remarks (gfx90a); the occupancy rules of tests/kernels/test_kernel_resources.py;
  - global bytes per launch, counted by the CUDA execution harness at a small shape (every
    access; tests/kernels/attention/test_attention_kernel.py holds the count equal to the tile plan), and by the
    tile plan (boostmpi.gpu.kernels.attention_traffic) at the paper's 7B layout per rank;
  - FlashAttention-2's traffic for the same call: forward with 64-query tiles (Q once, K and V
    once per query tile up to its last query, O and the log-sum-exp once); backward with 64-key
    tiles, dQ accumulated in float32 by atomics (read and written once per key tile that a
    query meets), its preprocessing pass (delta = rowsum(dO o O)) and the final dQ conversion.

    python bench/attention_traffic.py [--append bench/log/attention_traffic.md]
"""

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # boostmpi and tests.support

from tests.support import gpu_setup  # noqa: E402

gpu_setup.GPU.choose()  # the CuPy stand-in when no GPU is reachable
import numpy as np  # noqa: E402

from boostmpi.gpu import kernels  # noqa: E402
from boostmpi.sim import operations  # noqa: E402

ENTRIES = ("attention_forward", "attention_backward_dq", "attention_backward")


def flash2_traffic(B, T, H, Hkv, Dh, s):
    """{forward, backward}: (read, written) bytes of FlashAttention-2's kernels for this call (the
    performance model's count, boostmpi.sim.operations.flash2_traffic)."""
    return operations.flash2_traffic(B * H, B * Hkv, T, Dh, s)


def ours(B, T, H, Hkv, Dh, s):
    plan = kernels.attention_traffic(B, T, H, Hkv, Dh, s)
    back = [a + b for a, b in zip(plan["backward_dq"], plan["backward_dkdv"])]
    return {"forward": plan["forward"], "backward": tuple(back)}


def counted(B, T, H, Hkv, Dh, dtype):
    from testing import cudaemu
    import cupy

    rng = np.random.default_rng(0)
    q, do = (cupy.asarray(rng.standard_normal((B, T, H, Dh)).astype(dtype)) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((B, T, Hkv, Dh)).astype(dtype)) for _ in range(2))
    cudaemu.global_bytes(reset=True)
    o, lse = kernels.attention_forward(q, k, v)
    forward = cudaemu.global_bytes(reset=True)
    kernels.attention_backward(do, q, k, v, o, lse)
    return {"forward": forward, "backward": cudaemu.global_bytes(reset=True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--append", help="append the block to this markdown file")
    args = parser.parse_args()
    from tests.support import gpu_compilers
    from tests.kernels.test_kernel_resources import (amd_options, amd_resident_blocks, launch_shape, nvidia_options,
                                       nvidia_resident_blocks)

    source = kernels.kernel_source("attention")
    [report] = gpu_compilers.nvrtc([(source, nvidia_options("attention"), "80")])
    assert report["ok"], report["log"]
    table = gpu_compilers.ptxas_table(report["log"])
    amd = gpu_compilers.amd_resources(source, amd_options("attention"))
    lines = [f"## attention_traffic: fused attention, bytes and resources "
             f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"`python bench/attention_traffic.py` on {platform.node()} ({platform.machine()}, "
             f"{os.cpu_count()} cores); GPU: {gpu_setup.GPU.describe()}", "",
             "| entry point (sm_80) | registers | shared bytes | spills | blocks per SM (sm_80) | "
             "gfx90a: VGPRs, spills, blocks per CU |", "|---|---|---|---|---|---|"]
    for t in ("f32", "bf16"):
        for entry in [f"{e}{hd}" for hd in ("", "_hd64") for e in ENTRIES]:
            name = f"{entry}_{t}"
            info = table[(name, "sm_80")]
            sm = nvidia_resident_blocks("sm_80", info["registers"], launch_shape(name, 32)[0], info["smem"])
            a = amd[name]
            cu = amd_resident_blocks(a["Occupancy"], launch_shape(name, 64)[0], a["LDS Size"])
            lines.append(f"| `{name}` | {info['registers']} | {info['smem']} | {info['spills']} | {sm} | "
                         f"{a['VGPRs']}, {a['VGPRs Spill'] + a['SGPRs Spill']}, {cu} |")
    lines += ["", "| call | pass | ours: read / written (MB) | FlashAttention-2 (MB) | ratio |", "|---|---|---|---|---|"]
    import ml_dtypes

    cases = [("counted, B1 T200 H4 Hkv2 Dh64 bf16", (1, 200, 4, 2, 64), ml_dtypes.bfloat16, True),
             ("plan, 7B per rank: B4 T4096 H8 Hkv8 Dh128 bf16", (4, 4096, 8, 8, 128), ml_dtypes.bfloat16, False),
             ("plan, GQA: B4 T4096 H8 Hkv2 Dh128 bf16", (4, 4096, 8, 2, 128), ml_dtypes.bfloat16, False)]
    for name, shape, dtype, count in cases:
        s = np.dtype(dtype).itemsize
        mine = counted(*shape, dtype) if count else ours(*shape, s)
        if count:
            assert mine == ours(*shape, s), (mine, ours(*shape, s))
        ref = flash2_traffic(*shape, s)
        for part in ("forward", "backward"):
            r, w = mine[part]
            fr, fw = ref[part]
            lines.append(f"| {name} | {part} | {r / 1e6:.2f} / {w / 1e6:.2f} | {fr / 1e6:.2f} / {fw / 1e6:.2f} | "
                         f"{(r + w) / (fr + fw):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
