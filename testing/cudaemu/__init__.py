"""cudaemu: the exact CUDA kernel text executed on the CPU under the CUDA execution model.

A test-side harness (no GPU needed). `Module(code, options)` compiles the source text that
`boostmpi.gpu.kernels` hands CuPy's RawModule with g++, against `prelude.h` (what CUDA provides),
and runs launches in `runtime.cpp`: blocks one after another, the threads of a block as
cooperative fibers switching at `__syncthreads()` and shuffles, warp size 32 or 64
(`-DWARP_SIZE=<n>`). Errors the launch raises (all `KernelError`):

  RaceError                 two threads of a block touch one shared byte, one writing, no barrier between;
                            two threads of a launch touch one global byte, one writing, not in one block
                            with a barrier between
  SharedBoundsError         shared index outside its variable (or a misaligned shared access)
  UninitializedSharedRead   shared memory read before any thread of the block wrote it
  GlobalBoundsError         global read/write outside a live allocation (guards, freed memory, misaligned)
  DeadlockError             a barrier (or shuffle) some threads never reach
  PartialWarpError          a shuffle whose mask names lanes that do not exist, have exited, or are left out
  LaunchError               arguments that do not match the C signature under CuPy's conversions,
                            a bad grid/block/shared-memory configuration
  IntegerOverflowError      signed integer arithmetic that overflows (an `int` index product on a
                            large tensor): GCC's -fsanitize=signed-integer-overflow, hooks in runtime.cpp

See README.md in this folder for how it works and what it cannot show.
"""

import contextlib
import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

__all__ = [
    "alloc", "Buffer", "DeviceArray", "live_bytes", "Module", "Function", "Param", "entry_points", "set_schedule",
    "global_bytes",
    "current_seed", "schedule", "describe_schedule", "cache_dir", "WARP_SIZE_OPTIONS", "KernelError", "RaceError",
    "SharedBoundsError", "UninitializedSharedRead", "GlobalBoundsError", "DeadlockError", "PartialWarpError",
    "LaunchError", "IntegerOverflowError", "CompileError", "AllocationError", "FunctionNotFound",
]

HERE = Path(__file__).resolve().parent
WARP_SIZE_OPTIONS = (32, 64)
DEFAULT_SHARED_PER_BLOCK = 48 * 1024  # without the opt-in attribute
MAX_SHARED_PER_BLOCK_OPTIN = 227 * 1024  # H100; A100 allows 163 KiB
SEED_ENV = "BOOSTMPI_CUDAEMU_SEED"
CACHE_ENV = "BOOSTMPI_CUDAEMU_CACHE"
CXX = os.environ.get("CXX", "g++")
# the kernel text sees what NVRTC/hipRTC provide (prelude.h), never the host's headers
NO_HOST_HEADERS = ("-nostdinc", "-nostdinc++")
# CUDA's device headers the harness emulates (include/: <mma.h>'s warp matrix functions and the
# <cuda_bf16.h> type they take), found by `#include <...>` as NVRTC finds CUDA's own
INCLUDE = HERE / "include"



class KernelError(RuntimeError):
    """An error found while running a kernel under the harness."""


class RaceError(KernelError):
    pass


class SharedBoundsError(KernelError):
    pass


class UninitializedSharedRead(KernelError):
    pass


class GlobalBoundsError(KernelError):
    pass


class DeadlockError(KernelError):
    pass


class PartialWarpError(KernelError):
    pass


class LaunchError(KernelError):
    pass


class IntegerOverflowError(KernelError):
    pass


class CompileError(RuntimeError):
    """g++ rejected the kernel text (or a form the harness cannot instrument)."""


class AllocationError(RuntimeError):
    """Misuse of an emulated device allocation (double free, use after free)."""


class FunctionNotFound(KeyError):
    def __str__(self):
        return str(self.args[0])


_ERRORS = {1: KernelError, 2: RaceError, 3: SharedBoundsError, 4: UninitializedSharedRead, 5: GlobalBoundsError,
           6: DeadlockError, 7: PartialWarpError, 8: LaunchError, 9: IntegerOverflowError}

