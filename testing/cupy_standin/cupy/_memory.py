"""Device memory of the stand-in: allocations of the CUDA execution harness behind CuPy's pool.

Every device array lives in harness memory, so a RawKernel launch sees the same bytes the array
does, and the NCCL stand-in finds an array's memory from a raw pointer. The pool follows CuPy
14.2.0's `SingleDeviceMemoryPool` (cupy/cuda/memory.pyx at tag v14.2.0; `MemoryPool` below cites it
rule by rule): 512-byte rounding, one arena of free chunks per stream, best fit with splitting,
merging of freed neighbours, new allocations only when no free chunk fits, `used_bytes` /
`total_bytes` / `free_all_blocks` / `set_limit`. When values are computed, each chunk handed out is
still its own harness allocation (so a kernel's access outside its array is caught; the same chunk
handed out again has the same address); in meta mode, where no kernel runs, a chunk is its bytes of
one harness allocation per pool allocation, CuPy's layout. Accesses are remembered per pool
allocation and offset, so the order tracking (cuda/_order.py) sees a new array written while a
previous user of the same bytes on another stream may still be reading them.

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
import gc
import os
import threading
import weakref

import numpy as np

META = os.environ.get("BOOSTMPI_STANDIN_META", "0") == "1"
META_HOST_VALUE = 1.0  # what a host read of a device value returns in meta mode
# META is also switched on for each call a stream capture records (cuda/graph.py), which resolves shapes
# only; its arrays get memory of the mode the process is in, kept here meanwhile
memory_mode = None


def _meta_memory():
    return META if memory_mode is None else memory_mode


def set_meta(on):
    """Switch the shapes-only mode (arrays made in one mode are not for use in the other)."""
    global META
    META = bool(on)


ALLOCATION_UNIT = 512  # CuPy's pool rounds every request up to this
POISON_BYTE = 0xFF  # float32, bfloat16 and float64 NaN; -1 for integers


def _harness():
    from testing import cudaemu

    return cudaemu


def _host_address(arr):
    return arr.__array_interface__["data"][0]


class Memory:
    """One chunk handed out by the pool; returned to it when the last array using it is gone."""

    def __init__(self, pool, raw, chunk):
        from cupy.cuda._order import call_site

        self.pool, self.raw, self.chunk = pool, raw, chunk
        self.size = 0 if chunk is None else chunk.size
        self.ptr = raw.ptr
        self.host = raw.host[:self.size]
        if _meta_memory():  # no values: nothing may write (or commit) these pages
            self.host = self.host.view()
            self.host.flags.writeable = False
        self.site = call_site()  # where the array was made, for the order tracking's reports
        _register(self)
        weakref.finalize(self, pool._release, raw, self.ptr, chunk)


class MemoryPointer:
    """What `ndarray.data` is: the memory and a device address inside it."""

    def __init__(self, mem, ptr):
        self.mem, self.ptr = mem, ptr

    def __int__(self):
        return self.ptr


class _Allocation:
    """What one cudaMalloc of the pool gave (CuPy's `Memory` under a `_Chunk`): `size` bytes that its
    chunks split among themselves. The order tracking (cuda/_order.py) keeps the accesses made to these
    bytes here, by offset, so they outlive the chunk that made them (reuse after split and merge)."""

    _serial = 0

    def __init__(self, size):
        self.size = size
        self.raws = {}  # (offset, size) -> harness allocation of a freed chunk, kept for that chunk
        self.base = None  # in meta mode: one harness allocation for all of it
        _Allocation._serial += 1
        self.serial = _Allocation._serial


class _Chunk:
    """CuPy's `_Chunk` (memory.pyx:359): bytes [offset, offset + size) of an allocation, linked to
    the chunks before and after it in that allocation."""

    __slots__ = ("alloc", "offset", "size", "arena", "prev", "next", "free")

    def __init__(self, alloc, offset, size, arena):
        self.alloc, self.offset, self.size, self.arena = alloc, offset, size, arena
        self.prev = self.next = None
        self.free = False  # in its arena's index

    def key(self):
        # CuPy orders its index by (size, address of the _Chunk object) (memory.pyx:1048, 1112), so which
        # of several free chunks of one size it takes is not predictable; the stand-in takes the one that
        # comes first in allocation order, which keeps its traces repeatable.
        return (self.size, self.alloc.serial, self.offset)

    def split(self, size):
        """memory.pyx:422 `_Chunk.split`: keep the first `size` bytes, return the rest as a new chunk."""
        if self.size == size:
            return None
        rest = _Chunk(self.alloc, self.offset + size, self.size - size, self.arena)
        self.size = size
        rest.next, rest.prev = self.next, self
        if rest.next is not None:
            rest.next.prev = rest
        self.next = rest
        return rest

    def merge_next(self):
        """memory.pyx:440 `_Chunk.merge_next`: absorb the (free) chunk after this one."""
        self.size += self.next.size
        self.next = self.next.next
        if self.next is not None:
            self.next.prev = self


class _Arena:
    """CuPy's `_Arena` (memory.pyx:1055): the free chunks of one stream, ordered by (size, ...)."""

    def __init__(self):
        self.keys = []  # sorted chunk keys
        self.chunks = {}  # key -> free chunk

    def insert_chunk(self, chunk, merge=True):
        """memory.pyx:1107: a freed chunk first merges with free neighbours (1096 `try_merge_chunk`:
        the following ones, then the preceding ones), then enters the index."""
        if merge:
            while chunk.next is not None and self.try_remove_chunk(chunk.next):
                chunk.merge_next()
            while chunk.prev is not None and self.try_remove_chunk(chunk.prev):
                chunk = chunk.prev
                chunk.merge_next()
        key = chunk.key()
        bisect.insort(self.keys, key)
        self.chunks[key] = chunk
        chunk.free = True

    def try_remove_chunk(self, chunk):
        """memory.pyx:1142: take the chunk out of the index if it is free here."""
        if not chunk.free or chunk.arena is not self:
            return False
        self._remove(chunk.key())
        return True

    def _remove(self, key):
        i = bisect.bisect_left(self.keys, key)
        del self.keys[i]
        self.chunks.pop(key).free = False

    def get_chunk(self, size):
        """memory.pyx:1162: the smallest free chunk of at least `size` bytes (`lower_bound`, 1171),
        split when larger; the rest goes back to the index unmerged (1179-1181)."""
        i = bisect.bisect_left(self.keys, (size,))
        if i == len(self.keys):
            return None
        chunk = self.chunks[self.keys[i]]
        self._remove(self.keys[i])
        rest = chunk.split(size)
        if rest is not None:
            self.insert_chunk(rest, merge=False)
        return chunk

    def free_all(self):
        """memory.pyx:1114: give back every free chunk that is a whole allocation (1125: a chunk with a
        neighbour is part of a split allocation and stays); returns the bytes given back."""
        freed = 0
        for key in [k for k in self.keys if self.chunks[k].prev is None and self.chunks[k].next is None]:
            chunk = self.chunks[key]
            self._remove(key)
            chunk.arena = None
            freed += chunk.size
            for raw in chunk.alloc.raws.values():
                _free_raw(raw)
            chunk.alloc.raws.clear()
            if chunk.alloc.base is not None:
                _free_raw(chunk.alloc.base)
        return freed


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError, with its message (memory.pyx:55)."""

    def __init__(self, size, total, limit=0):
        msg = f"Out of memory allocating {size:,} bytes"
        if limit == 0:
            msg += f" (allocated so far: {total:,} bytes)."
        else:
            msg += f" (allocated so far: {total:,} bytes, limit set to: {limit:,} bytes)."
        super().__init__(msg)


def _backing(chunk):
    """The harness allocation of a chunk handed out: the one it had when last freed if it is the same
    chunk again (same allocation, offset and size: CuPy gives the same address), else a new one; the
    kept allocations of freed chunks it overlaps are given back."""
    raws, lo, hi = chunk.alloc.raws, chunk.offset, chunk.offset + chunk.size
    raw = raws.pop((lo, chunk.size), None)
    if raw is not None:
        return raw
    for offset, size in [k for k in raws if k[0] < hi and k[0] + k[1] > lo]:
        _free_raw(raws.pop((offset, size)))
    if _meta_memory():  # no kernel runs: the chunk is its bytes of one harness allocation per pool allocation, as in CuPy
        if chunk.alloc.base is None:
            chunk.alloc.base = _harness().alloc(chunk.alloc.size)
        return _Part(chunk.alloc.base, lo, chunk.size)
    return _harness().alloc(chunk.size)


class _Part:
    """Bytes [offset, offset + size) of a harness allocation, as a chunk's backing in meta mode."""

    def __init__(self, base, offset, size):
        self.base = base
        self.ptr, self.host = base.ptr + offset, base.host[offset: offset + size]

    def free(self):  # the pool allocation's harness allocation goes when the pool gives it back
        pass


def _round_size(size):
    """memory.pyx:1042 `_round_size`: up to a multiple of ALLOCATION_UNIT_SIZE (512, memory.pyx:40)."""
    return -(-int(size) // ALLOCATION_UNIT) * ALLOCATION_UNIT


class MemoryPool:
    """CuPy 14.2.0's `SingleDeviceMemoryPool` (memory.pyx:1218), its algorithm rule by rule: requests
    rounded to 512 bytes; one arena of free chunks per stream; a request takes the smallest free chunk
    of its stream that fits and splits off the rest; a freed chunk merges with the free chunks beside it
    in its allocation; only when no free chunk fits is a new allocation made, of exactly the rounded
    size; `free_all_blocks` gives back only free chunks that are whole allocations; over the limit
    (`set_limit`, CUPY_GPU_MEMORY_LIMIT) the pool gives back its free blocks and tries once more before
    raising OutOfMemoryError. `used_bytes` counts the chunks handed out, `total_bytes` the allocations
    held. The harness memory behind a chunk is `_backing`'s (its own allocation when values are
    computed, so kernels' out-of-bounds accesses are still caught per array)."""

    def __init__(self):
        self._arenas = {}  # stream identifier -> _Arena
        self._used = 0
        self._total = 0
        self._limit = 0
        self.set_limit(**_parse_limit_string())  # memory.pyx:1266
        self.standin_reset_peaks()

    def _arena(self, ident):
        arena = self._arenas.get(ident)
        if arena is None:
            arena = self._arenas[ident] = _Arena()
        return arena

    def malloc(self, nbytes):
        from cupy.cuda._queue import get_current_stream

        size = _round_size(nbytes)
        if size == 0:  # memory.pyx:1359: a null pointer, no pool memory
            return Memory(self, _harness().alloc(0), None)
        arena = self._arena(get_current_stream().ptr)
        chunk = arena.get_chunk(size)  # memory.pyx:1370: best fit, or the smallest larger chunk
        if chunk is None:  # memory.pyx:1374-1378: a new allocation of exactly this size
            from cupy.cuda import graph

            graph.check_malloc()  # cudaMalloc: allowed during a capture in relaxed mode only
            self._try_malloc(size)
            chunk = _Chunk(_Allocation(size), 0, size, arena)
        self._used += chunk.size  # memory.pyx:1380
        self._peak_used = max(self._peak_used, self._used)
        self._peak_total = max(self._peak_total, self._total)
        self._largest = max(self._largest, size)
        _DEVICE.count(chunk.size, 0, size)
        self._mallocs += 1
        mem = Memory(self, _backing(chunk), chunk)
        if not _meta_memory():
            mem.host[...] = POISON_BYTE  # CuPy's memory is uninitialised: make unwritten reads show
        return mem

    def _try_malloc(self, size):
        """memory.pyx:1518 `_try_malloc` with 1464 `_try_block_total_bytes`: over the limit, give back
        the free blocks and try again (twice, the second time after a garbage collection)."""
        if self._fits(size):
            return
        self.free_all_blocks()
        if self._fits(size):
            return
        gc.collect()
        self.free_all_blocks()
        if not self._fits(size):
            raise OutOfMemoryError(size, self._total, self._limit)

    def _fits(self, size):
        if self._limit and size > self._limit:  # memory.pyx:1476-1478
            raise OutOfMemoryError(size, self._total, self._limit)
        if self._limit and self._total > self._limit - size:
            return False
        self._total += size
        _DEVICE.count(0, size, 0)
        return True

    def _release(self, raw, ptr, chunk):
        """memory.pyx:1388 `free`: the chunk back to its arena, merged with its free neighbours."""
        _unregister(ptr)
        if chunk is None:
            raw.free()
            return
        chunk.alloc.raws[(chunk.offset, chunk.size)] = raw  # the same chunk again gets the same address
        self._used -= chunk.size
        _DEVICE.count(-chunk.size, 0, 0)
        chunk.arena.insert_chunk(chunk)

    def standin_reset_peaks(self):
        """Start new high-water marks from what is in use and held now (a stand-in extra)."""
        self._peak_used, self._peak_total = self._used, self._total
        self._largest, self._mallocs = 0, 0

    def standin_peaks(self):
        """{"used", "total": the most bytes in use / held from the device, "largest": the largest single
        allocation, "mallocs": allocations} since the last `standin_reset_peaks` (a stand-in extra)."""
        return {"used": self._peak_used, "total": self._peak_total, "largest": self._largest,
                "mallocs": self._mallocs}

    def used_bytes(self):
        return self._used

    def free_bytes(self):
        return self._total - self._used

    def total_bytes(self):
        return self._total

    def n_free_blocks(self):
        return sum(len(a.keys) for a in self._arenas.values())

    def free_all_blocks(self, stream=None):
        """memory.pyx:1400: the free whole-allocation chunks of every arena (with `stream`: of its arena)
        back to the device; split allocations stay."""
        if stream is None:
            arenas = list(self._arenas.values())
        else:
            arenas = [self._arenas[stream.ptr]] if stream.ptr in self._arenas else []
        freed = sum(arena.free_all() for arena in arenas)
        self._total -= freed
        _DEVICE.count(0, -freed, 0)

    def set_limit(self, size=None, fraction=None):
        """memory.pyx:1492: a limit on `total_bytes` (0: none), or a fraction of the device's memory."""
        if size is None:
            if fraction is None:
                size = 0
            else:
                if not 0 <= fraction <= 1:
                    raise ValueError(f"memory limit fraction out of range: {fraction}")
                from cupy.cuda import runtime

                size = fraction * runtime.memGetInfo()[1]
            self.set_limit(size=size)
            return
        if fraction is not None:
            raise ValueError("size and fraction cannot be specified at one time")
        if size < 0:
            raise ValueError(f"memory limit size out of range: {size}")
        self._limit = int(size)

    def get_limit(self):
        return self._limit


def _parse_limit_string(limit=None):
    """memory.pyx `_parse_limit_string`: CUPY_GPU_MEMORY_LIMIT as bytes or as a percentage."""
    if limit is None:
        limit = os.environ.get("CUPY_GPU_MEMORY_LIMIT")
    if limit is None:
        return {"size": None, "fraction": None}
    if limit.endswith("%"):
        return {"size": None, "fraction": float(limit[:-1]) / 100.0}
    return {"size": int(limit), "fraction": None}


class _DeviceMemory:
    """What the device sees of every pool together (a stand-in extra): bytes in use and held summed
    over all MemoryPool objects, with their high-water marks and the largest single allocation since
    `standin_reset_device_peaks()`. A process with more than one pool (boostmpi.gpu.pools) needs the
    sum at each moment, which the pools' own marks cannot give."""

    def __init__(self):
        self.used = self.total = 0
        self.reset()

    def reset(self):
        self.peak_used, self.peak_total, self.largest = self.used, self.total, 0

    def count(self, used, total, size):
        self.used += used
        self.total += total
        self.peak_used = max(self.peak_used, self.used)
        self.peak_total = max(self.peak_total, self.total)
        self.largest = max(self.largest, size)


_DEVICE = _DeviceMemory()


def standin_device_peaks():
    """{"used", "total", "largest"} over every pool since `standin_reset_device_peaks` (a stand-in extra)."""
    return {"used": _DEVICE.peak_used, "total": _DEVICE.peak_total, "largest": _DEVICE.largest}


def standin_reset_device_peaks():
    _DEVICE.reset()


_DEFAULT_POOL = MemoryPool()


def get_default_memory_pool():
    return _DEFAULT_POOL


# memory.pyx:861-940: `alloc` calls the thread-local allocator that `cupy.cuda.using_allocator` sets,
# else the current one (CuPy's is the default pool's malloc, set by cupy/__init__.py at import)
_thread_local = threading.local()


def _get_thread_local_allocator():
    return getattr(_thread_local, "allocator", None)


def _set_thread_local_allocator(allocator):
    _thread_local.allocator = allocator


def alloc(size):
    """memory.pyx:892 `alloc`: what every new ndarray's memory comes from."""
    allocator = _get_thread_local_allocator()
    return (allocator or _DEFAULT_POOL.malloc)(size)


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


# ------------------------------------------------------------------ memory a CUDA graph addresses
# A graph keeps the addresses its captured work uses, not the arrays (cuda/graph.py): the pool may take
# a chunk back and hand it out again as CuPy does, but the harness allocation behind it stays until
# no graph addresses it. id(allocation) -> [allocation, graphs holding it, freed by the pool meanwhile]
_pinned = {}
launch_memory = []  # during a graph launch, the memory it addresses (for `host_view`)


def pin(raw):
    raw = getattr(raw, "base", raw)
    _pinned.setdefault(id(raw), [raw, 0, False])[1] += 1


def unpin(raw):
    raw = getattr(raw, "base", raw)
    entry = _pinned[id(raw)]
    entry[1] -= 1
    if not entry[1]:
        del _pinned[id(raw)]
        if entry[2]:
            raw.free()


def _free_raw(raw):
    entry = _pinned.get(id(raw))
    if entry is None:
        raw.free()
    else:
        entry[2] = True


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
    """The bytes [ptr, ptr + nbytes) of a live device array, as a writable NumPy uint8 view (while a CUDA
    graph launches: or of memory the graph holds, `launch_memory`)."""
    i = bisect.bisect_right(_starts, ptr) - 1
    mem = _blocks[_starts[i]]() if i >= 0 else None
    if mem is None or ptr < mem.ptr or ptr + nbytes > mem.ptr + mem.size:
        mem = next((m for m in reversed(launch_memory) if m.ptr <= ptr and ptr + nbytes <= m.ptr + m.size), None)
    if mem is None:
        raise ValueError(f"device address {ptr:#x} (+{nbytes} bytes) is not inside a live allocation")
    offset = ptr - mem.ptr
    return mem.host[offset: offset + nbytes], mem


def device_address(mem, arr):
    """The device address of arr's first element; arr is a NumPy view of mem.host."""
    return mem.ptr + (_host_address(arr) - _host_address(mem.host))


def empty_bytes_view(mem, nbytes, dtype, shape):
    return np.ndarray(shape, dtype=dtype, buffer=mem.host[:nbytes]) if nbytes else np.empty(shape, dtype)
