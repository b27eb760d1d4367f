"""The stand-in's memory pool follows CuPy 14.2.0's `SingleDeviceMemoryPool` rule by rule.

Each test runs a sequence of malloc/free on a fresh pool whose `used_bytes`, `total_bytes` and
`n_free_blocks` CuPy's algorithm (cupy/cuda/memory.pyx at tag v14.2.0) determines, worked out in the
test's comments; each has a mutant (the rule switched off in the stand-in) that the same check
refuses. A KiB here is 1024 bytes, two allocation units of 512.
"""

import gc

import pytest

from tests.support.gpu_setup import GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="checks the CuPy stand-in; a real GPU is in use")]

K = 1024


@pytest.fixture
def memory():
    import cupy  # noqa: F401  (the stand-in's package, which _memory belongs to)
    from cupy import _memory

    return _memory


def _counts(pool):
    return pool.used_bytes(), pool.total_bytes(), pool.n_free_blocks()


def check_rounding(memory):
    """memory.pyx:1042 `_round_size`: every request up to a multiple of 512; 0 bytes take no pool memory."""
    pool = memory.MemoryPool()
    held = [pool.malloc(n) for n in (1, 512, 513, 1000)]
    assert [m.size for m in held] == [512, 512, 1024, 1024]
    assert _counts(pool) == (3 * K, 3 * K, 0)
    zero = pool.malloc(0)
    assert zero.size == 0 and _counts(pool) == (3 * K, 3 * K, 0)


def check_split(memory):
    """A request takes a larger free chunk and splits it (memory.pyx:1179, `_Chunk.split` 422): four
    1 KiB requests after a 4 KiB block is freed come out of it, with no new allocation."""
    pool = memory.MemoryPool()
    del_me = pool.malloc(4 * K)
    del del_me
    assert _counts(pool) == (0, 4 * K, 1)
    first = pool.malloc(K)
    assert _counts(pool) == (K, 4 * K, 1)  # 1 KiB in use, the other 3 KiB one free chunk
    rest = [pool.malloc(K) for _ in range(3)]
    assert _counts(pool) == (4 * K, 4 * K, 0)
    return first, rest


def check_best_fit(memory):
    """memory.pyx:1171 `lower_bound`: the smallest free chunk that fits. Free chunks of 4 KiB and
    2 KiB: 1.5 KiB comes from the 2 KiB one, so a 4 KiB request still finds its chunk (a pool taking
    from the larger chunk would have to allocate 4 KiB more)."""
    pool = memory.MemoryPool()
    a, b = pool.malloc(4 * K), pool.malloc(2 * K)
    del a, b
    small = pool.malloc(3 * 512)
    big = pool.malloc(4 * K)
    assert _counts(pool) == (3 * 512 + 4 * K, 6 * K, 1)  # the 512-byte rest of the 2 KiB chunk is free
    return small, big


def check_merge(memory):
    """memory.pyx:1096 `try_merge_chunk`: a freed chunk merges with the free chunk after it and the
    one before it in its allocation. A 4 KiB block split into a, b, c, d: c, then b (merges with c),
    then d (merges with b+c before it) freed leave one 3 KiB chunk, which a 3 KiB request takes."""
    pool = memory.MemoryPool()
    block = pool.malloc(4 * K)
    del block
    a, b, c, d = (pool.malloc(K) for _ in range(4))
    del c
    del b
    assert _counts(pool) == (2 * K, 4 * K, 1)
    del d
    assert _counts(pool) == (K, 4 * K, 1)
    again = pool.malloc(3 * K)
    assert _counts(pool) == (4 * K, 4 * K, 0)
    return a, again


def check_free_all_blocks(memory):
    """memory.pyx:1114 `free_all` (1125): only free chunks that are a whole allocation go back to the
    device; the free part of a split allocation stays until the allocation is whole again."""
    pool = memory.MemoryPool()
    whole, split = pool.malloc(2 * K), pool.malloc(4 * K)
    del whole, split
    part = pool.malloc(K)  # from the 2 KiB chunk (best fit): 1 KiB of it stays free, split
    pool.free_all_blocks()
    assert _counts(pool) == (K, 2 * K, 1)  # the whole 4 KiB allocation went back, the split one stayed
    del part
    pool.free_all_blocks()
    assert _counts(pool) == (0, 0, 0)


def check_arena_per_stream(memory):
    """memory.pyx:1361-1370: each stream has its own arena; a chunk freed on one stream is not taken by
    a request on another, which allocates anew (memory.pyx:1374)."""
    import cupy

    pool = memory.MemoryPool()
    freed = pool.malloc(4 * K)
    del freed
    with cupy.cuda.Stream(non_blocking=True):
        other = pool.malloc(K)
        assert _counts(pool) == (K, 5 * K, 1)
    same = pool.malloc(K)
    assert _counts(pool) == (2 * K, 5 * K, 1)
    return other, same


