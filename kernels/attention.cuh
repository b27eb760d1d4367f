// What the attention kernels share (attention.cu's FMA kernels, attention_wmma.cuh's tensor-core
// ones): the launch plan's sizes, the [B, T, heads, Dh] indexing, the staging of a tile of rows in
// shared memory, and the order blocks take their tiles in. Included by attention.cu after common.cuh.
//
// The tile sizes are not written here: the loader passes them as -D options from one launch plan
// (boostmpi/gpu/launch_plan.py, AttentionPlan: ATTN_<FIELD> for each field), which also gives the
// wrappers their grids and blocks. A build without them stops here; sizes that do not fit together
// stop at the static_asserts below.
#ifndef BOOSTMPI_ATTENTION_CUH
#define BOOSTMPI_ATTENTION_CUH

#if !defined(ATTN_HEAD_DIM_MAX) || !defined(ATTN_HEAD_DIM_SMALL) || !defined(ATTN_THREADS) || \
    !defined(ATTN_LANES_PER_ROW) || !defined(ATTN_QUERY_TILE) || !defined(ATTN_KV_STAGE_BYTES) || \
    !defined(ATTN_SCORE_CHUNK) || !defined(ATTN_LANES_PER_KEY) || !defined(ATTN_BWD_KEY_TILE) || \
    !defined(ATTN_BWD_QUERY_TILE) || !defined(ATTN_BLOCKS_PER_SM)
#error "the attention kernels take their tile sizes from the launch plan: compile with boostmpi.gpu.launch_plan.compile_options(\"attention\", ...)"
#endif
static_assert(ATTN_QUERY_TILE * ATTN_LANES_PER_ROW == ATTN_THREADS, "forward, dQ: one row group per query");
static_assert(ATTN_BWD_KEY_TILE * ATTN_LANES_PER_KEY == ATTN_THREADS, "dK/dV: one row group per key");
static_assert(ATTN_BWD_QUERY_TILE <= ATTN_THREADS, "dK/dV: one thread per staged statistic");
static_assert(ATTN_HEAD_DIM_SMALL <= ATTN_HEAD_DIM_MAX, "the hd64_ entry points' tiles hold fewer dims");

// Element offset of (b, t, head, 0) in a [B, T, heads, Dh] tensor, in 64 bits.
__device__ __forceinline__ long long token_offset(int b, int t, int tokens, int heads, int head, int Dh) {
    return ((static_cast<long long>(b) * tokens + t) * heads + head) * Dh;
}

// A value of storage type T as a shared tile of type S holds it: converted to fp32, or copied.
template <typename S, typename T>
struct Staged {
    static __device__ __forceinline__ S of(T v) { return from_float<S>(to_float(v)); }
};
template <typename T>
struct Staged<T, T> {
    static __device__ __forceinline__ T of(T v) { return v; }
};

// Rows t0 .. t0+ROWS-1 of one head of a [B, T, heads, Dh] tensor into tile[r][d] (S: fp32, or the
// storage type itself); rows at or past t_end (at most `tokens`: a causal tile's last key), and dims
// at or past Dh, are zeros and never read from global memory, so the dot
// products and accumulations over ATTN_HEAD_DIM_MAX dims need no per-element bounds test (which
// costs registers). Every thread of the block calls it.
template <typename T, int ROWS, int HD, typename S>
__device__ void load_tile(S (*tile)[HD], const T* src, int b, int t0, int t_end, int tokens, int heads, int head,
                          int Dh) {
    for (int e = threadIdx.x; e < ROWS * HD; e += blockDim.x) {
        const int r = e / HD;
        const int d = e % HD;
        const int t = t0 + r;
        tile[r][d] = (t < t_end && d < Dh) ? Staged<S, T>::of(src[token_offset(b, t, tokens, heads, head, Dh) + d])
                                            : from_float<S>(0.0f);
    }
}

// A 1-D grid of n_tiles blocks per (batch, head) slice. Causal tiles differ in work; they are
// handed out longest first: the last query tile (meets the most keys) in the forward and dQ,
// the first key tile (seen by the most queries) in dK/dV.
__device__ __forceinline__ void tile_and_slice(int n_tiles, bool last_first, int* tile, int* slice) {
    *slice = static_cast<int>(blockIdx.x) / n_tiles;
    const int x = static_cast<int>(blockIdx.x) - *slice * n_tiles;
    *tile = last_first ? n_tiles - 1 - x : x;
}

#endif  // BOOSTMPI_ATTENTION_CUH