# --------------------------------------------------------------------------------------------- building


def cache_dir():
    base = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                       "boostmpi-cudaemu")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compiler_id():
    out = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0]


def _run_compiler(cmd, what):
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"{what}: {CXX} failed ({' '.join(cmd)}):\n{result.stderr[-6000:]}")
    return result


def _build(key, sources, build):
    """Runs build(tmpdir) -> produced file in a private folder, publishes it atomically under key."""
    final = cache_dir() / key
    if final.exists():
        return final
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        tmp = Path(tmp)
        for name, text in sources.items():
            (tmp / name).write_text(text)
        produced = build(tmp)
        try:
            os.replace(produced, final)
        except OSError:
            if not final.exists():  # not just another process (an MPI rank) publishing it first
                raise
    return final


_lock = threading.RLock()
_runtime = None


class _Error(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("has_pc", ctypes.c_int), ("pc_offset", ctypes.c_ulonglong),
                ("object", ctypes.c_char * 1024), ("message", ctypes.c_char * 4096)]


def _lib():
    """The runtime shared library, built once per (runtime.cpp, compiler) and loaded RTLD_GLOBAL."""
    global _runtime
    with _lock:
        if _runtime is None:
            text = (HERE / "runtime.cpp").read_text()
            key = "runtime-" + hashlib.sha256((text + _compiler_id()).encode()).hexdigest()[:20] + ".so"

            def build(tmp):
                _run_compiler([CXX, "-std=c++17", "-O2", "-g", "-fPIC", "-shared", str(tmp / "runtime.cpp"), "-o",
                               str(tmp / "out.so"), "-ldl"], "the cudaemu runtime")
                return tmp / "out.so"

            lib = ctypes.CDLL(str(_build(key, {"runtime.cpp": text}, build)), mode=ctypes.RTLD_GLOBAL)
            lib.cudaemu_alloc.restype = ctypes.c_ulonglong
            lib.cudaemu_alloc.argtypes = [ctypes.c_ulonglong]
            lib.cudaemu_free.argtypes = [ctypes.c_ulonglong]
            lib.cudaemu_lookup.argtypes = [ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong),
                                           ctypes.POINTER(ctypes.c_ulonglong)]
            lib.cudaemu_live_bytes.restype = ctypes.c_ulonglong
            lib.cudaemu_global_bytes.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong),
                                                 ctypes.c_int]
            lib.cudaemu_take_unsupported.restype = ctypes.c_char_p
            lib.cudaemu_only_blocks.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_ulonglong]
            lib.cudaemu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint),
                                           ctypes.POINTER(ctypes.c_uint), ctypes.c_ulonglong, ctypes.c_ulonglong,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong, ctypes.POINTER(_Error)]
            _runtime = lib
        return _runtime


# --------------------------------------------------------------------------------------------- memory


class Buffer:
    """An emulated device allocation: page-aligned payload, unmapped guard page after it, and
    every kernel access outside the payload (before, past the end, after free) reported."""

    def __init__(self, nbytes):
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        with _lock:
            ptr = _lib().cudaemu_alloc(nbytes)
        if not ptr:
            raise MemoryError(f"cudaemu: out of emulated device memory allocating {nbytes} bytes")
        self.ptr = int(ptr)
        self.nbytes = nbytes
        self._freed = False
        self._host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr)) if nbytes else \
            np.empty(0, np.uint8)

    @property
    def host(self):
        if self._freed:
            raise AllocationError(f"use of the device allocation at {self.ptr:#x} after it was freed")
        return self._host

    def free(self):
        with _lock:
            status = _lib().cudaemu_free(self.ptr)
        if status == 2 or self._freed:
            raise AllocationError(f"the device allocation at {self.ptr:#x} ({self.nbytes} bytes) is freed twice")
        if status != 0:
            raise AllocationError(f"{self.ptr:#x} is not the start of a device allocation")
        self._freed = True
        self._host = None

    @property
    def freed(self):
        return self._freed

    def __repr__(self):
        return f"<cudaemu.Buffer {self.nbytes} bytes at {self.ptr:#x}{' (freed)' if self._freed else ''}>"


