"""Resource budgets of the CUDA kernels: registers and shared memory per kernel, as `ptxas -v`
reports them for sm_80 (A100) and sm_90 (H100), against the launch configurations
boostmpi.gpu.kernels chooses.

  registers:      registers per thread (allocated in units of 8) x the largest block the loader
                  launches the kernel with <= the SM's register file (65536), and no spills;
  shared memory:  static + dynamic per block within the default 48 KiB, or within the device's
                  opt-in limit where the loader opts in (rmsnorm_backward's C floats of dw);
  and the harness (tests/cudaemu) counts the same static shared memory ptxas does.
The text compiled is the loader's own (kernel_source) with the NVIDIA warp width.
"""

import hashlib
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import cudaemu
from boostmpi.gpu import kernels as loader

pytestmark = pytest.mark.gpu

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (the CUDA toolkit gives ptxas -v)")

REGISTER_FILE = 65536  # 32-bit registers per SM, and per block, on sm_80 and sm_90
REGISTER_UNIT = 8  # registers are allocated per thread in multiples of 8 (256 per warp)
MAX_REGISTERS = 255
# cudaDevAttrMaxSharedMemoryPerBlockOptin
OPTIN_SHARED = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
ARCHS = tuple(OPTIN_SHARED)
FILES = ("rmsnorm", "lowrank", "softmax_xent", "attention")
# how the loader launches each file's kernels: one block per row (up to MAX_BLOCK_THREADS threads
# for a long row) or the grid-stride elementwise loop
ROW_BLOCK_MAX = loader._row_block(1 << 30, 2, 32)
BLOCK_THREADS = {"rmsnorm": ROW_BLOCK_MAX, "softmax_xent": ROW_BLOCK_MAX, "lowrank": loader.ELEMENTWISE_BLOCK_THREADS,
                 "attention": loader.ATTENTION_THREADS}

