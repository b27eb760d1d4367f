"""The GPU compilers the suite runs the kernels through, without a GPU.

  nvrtc(jobs)            NVRTC of the CUDA wheels installed here, CUDA 12 (cupy-cuda12x with
                         nvidia-cuda-nvrtc-cu12) or CUDA 13 (cupy-cuda13x with nvidia-cuda-nvrtc;
                         NVRTC_PACKAGES), through CuPy's own compile path:
                         `cupy._core.core.assemble_cupy_compiler_options` (what RawModule's
                         compile_with_cache adds: the default -std, CuPy's and the CUDA include
                         paths) and `cupy.cuda.compiler._compile_module_with_cache` (what
                         _compile_with_cache_cuda adds: -ftz=true, -arch=sm_<cc> for a cubin,
                         --device-as-default-execution-space), with `--ptxas-options=-v` so the
                         program log carries ptxas's per-kernel registers, spills and shared
                         memory. Runs in a child process: the tests import the CuPy stand-in,
                         the child the real CuPy 14.2 (it imports without a GPU). Two things are
                         replaced there, both device lookups: the arch (CuPy memoises
                         `_get_arch_for_options_for_nvrtc` per device; the stand-in below is its
                         body with the arch given) and `function.Module.load` (loading a cubin
                         needs a driver; the cubin is kept instead).
  hiprtc(source, opts)   hipRTC of libamdhip64.so.5 (Debian's ROCm 5.2 HIP runtime) via ctypes,
                         with the options CuPy's `_compile_with_cache_hip` adds
                         (-fcuda-flush-denormals-to-zero) and --offload-arch=gfx90a (MI250X).
  amd_resources(source)  hipcc (Debian's, clang 15) for gfx90a with
                         -Rpass-analysis=kernel-resource-usage: VGPRs, spills, LDS, occupancy.

`require(name)` skips a test when a compiler is missing, except under CI=true, where a missing
compiler is a failure (the [test] extra brings NVRTC and CuPy, tests/run.sh installs hipRTC and
hipcc, nvcc is the machine's). Results are cached on disk by
(text, options, compiler version) in the harness's cache folder.
"""

import ctypes
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from testing import cudaemu

HERE = Path(__file__).resolve().parent
IN_CI = os.environ.get("CI") == "true"
HIPRTC_LIBRARY = "libamdhip64.so.5"
AMD_ARCH = "gfx90a"
# what CuPy's _compile_with_cache_hip adds on ROCm (HIP's counterpart of -ftz=true)
CUPY_HIP_OPTIONS = ("-fcuda-flush-denormals-to-zero",)


def require(name):
    """Skips (or, under CI=true, fails) the calling test when compiler `name` is missing."""
    why = MISSING[name]()
    if why:
        message = f"{name} is not available: {why}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


def _cached(kind, key_parts, compute):
    key = hashlib.sha256("\0".join(map(str, key_parts)).encode()).hexdigest()[:24]
    path = cudaemu.cache_dir() / f"{kind}-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    partial = path.with_suffix(f".{os.getpid()}")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)
    return value


# --------------------------------------------------------------------------------------------- NVRTC


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _real_cupy_env():
    """The environment of a child that imports the real CuPy, not the tests' stand-in."""
    env = dict(os.environ)
    standin = str(HERE.parents[1] / "testing" / "cupy_standin")
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and p != standin)
    env.pop("BOOSTMPI_CUPY_STANDIN", None)
    env["CUPY_CACHE_IN_MEMORY"] = "1"  # CuPy's own switch: compile, never read or write its disk cache
    return env