def alloc(nbytes):
    return Buffer(nbytes)


class DeviceArray:
    """A NumPy array copied into a device allocation: the least a kernel argument needs
    (`.data.ptr`, `.dtype`), for tests that launch on the harness without the CuPy stand-in."""

    def __init__(self, host=None, shape=None, dtype=None):
        host = np.zeros(shape, dtype) if host is None else np.ascontiguousarray(host)
        self.buf = Buffer(host.nbytes)
        self.buf.host[:] = host.reshape(-1).view(np.uint8)
        self.dtype, self.shape = host.dtype, host.shape
        self.data = self.buf  # .data.ptr, as a CuPy array has

    def get(self):
        return self.buf.host.view(self.dtype).reshape(self.shape).copy()


def live_bytes():
    """Bytes in live (not freed) emulated allocations."""
    with _lock:
        return int(_lib().cudaemu_live_bytes())


def global_bytes(reset=False):
    """(bytes read, bytes written) in global memory by the kernels launched since the last reset,
    every access counted (no cache is modelled); `reset` starts the count again from zero."""
    read, written = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    with _lock:
        _lib().cudaemu_global_bytes(ctypes.byref(read), ctypes.byref(written), int(reset))
    return int(read.value), int(written.value)


def _lookup(ptr):
    start, size = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    if _lib().cudaemu_lookup(ptr, ctypes.byref(start), ctypes.byref(size)):
        return start.value, size.value
    return None


# --------------------------------------------------------------------------------------------- schedule

_seed = None
_seed_announced = False


def _seed_from_env():
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        return None
    if value.lower() == "random":
        return int.from_bytes(os.urandom(4), "little")
    try:
        return int(value, 0)
    except ValueError:
        raise ValueError(f"{SEED_ENV}={value!r}: expected an integer seed, 'random', or nothing") from None


def set_schedule(seed):
    """None: blocks in order and fibers round-robin. An int: shuffled block order and randomised
    fiber switching (also at memory accesses) from that seed."""
    global _seed, _seed_announced
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"set_schedule takes an int seed or None, not {type(seed).__name__}")
    _seed = None if seed is None else int(seed) & 0xFFFFFFFFFFFFFFFF
    _seed_announced = False


def current_seed():
    return _seed


@contextlib.contextmanager
def schedule(seed):
    """`with schedule(seed):` -- set_schedule(seed) for the block, the previous schedule after it."""
    previous = _seed
    set_schedule(seed)
    try:
        yield
    finally:
        set_schedule(previous)


def describe_schedule():
    """The schedule in use, in words (for a test session's header and every error message)."""
    return "blocks in order, fibers round-robin" if _seed is None else f"schedule seed {_seed} ({SEED_ENV}={_seed} repeats it)"


set_schedule(_seed_from_env())

# --------------------------------------------------------------------------------------------- source handling

