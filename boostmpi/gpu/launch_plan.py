"""The launch geometry of the kernels in `kernels/`: one frozen plan per kernel family.

A plan is the one place a tile size is written. The loader (boostmpi.gpu.kernels) compiles each
kernel file with its plan's sizes as `-D` options (`compile_options`) and launches it with the
grids and blocks the same plan gives; the kernel sources only check that the sizes were passed
(`#ifndef` -> `#error`) and that they fit together (`static_assert`), so a build without the plan
fails, and a plan whose sizes disagree with what a kernel assumes does not compile. The tests
compile and launch through the same functions; a test that wants another geometry replaces the
module's plan (`dataclasses.replace(launch_plan.ATTENTION, ...)`), and kernels, wrappers and the
test's own arithmetic follow it together.
"""

import dataclasses
from dataclasses import dataclass

COMPILE_OPTIONS = ("-std=c++14",)
WMMA_OPTION = "-DBOOSTMPI_ATTENTION_WMMA"  # the attention's tensor-core kernels (kernels/attention_wmma.cuh)
# the most threads a block may have (CUDA and HIP alike); common.cuh's MAX_BLOCK_THREADS, held equal by a test
MAX_BLOCK_THREADS = 1024
ELEMENTWISE_BLOCK_THREADS = 256  # grid-stride kernels: lowrank.cu, adamw.cu, rope.cu
ELEMENTWISE_BLOCKS_PER_SM = 16  # at most this many blocks of a grid-stride kernel per SM
DEFAULT_DYNAMIC_SHARED_BYTES = 48 * 1024  # static + dynamic shared memory per block; above it a kernel must opt in


@dataclass(frozen=True)
class RmsnormPlan:
    """rmsnorm.cu (and btp_backward_post, which runs rmsnorm_backward's column tiles).

    rmsnorm_forward holds a row in registers, up to `held_vectors` 16-byte vectors a thread (the
    kernel's RMSNORM_ROW_VECTORS); the launcher aims at `forward_vectors` of them a thread (at most
    `held_vectors`) in at most `forward_max_threads` threads. The backward's column tiles are one
    16-byte vector a thread, at most `backward_block_threads` threads, over row chunks cut so that
    the grid has about `backward_blocks_per_sm` blocks per SM."""

    held_vectors: int = 4
    forward_vectors: int = 4
    forward_max_threads: int = 512  # the row in registers: 2 blocks per SM at up to 64 registers
    backward_block_threads: int = 256
    backward_blocks_per_sm: int = 8  # 2,048 threads, the most an SM (CU: 4 SIMDs x 8 waves of 64) holds
    # dw_accumulate: `dw_columns` columns a block, each summed over the chunks by `dw_row_groups` threads
    dw_columns: int = 32
    dw_row_groups: int = 16

    def defines(self) -> tuple[str, ...]:
        return (f"-DRMSNORM_ROW_VECTORS={self.held_vectors}", f"-DDW_COLUMNS={self.dw_columns}",
                f"-DDW_ROW_GROUPS={self.dw_row_groups}")


@dataclass(frozen=True)
class AttentionPlan:
    """attention.cu (the FMA kernels) and attention_wmma.cuh (the tensor-core kernels).

    FMA kernels: a row group of `lanes_per_row` lanes per query row, `query_tile` rows a block
    (forward and dQ); `lanes_per_key` lanes per key, `bwd_key_tile` keys a block (dK/dV), which
    stages `bwd_query_tile` queries at a time; K and V staged in `kv_stage_bytes` of shared memory,
    `score_chunk` scores in registers per online-softmax step. Every FMA kernel runs `threads`
    threads, the tensor-core ones `tc_threads` (`tc_warps` warps of 32 lanes); `blocks_per_sm` is
    their __launch_bounds__ minimum. Tiles hold `head_dim_max` head dims, or `head_dim_small` in the
    hd64_ entry points the wrappers launch for head dims up to that."""

    head_dim_max: int = 128
    head_dim_small: int = 64
    threads: int = 256
    lanes_per_row: int = 4
    query_tile: int = 64  # forward and dQ, FMA and tensor-core kernels alike
    kv_stage_bytes: int = 32768
    score_chunk: int = 16
    lanes_per_key: int = 8
    bwd_key_tile: int = 32
    bwd_query_tile: int = 16
    blocks_per_sm: int = 2  # at most 128 registers a thread at 256 threads (sm_80)
    tc_warps: int = 4
    tc_keys: int = 64  # tensor-core forward: keys staged at a time
    tc_bwd_keys: int = 64  # tensor-core dK/dV: keys a block
    tc_bwd_queries: int = 16  # tensor-core dK/dV: queries staged at a time
    tc_dq_keys: int = 32  # tensor-core dQ: keys staged at a time

    @property
    def tc_threads(self) -> int:
        return 32 * self.tc_warps

    def defines(self) -> tuple[str, ...]:
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        sizes["tc_threads"] = self.tc_threads
        return tuple(f"-DATTN_{name.upper()}={value}" for name, value in sizes.items())

    def head_tile(self, Dh: int) -> int:
        """The head dims the kernels' tiles hold for head dim Dh (the work is done over all of them)."""
        return self.head_dim_small if Dh <= self.head_dim_small else self.head_dim_max

    def entry(self, kernel: str, Dh: int, suffix: str) -> str:
        """The entry point that runs `kernel` at head dim Dh: the hd64_ variants up to head_dim_small
        dims (the FMA kernels and the tensor-core ones, `<kernel>_tc`, alike)."""
        return f"{kernel}_{'hd64_' if self.head_tile(Dh) == self.head_dim_small else ''}{suffix}"

    def traffic(self, B: int, T: int, H: int, Hkv: int, Dh: int, itemsize: int,
                tensor_cores: bool = False) -> dict[str, tuple[int, int]]:
        """{launch: (bytes read, bytes written)} of global memory, as the tile plan moves them
        (kernels/attention.cu, opening comment): each causal query tile reads K and V up to its last
        query, each key tile reads Q and dO (and the two fp32 statistics) from its first key on. The
        tensor-core kernels move the same bytes but for their dK/dV pass's wider key tiles."""
        s, G = itemsize, H // Hkv
        key_tile = self.tc_bwd_keys if tensor_cores else self.bwd_key_tile

        def tiles(width: int) -> list[tuple[int, int]]:
            return [(t0, min(T, t0 + width)) for t0 in range(0, T, width)]

        forward = sum((t1 - t0) * Dh * s + 2 * t1 * Dh * s for t0, t1 in tiles(self.query_tile))
        dq = sum(3 * (t1 - t0) * Dh * s + 4 * (t1 - t0) + 2 * t1 * Dh * s for t0, t1 in tiles(self.query_tile))
        dkdv = sum(2 * (t1 - t0) * Dh * s + G * (T - t0) * (2 * Dh * s + 8) for t0, t1 in tiles(key_tile))
        return {"forward": (B * H * forward, B * H * T * (Dh * s + 4)),
                "backward_dq": (B * H * dq, B * H * T * (Dh * s + 4)),
                "backward_dkdv": (B * Hkv * dkdv, B * Hkv * T * 2 * Dh * s)}