# per CUDA major: the real CuPy, NVRTC, the runtime (its headers) and the wheel holding crt/mma.h; the
# [test] extra brings CUDA 12's, [test-cuda13] CUDA 13's (tests/run.sh's second environment)
NVRTC_PACKAGES = {12: ("cupy-cuda12x", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-nvcc-cu12"),
                  13: ("cupy-cuda13x", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cuda-crt")}
EXTRA = {12: "[test]", 13: "[test-cuda13]"}
NVRTC_JOBS_PER_CHILD = 4


def cuda_major():
    """12 or 13: the CUDA major of the CuPy wheel installed here (None for neither; both is an error)."""
    majors = [major for major, packages in NVRTC_PACKAGES.items() if _version(packages[0])]
    assert len(majors) <= 1, "cupy-cuda12x and cupy-cuda13x are both installed: CuPy loads only one"
    return majors[0] if majors else None


def _nvrtc_missing():
    major = cuda_major()
    if major is None:
        return "the real CuPy (cupy-cuda12x or cupy-cuda13x) is not installed (the [test] extra brings it)"
    for package in NVRTC_PACKAGES[major][1:]:
        if _version(package) is None:
            return f"{package} is not installed beside {NVRTC_PACKAGES[major][0]} (the {EXTRA[major]} extra brings it)"
    return None


def nvrtc(jobs):
    """[(source, options, arch)] -> [{"ok", "log", "options", "cubin_bytes"}]: each source
    compiled as CuPy's RawModule(code=source, options=options) compiles it on a device of compute
    capability `arch` ("80", "90"), the log with ptxas's report."""
    major = cuda_major()
    versions = (major, *(f"{p}=={_version(p)}" for p in NVRTC_PACKAGES.get(major, ())))
    results, todo = [None] * len(jobs), []
    for i, job in enumerate(jobs):
        key = ("nvrtc", *versions, *job[:2], *job[2], Path(__file__).read_text())
        path = cudaemu.cache_dir() / f"nvrtc-{hashlib.sha256(chr(0).join(map(str, key)).encode()).hexdigest()[:24]}.json"
        if path.exists():
            results[i] = json.loads(path.read_text())
        else:
            todo.append((i, path))
    # children of a few jobs each, two at a time (NVRTC is single-threaded; each child's results are
    # cached as it ends, so an interrupted run keeps what it compiled)
    chunks = [todo[k:k + NVRTC_JOBS_PER_CHILD] for k in range(0, len(todo), NVRTC_JOBS_PER_CHILD)]

    def compile_chunk(chunk):
        payload = json.dumps([[jobs[i][0], list(jobs[i][1]), jobs[i][2]] for i, _ in chunk])
        child = subprocess.run([sys.executable, __file__, "nvrtc"], input=payload, capture_output=True, text=True,
                               env=_real_cupy_env(), timeout=600)
        assert child.returncode == 0, f"the NVRTC child failed:\n{child.stderr[-6000:]}"
        for (i, path), result in zip(chunk, json.loads(child.stdout)):
            results[i] = result
            partial = path.with_suffix(f".{os.getpid()}.{i}")
            partial.write_text(json.dumps(result))
            os.replace(partial, path)

    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        list(pool.map(compile_chunk, chunks))
    return results


def _nvrtc_child():
    """In the child: compile each job through CuPy's RawModule path (see the module docstring)."""
    import io

    import cupy._core.core as core
    from cupy.cuda import compiler

    def arch_option(arch=None):
        # cupy/cuda/compiler.py _get_arch_for_options_for_nvrtc without the per-device memo
        if not compiler._use_ptx and int(arch) <= int(compiler._get_max_compute_capability()):
            return f"-arch=sm_{arch}", "cubin"
        return f"-arch=compute_{arch}", "ptx"

    kept, seen_options = [], []

    class _Module:
        def load(self, cubin):
            kept.append(cubin)

        def _set_mapping(self, mapping):
            pass

    class _Function:
        Module = _Module

    real_compile = compiler._NVRTCProgram.compile

    def recording_compile(self, options=(), log_stream=None):
        seen_options.append(list(options))
        return real_compile(self, options, log_stream)

    compiler._get_arch_for_options_for_nvrtc = arch_option
    compiler.function = _Function
    compiler._NVRTCProgram.compile = recording_compile
    out = []
    for source, options, arch in json.loads(sys.stdin.read()):
        log = io.StringIO()
        kept.clear()
        seen_options.clear()
        try:
            # cupy._core.core.compile_with_cache(source, options, prepend_cupy_headers=False), as
            # RawModule calls it, less its return type check of the loaded module
            assembled = core.assemble_cupy_compiler_options(tuple(options) + ("--ptxas-options=-v",))
            compiler._compile_module_with_cache(source, assembled, arch=arch, extra_source=core._get_header_source(),
                                                backend="nvrtc", log_stream=log)
            out.append({"ok": True, "log": log.getvalue(), "options": seen_options[-1], "cubin_bytes": len(kept[0])})
        except compiler.CompileException as exc:
            out.append({"ok": False, "log": str(exc), "options": seen_options[-1] if seen_options else [],
                        "cubin_bytes": 0})
    sys.stdout.write(json.dumps(out))


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def ptxas_table(log):
    """{(entry, "sm_80"): {"registers", "smem", "stack", "spills"}} from ptxas -v's report."""
    table, key = {}, None
    for line in log.splitlines():
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


# --------------------------------------------------------------------------------------------- hipRTC


@functools.lru_cache(maxsize=None)
def _hip_library():
    try:
        lib = ctypes.CDLL(HIPRTC_LIBRARY)
    except OSError:
        return None
    lib.hiprtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.hiprtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.hiprtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.hiprtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.hiprtcGetCodeSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.hiprtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return lib


def _hiprtc_missing():
    return None if _hip_library() is not None else f"{HIPRTC_LIBRARY} does not load (tests/run.sh installs libamdhip64-dev with apt-get)"


def _hip_version():
    out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "libamdhip64-5"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def hiprtc_options(options):
    return tuple(options) + CUPY_HIP_OPTIONS + (f"--offload-arch={AMD_ARCH}",)


def hiprtc(source, options):
    """{"ok", "log", "code_bytes"}: hipRTC compiling `source` for gfx90a with CuPy's HIP options."""
    def compile_():
        lib = _hip_library()
        opts = hiprtc_options(options)
        prog = ctypes.c_void_p()
        status = lib.hiprtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None)
        assert status == 0, f"hiprtcCreateProgram returned {status}"
        try:
            status = lib.hiprtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
            size = ctypes.c_size_t()
            lib.hiprtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.hiprtcGetProgramLog(prog, log)
            code = ctypes.c_size_t()
            if status == 0:
                lib.hiprtcGetCodeSize(prog, ctypes.byref(code))
            return {"ok": status == 0, "log": log.value.decode(errors="replace"), "code_bytes": code.value,
                    "options": list(opts)}
        finally:
            lib.hiprtcDestroyProgram(ctypes.byref(prog))

    return _cached("hiprtc", ("hiprtc", _hip_version(), source, *options, *CUPY_HIP_OPTIONS), compile_)


# --------------------------------------------------------------------------------------------- hipcc resources

HIPCC = shutil.which("hipcc")


def _hipcc_missing():
    if HIPCC is None:
        return "hipcc is not on PATH (tests/run.sh installs it with apt-get)"
    return None


_AMD_FUNCTION = re.compile(r"remark: Function Name: (\w+)")
_AMD_FIELD = re.compile(r"remark:\s+([A-Za-z ]+?)(?: \[[^\]]*\])?: (\d+) \[-Rpass-analysis")


def amd_resources(source, options):
    """{entry: {"VGPRs", "AGPRs", "ScratchSize", "Occupancy", "VGPRs Spill", "SGPRs Spill", "LDS Size"...}}
    from hipcc's kernel-resource-usage remarks for gfx90a."""
    def compile_():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "kernel.cu"
            src.write_text(source)
            cmd = [HIPCC, f"--offload-arch={AMD_ARCH}", "--cuda-device-only", "-include", "hip/hip_runtime.h", "-x",
                   "hip", *options, *CUPY_HIP_OPTIONS, "-Rpass-analysis=kernel-resource-usage", "-c", str(src), "-o",
                   str(Path(tmp) / "kernel.o")]
            result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HIP_PLATFORM": "amd"},
                                    timeout=600)
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-6000:]}"
        table, entry = {}, None
        for line in result.stderr.splitlines():
            m = _AMD_FUNCTION.search(line)
            if m:
                entry = m.group(1)
                table[entry] = {}
                continue
            m = _AMD_FIELD.search(line)
            if m and entry:
                table[entry][m.group(1).strip()] = int(m.group(2))
        return table

    version = subprocess.run([HIPCC, "--version"], capture_output=True, text=True,
                             env={**os.environ, "HIP_PLATFORM": "amd"}).stdout
    return _cached("hipcc", ("hipcc", version, source, *options, *CUPY_HIP_OPTIONS), compile_)


MISSING = {"NVRTC": _nvrtc_missing, "hipRTC": _hiprtc_missing, "hipcc": _hipcc_missing,
           "nvcc": lambda: None if shutil.which("nvcc") else "nvcc is not on PATH (the CUDA toolkit)"}

if __name__ == "__main__" and sys.argv[1:] == ["nvrtc"]:
    _nvrtc_child()