_SHARED_DECL = re.compile(r"(\bextern\s+)?\b__shared__\s+([^;{}]*?);")
_DECLARATOR = re.compile(r"^(?P<type>[^,\[\]]*?)\b(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$", re.S)
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def instrument_shared(code):
    """Rewrites each `__shared__` declaration into a call to the harness for per-block storage.

    The only change made to the kernel text: one declaration statement becomes one statement on
    the same line(s), so line numbers stay those of the input.
      __shared__ T name[dims];         ->  static char name__cudaemu_tag[sizeof(T[dims])];
                                           auto& name = *cudaemu::shared_static<T[dims]>(&tag, "name", __LINE__);
      extern __shared__ T name[][d];   ->  auto* const name = cudaemu::shared_dynamic<T[d]>("name", __LINE__);
    """
    def rewrite(m):
        extern, decl = m.group(1), m.group(2)
        newlines = "\n" * m.group(0).count("\n")
        d = _DECLARATOR.match(decl.strip())
        if not d or not d.group("type").strip():
            return m.group(0)  # left as is: the leftover check reports it
        typ, name, dims = " ".join(d.group("type").split()), d.group("name"), "".join(d.group("dims").split())
        if extern:
            if not dims.startswith("[]"):
                return m.group(0)
            return f'auto* const {name} = cudaemu::shared_dynamic<{typ}{dims[2:]}>("{name}", __LINE__);' + newlines
        return (f"static char {name}__cudaemu_tag[sizeof({typ}{dims})]; "
                f'auto& {name} = *cudaemu::shared_static<{typ}{dims}>(&{name}__cudaemu_tag, "{name}", __LINE__);' + newlines)

    out = _SHARED_DECL.sub(rewrite, code)
    leftover = re.search(r"\b__shared__\b", _COMMENTS.sub(lambda c: re.sub(r"[^\n]", " ", c.group(0)), out))
    if leftover:
        line = out.count("\n", 0, leftover.start()) + 1
        raise CompileError(f"cudaemu cannot instrument the __shared__ declaration on line {line}: "
                           f"{out.splitlines()[line - 1].strip()!r} (supported: `[extern] __shared__ T name[dims];` "
                           "inside a function)")
    return out


def _parse_options(options):
    """CuPy/NVRTC options -> (g++ flags, warp size). -D/-U/-I and -std= are honoured, others ignored."""
    options = list(options)
    flags, std, warp = [], "-std=c++17", 32
    i = 0
    while i < len(options):
        opt = str(options[i])
        if opt in ("-D", "-U", "-I") and i + 1 < len(options):
            opt = opt + str(options[i + 1])
            i += 1
        if opt.startswith("--std="):
            opt = opt[1:]
        if opt.startswith("-std="):
            std = opt
        elif opt.startswith(("-D", "-U", "-I")):
            flags.append(opt)
            m = re.fullmatch(r"-DWARP_SIZE=(\S+)", opt)
            if m:
                try:
                    warp = int(m.group(1), 0)
                except ValueError:
                    warp = None
                if warp not in WARP_SIZE_OPTIONS:
                    raise CompileError(f"-DWARP_SIZE={m.group(1)}: the harness emulates warp sizes {WARP_SIZE_OPTIONS}")
        i += 1
    # what the emulated compiler defines: NVRTC for a 32-wide warp, hipRTC (AMD CDNA) for 64
    if warp == 32:
        target = ["-D__CUDACC__", "-D__CUDACC_RTC__", "-D__CUDA_ARCH__=800"]
    else:
        target = ["-D__HIPCC_RTC__", "-D__HIP_PLATFORM_AMD__", "-D__HIP_DEVICE_COMPILE__"]
    return [std] + target + flags, warp


_ENTRY = re.compile(r'extern\s*"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
                    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\(([^)]*)\)")

# C scalar types -> the NumPy dtype CuPy must be handed for them (LP64)
_C_SCALARS = {
    "bool": "bool", "char": "int8", "signed char": "int8", "unsigned char": "uint8", "short": "int16",
    "short int": "int16", "unsigned short": "uint16", "unsigned short int": "uint16", "int": "int32",
    "signed int": "int32", "signed": "int32", "unsigned int": "uint32", "unsigned": "uint32", "long": "int64",
    "long int": "int64", "unsigned long": "uint64", "unsigned long int": "uint64", "long long": "int64",
    "long long int": "int64", "unsigned long long": "uint64", "unsigned long long int": "uint64", "float": "float32",
    "double": "float64", "size_t": "uint64", "ptrdiff_t": "int64", "int8_t": "int8", "uint8_t": "uint8",
    "int16_t": "int16", "uint16_t": "uint16", "int32_t": "int32", "uint32_t": "uint32", "int64_t": "int64",
    "uint64_t": "uint64",
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}


