"""Device memory of the stand-in: allocations of the CUDA execution harness behind CuPy's pool.

Every device array lives in a harness allocation (guard regions on both sides), so a RawKernel
launch sees the same bytes the array does, and the NCCL stand-in finds an array's memory from a
raw pointer. The pool imitates CuPy's MemoryPool where the project reads it: sizes rounded up
to 512 bytes, freed blocks kept for reuse by the stream that allocated them (CuPy keeps one arena
per stream: cupy/cuda/memory.pyx at v14.2.0, `SingleDeviceMemoryPool._malloc`), `used_bytes` /
`total_bytes` / `free_all_blocks`. A block remembers the accesses made to it across reuse, so the
order tracking (cuda/_order.py) sees a new array written while the block's previous user on
another stream may still be reading it.

**Shapes-only ("meta") mode** (`BOOSTMPI_STANDIN_META=1` at import, or `set_meta(True)`): arrays
keep their shape, dtype, strides and a pool allocation, but no values. The allocation is a harness
allocation as always (reserved address space: pages no one writes take no host memory), and its
host view is read-only, so an operation the meta mode does not cover fails loudly instead of
committing host memory. Host reads of device values (`get`, `item`, `float()`...) return arrays
filled with `META_HOST_VALUE`.

The pool also keeps, in both modes, its high-water marks (`standin_peaks`): the most bytes in use
and the most bytes held from the device (in use plus cached free blocks, what a GPU would see
taken), and the largest single allocation since `standin_reset_peaks()`.
"""

import bisect
import os
import weakref

import numpy as np

META = os.environ.get("BOOSTMPI_STANDIN_META", "0") == "1"
META_HOST_VALUE = 1.0  # what a host read of a device value returns in meta mode


def set_meta(on):
    """Switch the shapes-only mode (arrays made in one mode are not for use in the other)."""
    global META
    META = bool(on)


ALLOCATION_UNIT = 512  # CuPy's pool rounds every request up to this
POISON_BYTE = 0xFF  # float32, bfloat16 and float64 NaN; -1 for integers


def _harness():
    import cudaemu

    return cudaemu


def _host_address(arr):
    return arr.__array_interface__["data"][0]


class Memory:
    """One block handed out by the pool; returned to it when the last array using it is gone."""

    def __init__(self, pool, raw, size, arena):
        from cupy.cuda._order import call_site

        self.pool, self.raw, self.size = pool, raw, size
        self.ptr = raw.ptr
        self.host = raw.host[:size]
        if META:  # no values: nothing may write (or commit) these pages
            self.host = self.host.view()
            self.host.flags.writeable = False
        self.site = call_site()  # where the array was made, for the order tracking's reports
        _register(self)
        weakref.finalize(self, pool._release, raw, size, self.ptr, arena)


class MemoryPointer:
    """What `ndarray.data` is: the memory and a device address inside it."""

    def __init__(self, mem, ptr):
        self.mem, self.ptr = mem, ptr

    def __int__(self):
        return self.ptr


class MemoryPool:
    def __init__(self):
        self._free = {}  # (stream pointer, rounded size) -> raw harness allocations
        self._used = 0
        self._total = 0
        self.standin_reset_peaks()

    def malloc(self, nbytes):
        from cupy.cuda._queue import get_current_stream

        size = max(ALLOCATION_UNIT, -(-int(nbytes) // ALLOCATION_UNIT) * ALLOCATION_UNIT)
        arena = get_current_stream().ptr
        cached = self._free.get((arena, size))
        if cached:
            raw = cached.pop()
        else:
            raw = _harness().alloc(size)
            self._total += size
        self._used += size
        self._peak_used = max(self._peak_used, self._used)
        self._peak_total = max(self._peak_total, self._total)
        self._largest = max(self._largest, size)
        self._mallocs += 1
        mem = Memory(self, raw, size, arena)
        if not META:
            mem.host[...] = POISON_BYTE  # CuPy's memory is uninitialised: make unwritten reads show
        return mem

    def standin_reset_peaks(self):
        """Start new high-water marks from what is in use and held now (a stand-in extra)."""
        self._peak_used, self._peak_total = self._used, self._total
        self._largest, self._mallocs = 0, 0

    def standin_peaks(self):
        """{"used", "total": the most bytes in use / held from the device, "largest": the largest single
        allocation, "mallocs": allocations} since the last `standin_reset_peaks` (a stand-in extra)."""
        return {"used": self._peak_used, "total": self._peak_total, "largest": self._largest,
                "mallocs": self._mallocs}

    def _release(self, raw, size, ptr, arena):
        _unregister(ptr)
        self._used -= size
        self._free.setdefault((arena, size), []).append(raw)

    def used_bytes(self):
        return self._used

    def free_bytes(self):
        return self._total - self._used

    def total_bytes(self):
        return self._total

    def n_free_blocks(self):
        return sum(len(v) for v in self._free.values())

    def free_all_blocks(self, stream=None):
        """Every free block back to the device (with `stream`: that stream's arena only, as CuPy)."""
        for (arena, size), raws in list(self._free.items()):
            if stream is not None and arena != stream.ptr:
                continue
            for raw in raws:
                raw.free()
                self._total -= size
            del self._free[(arena, size)]

    def set_limit(self, size=None, fraction=None):  # accepted, as CuPy does; no limit is enforced
        pass

    def get_limit(self):
        return 0


_DEFAULT_POOL = MemoryPool()


def get_default_memory_pool():
    return _DEFAULT_POOL


class PinnedMemoryPool:
    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


_PINNED_POOL = PinnedMemoryPool()


def get_default_pinned_memory_pool():
    return _PINNED_POOL


# ------------------------------------------------------------------ pointer -> memory
_starts = []  # sorted device addresses of live blocks
_blocks = {}  # address -> weakref to Memory


def _register(mem):
    bisect.insort(_starts, mem.ptr)
    _blocks[mem.ptr] = weakref.ref(mem)


def _unregister(ptr):
    i = bisect.bisect_left(_starts, ptr)
    if i < len(_starts) and _starts[i] == ptr:
        del _starts[i]
    _blocks.pop(ptr, None)


def host_view(ptr, nbytes):
    """The bytes [ptr, ptr + nbytes) of a live device array, as a writable NumPy uint8 view."""
    i = bisect.bisect_right(_starts, ptr) - 1
    mem = _blocks[_starts[i]]() if i >= 0 else None
    if mem is None or ptr + nbytes > mem.ptr + mem.size:
        raise ValueError(f"device address {ptr:#x} (+{nbytes} bytes) is not inside a live allocation")
    offset = ptr - mem.ptr
    return mem.host[offset: offset + nbytes], mem


def device_address(mem, arr):
    """The device address of arr's first element; arr is a NumPy view of mem.host."""
    return mem.ptr + (_host_address(arr) - _host_address(mem.host))


def empty_bytes_view(mem, nbytes, dtype, shape):
    return np.ndarray(shape, dtype=dtype, buffer=mem.host[:nbytes]) if nbytes else np.empty(shape, dtype)
