"""Registers, shared memory and spills of every kernel entry point, as the loader compiles it.

Each kernels/*.cu file with the loader's options (boostmpi.gpu.launch_plan.compile_options: the
warp width and the launch plan's tile sizes), and attention.cu's tensor-core variant: NVRTC's
ptxas report for sm_80, sm_90 and sm_100 through CuPy's compile path, and hipcc's resource
remarks for gfx90a at 64 lanes (tests/support/gpu_compilers.py; no GPU needed). Prints a markdown block;
`--json PATH` also writes the tables, so two commits can be compared entry by entry.

    python bench/kernel_resources.py [--append bench/log/kernel_resources.md] [--json PATH]
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from tests.support import gpu_setup  # noqa: E402,F401  (the CuPy stand-in when no GPU is reachable)

from boostmpi.gpu import kernels  # noqa: E402

ARCHS = ("80", "90", "100")


def tables():
    """({"<variant>:<entry>:sm_<arch>": ptxas info}, {entry: hipcc info}) for every kernel file."""
    from tests.support import gpu_compilers
    from tests.emulators.cudaemu.test_cudaemu_wmma import crt_wheel_include

    files = sorted(p.stem for p in kernels.kernels_dir().glob("*.cu"))
    jobs = [(name, kernels.compile_options(name, 32)) for name in files]
    jobs.append(("attention", kernels.compile_options("attention", 32, wmma=True) + (crt_wheel_include(),)))
    compiled = [(kernels.kernel_source(name), options, arch) for name, options in jobs for arch in ARCHS]
    nvidia = {}
    for (source, options, arch), report in zip(compiled, gpu_compilers.nvrtc(compiled)):
        assert report["ok"], report["log"][-3000:]
        variant = "wmma" if kernels.launch_plan.WMMA_OPTION in options else "plain"
        for (entry, _), info in gpu_compilers.ptxas_table(report["log"]).items():
            if variant == "plain" or "_tc_" in entry:
                nvidia[f"{variant}:{entry}:sm_{arch}"] = info
    amd = {}
    for name in files:
        amd.update(gpu_compilers.amd_resources(kernels.kernel_source(name), kernels.compile_options(name, 64)))
    return nvidia, amd


def block(nvidia, amd):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## kernel_resources: every entry point ({now}, commit {commit})", "",
             f"`python bench/kernel_resources.py` on {platform.node()} ({platform.machine()}); NVRTC "
             f"{gpu_compilers_version()} through CuPy's compile path, hipcc for gfx90a", "",
             "| entry point | registers sm_80 / sm_90 / sm_100 | shared bytes | stack, spill bytes (sm_80 / 90 / 100) "
             "| gfx90a VGPRs, SGPRs | gfx90a spills, scratch | gfx90a LDS |", "|---|---|---|---|---|---|---|"]
    entries = sorted({key.split(":")[1] for key in nvidia})
    for entry in entries:
        variant = "wmma" if "_tc_" in entry else "plain"
        per_arch = [nvidia.get(f"{variant}:{entry}:sm_{arch}") for arch in ARCHS]
        regs = " / ".join(str(i["registers"]) if i else "-" for i in per_arch)
        spills = " / ".join(f"{i['stack']}, {i['spills']}" if i else "-" for i in per_arch)
        smem = per_arch[0]["smem"] if per_arch[0] else "-"
        a = amd.get(entry)
        hip = (f"{a['VGPRs']}, {a['SGPRs']}", f"{a['VGPRs Spill'] + a['SGPRs Spill']}, {a['ScratchSize']}",
               str(a["LDS Size"])) if a else ("-", "-", "-")
        lines.append(f"| `{entry}` | {regs} | {smem} | {spills} | {' | '.join(hip)} |")
    return "\n".join(lines) + "\n"


def gpu_compilers_version():
    from tests.support import gpu_compilers

    return f"CUDA {gpu_compilers.cuda_major()}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--append", help="append the block to this markdown file")
    parser.add_argument("--json", help="write the tables here as JSON")
    args = parser.parse_args()
    nvidia, amd = tables()
    text = block(nvidia, amd)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"nvrtc": nvidia, "gfx90a": amd}, indent=1, sort_keys=True))
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