class Param:
    """One parameter of an entry point's C signature."""

    def __init__(self, text):
        text = " ".join(text.replace("*", " * ").replace("&", " & ").split())
        tokens = text.split(" ")
        if len(tokens) > 1 and re.fullmatch(r"[A-Za-z_]\w*", tokens[-1]) and tokens[-1] not in _QUALIFIERS \
                and " ".join(t for t in tokens[:-1] if t not in _QUALIFIERS) not in ("", "unsigned", "signed", "long", "short"):
            self.name, tokens = tokens[-1], tokens[:-1]
        else:
            self.name = ""
        self.ctype = " ".join(tokens).replace(" *", "*")  # as written, for the launch thunk
        core = [t for t in tokens if t not in _QUALIFIERS]
        self.is_pointer = "*" in core
        self.pointee = " ".join(t for t in core[:core.index("*")]) if self.is_pointer else None
        self.base = " ".join(core)
        self.dtype = None if self.is_pointer else _C_SCALARS.get(self.base)
        self.pointee_dtype = _C_SCALARS.get(self.pointee) if self.is_pointer and core.count("*") == 1 else None

    def __repr__(self):
        return f"{self.ctype} {self.name}".strip()


def entry_points(preprocessed):
    """{name: [Param]} of the extern "C" __global__ functions in preprocessed source text."""
    text = " ".join(preprocessed.split())
    return {m.group(1): [Param(p) for p in _split_params(m.group(2))] for m in _ENTRY.finditer(text)}