_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def _ptxas_report(name, tmp):
    """ptxas -v's report for the loader's text of `name`, both archs in one nvcc run; cached on
    disk by (text, flags, nvcc version) -- nvcc takes most of a minute on a busy 2-core machine."""
    code = loader.kernel_source(name)
    cmd = [NVCC, "-std=c++14", "-DWARP_SIZE=32", "-c", "-Xptxas", "-v"]
    for arch in ARCHS:
        cmd += ["-gencode", f"arch=compute_{arch[3:]},code={arch}"]
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([code, *cmd[1:], version]).encode()).hexdigest()[:24]
    cached = cudaemu.cache_dir() / f"ptxas-{key}.txt"
    if cached.exists():
        return cached.read_text()
    src = tmp / f"{name}.cu"
    src.write_text(code)
    result = subprocess.run(cmd + ["-o", str(tmp / f"{name}.o"), str(src)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    partial = cached.with_suffix(f".{os.getpid()}")
    partial.write_text(result.stderr)
    os.replace(partial, cached)
    return result.stderr


def _ptxas(name, tmp):
    """{(entry, arch): {"registers", "smem", "stack", "spills"}} from ptxas -v."""
    table, key = {}, None
    for line in _ptxas_report(name, tmp).splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            key = (m.group(1), m.group(2))
            table[key] = {"smem": 0}
        elif key and _PTXAS_SPILLS.search(line):
            stack, stores, loads = map(int, _PTXAS_SPILLS.search(line).groups())
            table[key].update(stack=stack, spills=stores + loads)
        elif key and _PTXAS_USED.search(line):
            table[key]["registers"] = int(_PTXAS_USED.search(line).group(1))
            smem = _PTXAS_SMEM.search(line)
            table[key]["smem"] = int(smem.group(1)) if smem else 0
    return table


@pytest.fixture(scope="module")
def ptxas(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    tmp = tmp_path_factory.mktemp("ptxas")
    with ThreadPoolExecutor(2) as pool:
        tables = dict(zip(FILES, pool.map(lambda f: _ptxas(f, tmp), FILES)))
    return tables


def test_every_kernel_file_has_a_launch_budget():
    assert sorted(p.stem for p in loader.kernels_dir().glob("*.cu")) == sorted(FILES)


@needs_nvcc
@pytest.mark.parametrize("name", FILES)
def test_registers_fit_the_largest_block_the_loader_launches(ptxas, name):
    entries = cudaemu.Module(loader.kernel_source(name), loader.COMPILE_OPTIONS + ("-DWARP_SIZE=32",)).entry_points
    threads = BLOCK_THREADS[name]
    for entry in entries:
        for arch in ARCHS:
            info = ptxas[name][(entry, arch)]
            regs = -(-info["registers"] // REGISTER_UNIT) * REGISTER_UNIT
            assert info["registers"] <= MAX_REGISTERS
            assert regs * threads <= REGISTER_FILE, (
                f"{entry} on {arch}: {info['registers']} registers x {threads} threads per block > {REGISTER_FILE}")
            assert info["spills"] == 0 and info["stack"] == 0, f"{entry} on {arch} spills to local memory: {info}"


@needs_nvcc
@pytest.mark.parametrize("name", FILES)
def test_static_shared_memory_fits_and_the_harness_counts_it_as_ptxas_does(ptxas, name):
    module = cudaemu.Module(loader.kernel_source(name), loader.COMPILE_OPTIONS + ("-DWARP_SIZE=32",))
    for entry in module.entry_points:
        for arch in ARCHS:
            smem = ptxas[name][(entry, arch)]["smem"]
            assert smem <= loader.DEFAULT_DYNAMIC_SHARED_BYTES, f"{entry} on {arch}: {smem} bytes of static shared memory"
            assert module.get_function(entry).shared_size_bytes == smem, f"{entry} on {arch}"


class _Kernel:
    """What the loader's shared-memory reservation reads and sets on a kernel."""

    def __init__(self, shared_size_bytes):
        self.shared_size_bytes = shared_size_bytes
        self.max_dynamic_shared_size_bytes = 0


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_rmsnorm_backward_shared_memory_stays_within_the_block_limits(ptxas, arch):
    """For every row width the loader accepts, static + dynamic shared memory is within 48 KiB,
    or the loader opted in and it is within the device's opt-in limit; beyond, a clear error."""
    device = loader._Device(0, 32, 100, OPTIN_SHARED[arch])
    for suffix in ("f32", "bf16"):
        static = ptxas["rmsnorm"][(f"rmsnorm_backward_{suffix}", arch)]["smem"]
        default_edge, optin_edge = loader.DEFAULT_DYNAMIC_SHARED_BYTES // 4, OPTIN_SHARED[arch] // 4
        for C in sorted({1, 4096, default_edge - static // 4 - 1, default_edge - static // 4, default_edge,
                         default_edge + 1, optin_edge - static // 4, optin_edge - static // 4 + 1, optin_edge}):
            kernel = _Kernel(static)
            try:
                loader._reserve_dynamic_shared(kernel, 4 * C, device, f"C = {C}")
            except ValueError as exc:
                assert static + 4 * C > OPTIN_SHARED[arch], f"C = {C} refused but fits: {exc}"
                continue
            limit = OPTIN_SHARED[arch] if kernel.max_dynamic_shared_size_bytes else loader.DEFAULT_DYNAMIC_SHARED_BYTES
            assert static + 4 * C <= limit, f"{arch} C = {C}: {static} + {4 * C} bytes > {limit}"
            if kernel.max_dynamic_shared_size_bytes:
                assert kernel.max_dynamic_shared_size_bytes >= 4 * C
                assert kernel.max_dynamic_shared_size_bytes + static <= OPTIN_SHARED[arch]


def test_rmsnorm_backward_at_the_default_shared_limit_runs_on_the_harness():
    """C = 12288 needs exactly 48 KiB of dynamic shared memory; with the kernel's static
    reduction buffer that is over the default limit, so the loader must opt in."""
    N, C = 1, 12288
    fn = cudaemu.Module(loader.kernel_source("rmsnorm"), loader.COMPILE_OPTIONS + ("-DWARP_SIZE=32",)) \
        .get_function("rmsnorm_backward_f32")
    rng = np.random.default_rng(0)
    bufs = [rng.standard_normal(N * C).astype(np.float32) for _ in range(2)] + [rng.standard_normal(C).astype(np.float32)]
    arrays = [cudaemu.DeviceArray(b) for b in bufs] + [cudaemu.DeviceArray(np.ones(N, np.float32)),
                                               cudaemu.DeviceArray(np.zeros(N * C, np.float32)),
                                               cudaemu.DeviceArray(np.zeros(C, np.float32))]
    args = (*arrays, np.int32(N), np.int32(C))
    with pytest.raises(cudaemu.LaunchError, match=r"128 bytes static .* \+ 49152 dynamic > the limit of 49152"):
        fn(1, 1024, args, shared_mem=4 * C)  # without opting in
    loader._reserve_dynamic_shared(fn, 4 * C, loader._Device(0, 32, 100, OPTIN_SHARED["sm_80"]), f"C = {C}")
    assert fn.max_dynamic_shared_size_bytes == 4 * C
    fn(1, 1024, args, shared_mem=4 * C)
    dy, x, w = bufs
    np.testing.assert_allclose(arrays[5].get(), dy * x, rtol=1e-6)  # dw of one row with rstd 1