RMSNORM = RmsnormPlan()
ATTENTION = AttentionPlan()


def defines(name: str) -> tuple[str, ...]:
    """The -D options of kernels/<name>.cu's plan (none for a file without one)."""
    if name == "attention":
        return ATTENTION.defines()
    if name == "rmsnorm":
        return RMSNORM.defines()
    return ()


def compile_options(name: str, warp_size: int, wmma: bool = False) -> tuple[str, ...]:
    """Everything kernels/<name>.cu is compiled with, for a device of `warp_size` lanes: the
    language standard, the warp width, the plan's sizes and (`wmma`, attention only) the
    tensor-core kernels' switch. The loader's RawModule options and the tests' compiles alike."""
    return COMPILE_OPTIONS + (f"-DWARP_SIZE={warp_size}",) + defines(name) + ((WMMA_OPTION,) if wmma else ())


# ------------------------------------------------------------------------------ launch shapes


def row_block(width: int, itemsize: int, warp_size: int) -> int:
    """Threads for one block per row: one 16-byte vector each, whole warps, at most MAX_BLOCK_THREADS."""
    vectors = -(-width // (16 // itemsize))
    warps = -(-vectors // warp_size)
    return warp_size * min(max(warps, 1), MAX_BLOCK_THREADS // warp_size)


def elementwise_grid(n: int, itemsize: int, sm_count: int) -> int:
    """Blocks for a grid-stride elementwise kernel: enough to cover n, at most ELEMENTWISE_BLOCKS_PER_SM per SM."""
    per_block = ELEMENTWISE_BLOCK_THREADS * (16 // itemsize)
    return max(1, min(-(-n // per_block), ELEMENTWISE_BLOCKS_PER_SM * sm_count))


def rope_grid(pairs: int, sm_count: int) -> int:
    """Blocks of rope.cu's grid-stride loop, one pair of elements per thread and pass."""
    return max(1, min(-(-pairs // ELEMENTWISE_BLOCK_THREADS), ELEMENTWISE_BLOCKS_PER_SM * sm_count))


def rmsnorm_forward_threads(C: int, itemsize: int, warp_size: int) -> int:
    """Threads of rmsnorm_forward's one block per row: whole warps covering the row's 16-byte
    vectors RMSNORM.forward_vectors per thread, at most RMSNORM.forward_max_threads (the kernel
    holds up to RMSNORM.held_vectors per thread in registers; a wider row takes its two-pass loop)."""
    vectors = -(-C // (16 // itemsize))
    warps = -(-vectors // (RMSNORM.forward_vectors * warp_size))
    return warp_size * min(max(warps, 1), RMSNORM.forward_max_threads // warp_size)


def dw_accumulate_launch(C: int) -> tuple[int, int]:
    """(blocks, threads) of dw_accumulate over C columns: RMSNORM.dw_columns columns a block, each
    summed by RMSNORM.dw_row_groups threads."""
    return -(-C // RMSNORM.dw_columns), RMSNORM.dw_columns * RMSNORM.dw_row_groups


def rmsnorm_backward_launch(N: int, C: int, itemsize: int, warp_size: int, sm_count: int) -> tuple[int, int, int, int]:
    """The launch of the column-tile kernels (rmsnorm_backward, btp_backward_post) over [N, C]:
    (threads per block, column tiles, rows per chunk, row chunks).

    A block owns a tile of one 16-byte vector of columns per thread (at most
    RMSNORM.backward_block_threads threads) over a chunk of rows; the rows are cut into chunks so
    that the grid has about RMSNORM.backward_blocks_per_sm blocks per SM (fewer chunks when there
    are fewer rows)."""
    threads = min(row_block(C, itemsize, warp_size), RMSNORM.backward_block_threads)
    tiles = -(-C // (threads * (16 // itemsize)))
    chunks = max(1, min(N, -(-RMSNORM.backward_blocks_per_sm * sm_count // tiles)))
    rows_per_chunk = -(-N // chunks)
    return threads, tiles, rows_per_chunk, -(-N // rows_per_chunk)