def _split_params(text):
    text = text.strip()
    if not text or text == "void":
        return []
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "<(" and 1 or (ch in ">)" and -1 or 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _thunks(entries):
    """A `void thunk(void** args)` per entry point: the launcher's uniform way to call it, plus
    sizeof of every pointer parameter's element type (for the dtype check)."""
    lines = ["", "// ---- cudaemu: launch thunks (generated, after the kernel text) ----"]
    for name, params in entries.items():
        call = ", ".join(f"*({p.ctype}*)a[{i}]" for i, p in enumerate(params))
        lines.append(f'extern "C" void __cudaemu_thunk_{name}(void** a) {{ (void)a; {name}({call}); }}')
        for i, p in enumerate(params):
            if p.is_pointer and p.pointee and p.pointee != "void" and p.base.count("*") == 1:
                lines.append(f'extern "C" const unsigned long long __cudaemu_sizeof_{name}_{i} = sizeof({p.pointee});')
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- modules

_modules = {}


class Module:
    """Kernel source text compiled for the harness; the counterpart of cupy.RawModule(code=, options=)."""

    def __init__(self, code, options=()):
        self.code = code
        self.options = tuple(str(o) for o in options)
        flags, self.warp_size = _parse_options(self.options)
        prelude = (HERE / "prelude.h").read_text()
        headers = [f.read_text() for f in sorted(INCLUDE.glob("*.h"))]
        key = hashlib.sha256("\0".join([code, *self.options, prelude, *headers, (HERE / "runtime.cpp").read_text(),
                                        _compiler_id(), Path(__file__).read_text()]).encode()).hexdigest()[:24]
        with _lock:
            _lib()
            cached = _modules.get(key)
            if cached is None:
                cached = _modules[key] = _compile(key, code, flags, prelude)
        self._lib, self._entries, self._source_path = cached
        self._key = key

    def get_function(self, name):
        if name not in self._entries:
            raise FunctionNotFound(f"no extern \"C\" __global__ function {name!r} in the module "
                                   f"(it has: {', '.join(sorted(self._entries)) or 'none'})")
        return Function(self, name, self._entries[name])

    @property
    def entry_points(self):
        return dict(self._entries)

    def static_shared_bytes(self, name):
        """Bytes of `__shared__` variables reachable from entry point `name` (CUDA's
        shared_size_bytes): the tag symbols its code, and the functions it calls, refer to."""
        with _lock:
            table = _static_shared.get(self._key)
            if table is None:
                table = _static_shared[self._key] = _shared_by_entry(self._source_path.parent / "module.so",
                                                                     list(self._entries))
        return table[name]


def _compile(key, code, flags, prelude):
    flags = ["-I", str(INCLUDE), *flags]  # before any -I given: the harness's <mma.h>, never CUDA's
    pre = subprocess.run([CXX, "-E", "-P", *NO_HOST_HEADERS, "-x", "c++", *flags, "-"], input=code, capture_output=True,
                         text=True)
    if pre.returncode != 0:
        raise CompileError(f"preprocessing the kernel text failed:\n{pre.stderr[-6000:]}")
    entries = entry_points(pre.stdout)
    source = instrument_shared(code) + _thunks(entries)

    def build(tmp):
        _run_compiler([CXX, *flags, *NO_HOST_HEADERS, "-fPIC", "-O1", "-g", "-fsanitize=thread,signed-integer-overflow",
                       "-fno-tree-loop-distribute-patterns", "-ffp-contract=off", "-Wno-unknown-pragmas", "-Wno-psabi", "-include", str(tmp / "prelude.h"), "-x", "c++",
                       "-c", str(tmp / "kernel.cu"), "-o", str(tmp / "kernel.o")], "compiling the kernel text")
        _run_compiler([CXX, "-shared", str(tmp / "kernel.o"), "-o", str(tmp / "module.so")], "linking the kernel module")
        # keep the compiled text beside the library (error locations are lines of it)
        os.makedirs(tmp / "module", exist_ok=True)
        os.replace(tmp / "module.so", tmp / "module" / "module.so")
        os.replace(tmp / "kernel.cu", tmp / "module" / "kernel.cu")
        return tmp / "module"

    folder = _build("module-" + key, {"kernel.cu": source, "prelude.h": prelude}, build)
    lib = ctypes.CDLL(str(folder / "module.so"), mode=ctypes.RTLD_LOCAL)
    unsupported = _lib().cudaemu_take_unsupported().decode()
    if unsupported:
        raise CompileError(f"the kernel text cannot run on the harness: {unsupported}")
    return lib, entries, folder / "kernel.cu"


_static_shared = {}
_FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")
_REFERENCE = re.compile(r"<([^<>+]+)(?:\+0x[0-9a-f]+)?>")


def _shared_by_entry(so, entries):
    """{entry: static shared bytes} from the module's disassembly: the call/reference graph
    from each entry point, and the sizes of the `__shared__` tag symbols it reaches."""
    sizes = {}
    for line in subprocess.run(["nm", "-S", "--defined-only", str(so)], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[3].endswith("__cudaemu_tag"):
            sizes[parts[3]] = int(parts[1], 16)
    refs, current = {}, None
    for line in subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = refs.setdefault(m.group(1), set())
        elif current is not None:
            current.update(r.split("@")[0] for r in _REFERENCE.findall(line))
    table = {}
    for entry in entries:
        seen, stack, total = set(), [entry], 0
        while stack:
            symbol = stack.pop()
            if symbol in seen:
                continue
            seen.add(symbol)
            total += sizes.get(symbol, 0)
            stack.extend(refs.get(symbol, ()))
        table[entry] = total
    return table


def _dims(value, what):
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    try:
        dims = tuple(int(v) for v in value)
    except TypeError:
        raise LaunchError(f"{what} must be an int or a tuple of up to 3 ints, got {value!r}") from None
    if not 1 <= len(dims) <= 3 or any(isinstance(v, bool) for v in value):
        raise LaunchError(f"{what} must be an int or a tuple of up to 3 ints, got {value!r}")
    return dims + (1,) * (3 - len(dims))


def _scalar_dtype(arg):
    """The dtype CuPy passes a host scalar as: Python int -> long long, float -> double, bool -> bool,
    NumPy scalars by their dtype. None when CuPy would not accept it as a scalar."""
    if isinstance(arg, np.generic):
        return arg.dtype
    if isinstance(arg, bool):
        return np.dtype(np.bool_)
    if isinstance(arg, int):
        return np.dtype(np.int64)
    if isinstance(arg, float):
        return np.dtype(np.float64)
    if isinstance(arg, complex):
        return np.dtype(np.complex128)
    return None


def _describe(arg):
    if isinstance(arg, np.generic):
        return f"numpy.{arg.dtype.name} {arg!r}"
    if isinstance(arg, (bool, int, float, complex)):
        kind = {bool: "bool", int: "int (passed as long long)", float: "float (passed as double)",
                complex: "complex"}[type(arg)]
        return f"a Python {kind}"
    return f"a {type(arg).__module__}.{type(arg).__name__}"


def _device_pointer(arg):
    if isinstance(arg, Buffer):
        return arg.ptr
    data = getattr(arg, "data", None)
    ptr = getattr(data, "ptr", None)
    if isinstance(ptr, (int, np.integer)) and not isinstance(arg, np.ndarray):
        return int(ptr)
    return None


class Function:
    """One entry point; call it like cupy.RawKernel: fn(grid, block, args, shared_mem=0)."""

    def __init__(self, module, name, params):
        self.module = module
        self.name = name
        self.params = params
        self.max_dynamic_shared_size_bytes = 0  # like the CUDA attribute: 0 = the default 48 KiB limit
        self._thunk = ctypes.cast(getattr(module._lib, f"__cudaemu_thunk_{name}"), ctypes.c_void_p).value

    @property
    def shared_size_bytes(self):
        """Static shared memory per block, as CuPy's RawKernel.shared_size_bytes reports it."""
        return self.module.static_shared_bytes(self.name)

    def _pointee_size(self, i):
        try:
            return ctypes.c_ulonglong.in_dll(self.module._lib, f"__cudaemu_sizeof_{self.name}_{i}").value
        except ValueError:
            return None

    def _fail(self, message):
        raise LaunchError(f"{self.name}: {message}")

    def _convert(self, args):
        if not isinstance(args, (tuple, list)):
            self._fail(f"args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.params):
            self._fail(f"{len(args)} arguments for {len(self.params)} parameters ({', '.join(map(repr, self.params))})")
        holders = []
        for i, (param, arg) in enumerate(zip(self.params, args)):
            where = f"argument {i} ({param!r})"
            if param.is_pointer:
                ptr = _device_pointer(arg)
                if ptr is None:
                    self._fail(f"{where} needs a device array, got {_describe(arg)}")
                if ptr and _lookup(ptr) is None:
                    self._fail(f"{where}: {ptr:#x} is not inside a live device allocation")
                dtype = getattr(arg, "dtype", None)
                if dtype is not None:
                    dtype = np.dtype(dtype)
                    if param.pointee_dtype is not None:
                        if dtype != np.dtype(param.pointee_dtype):
                            self._fail(f"{where} gets an array of {dtype}; the kernel reads it as {param.pointee}")
                    else:
                        size = self._pointee_size(i)
                        if size is not None and size != dtype.itemsize:
                            self._fail(f"{where} gets an array of {dtype} ({dtype.itemsize} bytes an element); "
                                       f"the kernel reads {param.pointee} ({size} bytes)")
                holders.append(ctypes.c_void_p(ptr))
            else:
                if param.dtype is None:
                    self._fail(f"{where}: the harness does not pass parameters of type {param.base!r}")
                dtype = _scalar_dtype(arg)
                if dtype is None:
                    self._fail(f"{where} needs a scalar, got {_describe(arg)}")
                if dtype != np.dtype(param.dtype):
                    self._fail(f"{where} gets {_describe(arg)} ({dtype.itemsize} bytes, {dtype}); the kernel reads "
                               f"{param.base} ({np.dtype(param.dtype).itemsize} bytes): pass numpy.{np.dtype(param.dtype).name}(...)")
                holders.append(np.array([arg], dtype=dtype))
        pointers = (ctypes.c_void_p * max(1, len(holders)))()
        for i, h in enumerate(holders):
            pointers[i] = ctypes.addressof(h) if isinstance(h, ctypes.c_void_p) else h.ctypes.data
        return pointers, holders

    def __call__(self, grid, block, args, shared_mem=0, stream=None, enable_cooperative_groups=False, blocks=None):
        """blocks: run only these blocks (linear ids, x fastest), for index arithmetic at logical
        sizes too large to run whole (races across blocks are then not judged)."""
        global _seed_announced
        if enable_cooperative_groups:
            self._fail("cooperative launches are not emulated")
        grid3, block3 = _dims(grid, "grid"), _dims(block, "block")
        if min(grid3) < 1 or min(block3) < 1:
            self._fail(f"empty launch configuration grid={grid3} block={block3}")
        if block3[0] * block3[1] * block3[2] > 1024 or block3[0] > 1024 or block3[1] > 1024 or block3[2] > 64:
            self._fail(f"block {block3} exceeds the per-block thread limits (1024 threads, z <= 64)")
        if grid3[0] >= 2 ** 31 or grid3[1] > 65535 or grid3[2] > 65535:
            self._fail(f"grid {grid3} exceeds the grid limits")
        shared_mem = int(shared_mem)
        dyn_limit = self.max_dynamic_shared_size_bytes or DEFAULT_SHARED_PER_BLOCK
        if shared_mem < 0 or shared_mem > dyn_limit:
            self._fail(f"{shared_mem} bytes of dynamic shared memory; the limit is {dyn_limit} "
                       "(raise it with max_dynamic_shared_size_bytes, at most "
                       f"{MAX_SHARED_PER_BLOCK_OPTIN})")
        if self.max_dynamic_shared_size_bytes > MAX_SHARED_PER_BLOCK_OPTIN:
            self._fail(f"max_dynamic_shared_size_bytes = {self.max_dynamic_shared_size_bytes} exceeds the device's "
                       f"{MAX_SHARED_PER_BLOCK_OPTIN}")
        shared_limit = MAX_SHARED_PER_BLOCK_OPTIN if self.max_dynamic_shared_size_bytes else DEFAULT_SHARED_PER_BLOCK
        with _lock:
            pointers, holders = self._convert(args)
            if _seed is not None and not _seed_announced:
                sys.stderr.write(f"cudaemu: randomised schedule, seed {_seed} ({SEED_ENV}={_seed} repeats it)\n")
                _seed_announced = True
            launch_seed = 0
            if _seed is not None:
                launch_seed = int.from_bytes(hashlib.sha256(repr((_seed, self.name, grid3, block3, shared_mem)).encode())
                                             .digest()[:8], "little")
            error = _Error()
            if blocks is not None:
                chosen = [int(b) for b in blocks]
                if not chosen:
                    self._fail("blocks=[] runs nothing")
                _lib().cudaemu_only_blocks((ctypes.c_ulonglong * max(1, len(chosen)))(*chosen), len(chosen))
            kind = _lib().cudaemu_launch(self._thunk, ctypes.addressof(pointers), (ctypes.c_uint * 3)(*grid3),
                                         (ctypes.c_uint * 3)(*block3), shared_mem, shared_limit,
                                         self.module.warp_size, int(_seed is not None), launch_seed, ctypes.byref(error))
            del holders
        if kind:
            message = error.message.decode(errors="replace")
            if error.has_pc:
                message += self._location(error.object.decode(), error.pc_offset)
            raise _ERRORS.get(kind, KernelError)(
                f"{self.name} (grid {grid3}, block {block3}, warp {self.module.warp_size}): {message} [{describe_schedule()}]")

    def _location(self, obj, offset):
        """ ' at line N `text` (in f, inlined into line M ...)' from the debug info of the module."""
        try:
            out = subprocess.run(["addr2line", "-e", obj, "-i", "-f", "-C", hex(offset)], capture_output=True,
                                 text=True, timeout=30).stdout.splitlines()
        except (OSError, subprocess.SubprocessError):
            return ""
        frames = []
        for fn, loc in zip(out[0::2], out[1::2]):
            path, _, line = loc.rpartition(":")
            line = line.split(" ")[0]
            if path.endswith("kernel.cu") and line.isdigit():
                frames.append((fn, int(line)))
        if not frames:
            return ""
        lines = self.module.code.splitlines()
        fn, line = frames[0]
        text = lines[line - 1].strip() if line <= len(lines) else ""
        callers = ", ".join(f"line {n}" for _, n in frames[1:4])
        return f" at line {line} of the kernel source: `{text}` (in {fn}{', inlined at ' + callers if callers else ''})"