def check_high_water_marks(memory):
    """`total_bytes` is what the pool holds (memory.pyx:1461), `used_bytes` what it hands out (1454):
    after 3 MiB is freed, requests of 1 MiB and 2 MiB reuse it (split), so the most held stays 3 MiB."""
    pool = memory.MemoryPool()
    mib = K * K
    block = pool.malloc(3 * mib)
    del block
    pool.standin_reset_peaks()
    one, two = pool.malloc(mib), pool.malloc(2 * mib)
    peaks = pool.standin_peaks()
    assert (peaks["used"], peaks["total"], peaks["largest"], peaks["mallocs"]) == (3 * mib, 3 * mib, 2 * mib, 2)
    assert pool.free_bytes() == 0
    return one, two


def check_limit(memory):
    """memory.pyx:1518 `_try_malloc`: a new allocation over the limit first gives the free whole blocks
    back (`free_all_blocks`) and tries again; only then OutOfMemoryError (1476: larger than the limit)."""
    pool = memory.MemoryPool()
    pool.set_limit(size=8 * K)
    kept, cached = pool.malloc(4 * K), pool.malloc(2 * K)
    del cached
    assert _counts(pool) == (4 * K, 6 * K, 1)
    more = pool.malloc(3 * K)  # 6 + 3 > 8 KiB: the free 2 KiB block goes back, then 4 + 3 fits
    assert _counts(pool) == (7 * K, 7 * K, 0)
    with pytest.raises(memory.OutOfMemoryError, match="Out of memory allocating 9,216 bytes"):
        pool.malloc(9 * K)
    return kept, more


CHECKS = {"rounding": check_rounding, "split": check_split, "best_fit": check_best_fit,
          "merge": check_merge, "free_all_blocks": check_free_all_blocks,
          "arena_per_stream": check_arena_per_stream, "high_water_marks": check_high_water_marks,
          "limit": check_limit}


@pytest.mark.parametrize("rule", sorted(CHECKS))
def test_pool_follows_cupy(memory, rule):
    CHECKS[rule](memory)
    gc.collect()


# the mutants: each rule switched off (or replaced by what a simpler pool does)
def _no_split(self, size):
    return None


def _exact_size_only(self, size):
    """The stand-in's former rule: a freed block serves only a request of its own rounded size."""
    for key in self.keys:
        if key[0] == size:
            chunk = self.chunks[key]
            self._remove(key)
            return chunk
    return None


def _largest_first(self, size):
    if not self.keys or self.keys[-1][0] < size:
        return None
    key = self.keys[-1]
    chunk = self.chunks[key]
    self._remove(key)
    rest = chunk.split(size)
    if rest is not None:
        self.insert_chunk(rest, merge=False)
    return chunk


def _insert_unmerged(original):
    def insert_chunk(self, chunk, merge=True):
        return original(self, chunk, merge=False)
    return insert_chunk


def _one_arena(original):
    def _arena(self, ident):
        return original(self, 0)
    return _arena


def _free_all_split_too(self):
    freed = 0
    for key in list(self.keys):
        chunk = self.chunks[key]
        self._remove(key)
        freed += chunk.size
    return freed


MUTANTS = {
    "rounding": lambda m, mp: mp.setattr(m, "_round_size", lambda size: max(int(size), 1)),
    "split": lambda m, mp: mp.setattr(m._Chunk, "split", _no_split),
    "best_fit": lambda m, mp: mp.setattr(m._Arena, "get_chunk", _largest_first),
    "merge": lambda m, mp: mp.setattr(m._Arena, "insert_chunk", _insert_unmerged(m._Arena.insert_chunk)),
    "free_all_blocks": lambda m, mp: mp.setattr(m._Arena, "free_all", _free_all_split_too),
    "arena_per_stream": lambda m, mp: mp.setattr(m.MemoryPool, "_arena", _one_arena(m.MemoryPool._arena)),
    "high_water_marks": lambda m, mp: mp.setattr(m._Arena, "get_chunk", _exact_size_only),
    "limit": lambda m, mp: mp.setattr(m.MemoryPool, "free_all_blocks", lambda self, stream=None: None),
}


@pytest.mark.parametrize("rule", sorted(CHECKS))
def test_mutant_pool_rule_fails_its_check(memory, monkeypatch, rule):
    """The check of each rule fails on a pool without the rule (and passes on the real one)."""
    CHECKS[rule](memory)
    gc.collect()
    with monkeypatch.context() as mp:
        MUTANTS[rule](memory, mp)
        with pytest.raises((AssertionError, memory.OutOfMemoryError)):
            CHECKS[rule](memory)
        gc.collect()
