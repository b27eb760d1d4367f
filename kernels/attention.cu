// Causal grouped-query attention, fused: one kernel forward, two backward (FlashAttention-2's
// algorithm, with dQ in a pass of its own instead of atomics), on fp32 FMAs. Shared with the
// tensor-core kernels: attention.cuh; the tensor-core kernels: attention_wmma.cuh; RoPE: rope.cu.
// Nothing of size T x T, or of tile x T, is ever in global memory; statistics and arithmetic
// are fp32.
// Entry points per storage type T: <kernel>_f32 (float) and <kernel>_bf16 (bfloat16 bits).
//
// Layouts (token-major, what the projections produce and read; no transposes, no K/V repeat):
//   q, o, dq, do  [B, T, H, Dh]        k, v, dk, dv  [B, T, Hkv, Dh]
//   lse, delta    [B, H, T] fp32       query head h reads key/value head h / (H / Hkv)
// Dh <= ATTN_HEAD_DIM_MAX (128; the hd64_ entry points take Dh <= 64). scale = 1/sqrt(Dh) is applied in
// fp32 to q . k.
//
// Tile plan. A "row group" is ATTN_LANES_PER_ROW (forward, dQ) or ATTN_LANES_PER_KEY (dK/dV)
// consecutive lanes of one warp sharing one row; lane l of a group owns the head dims
// d = l, l + lanes, l + 2 lanes, ... in registers, and a dot product over Dh is the group's
// partial sums combined by xor shuffles inside the group (valid for 32- and 64-wide warps).
//
// attention_forward: one block per (b, h, 64-query tile), 256 threads = 64 rows x 4 lanes.
//   Registers: the row's scaled q (32 floats), its output accumulator (32), 16 scores.
//   Shared: K and V staged in the storage type, 32 KiB together (KeyTile): 64 keys of bf16 (a
//   64 x 64 tile), 32 keys of float. For each staged tile up to the tile's last query (causal:
//   later keys are never loaded) and each 16-key chunk of it: scores, the running max m and
//   sum l (online softmax: acc and l rescaled by exp(m - m')), acc += p V. Then o = acc / l and
//   lse = m + log(l) per row.
//   Global bytes, per (b, h, query tile of n rows ending at t1): reads n Dh of Q and t1 Dh of
//   K and of V, writes n Dh of O and 4n of lse - FlashAttention-2's forward traffic for
//   64-query tiles exactly (the key tile's width does not change it).
// attention_backward_dq: one block per (b, h, 64-query tile), the forward's rows and staging.
//   Registers: scaled q, dO, the dQ accumulator (3 x 32 floats; K is read from shared memory
//   again for dq += ds k rather than kept from the dot product, which would spill).
//   delta = rowsum(dO o O) first (written for the dK/dV pass), then key by key:
//   p = exp(s - lse), ds = p (dO . v - delta), dq += ds k; dq *= scale.
//   Global bytes per tile of n rows ending at t1: reads n Dh of Q, dO and O, 4n of lse, t1 Dh
//   of K and of V; writes n Dh of dQ and 4n of delta.
// attention_backward: one block per (b, kv head, 32-key tile), 256 threads = 32 keys x 8 lanes.
//   Registers: the key's k, v and its dK, dV accumulators (4 x 16 floats). Shared: a 16-query
//   tile of Q (unscaled) and of dO as fp32 (2 x 8 KiB), its lse and delta.
//   For each query head of the group and each 16-query tile from the key tile's first key to
//   T (causal: earlier queries never see these keys): p recomputed from lse, ds = p (dp - delta),
//   dv += p dO, dk += ds q; dK/dV are summed over the group's query heads in registers and
//   written once (dk *= scale).
//   Global bytes per (b, kv head, key tile of n keys starting at t0): reads n Dh of K and V,
//   and for each of the G query heads (T - t0) Dh of Q and of dO and 8 (T - t0) of lse and
//   delta; writes n Dh of dK and dV.
// Every kernel: 256 threads, at most 128 registers a thread and at most 32 KiB of shared
// memory, so two blocks fit an SM of sm_80 (64K registers) and a CU of gfx90a (64 KiB LDS).
// Shared-memory tiles are zero past Dh and past T, so dot products run over all the tile's HD
// dims without bounds tests. Each kernel is stamped for HD = 128 (<kernel>_<type>) and HD = 64
// (<kernel>_hd64_<type>, which the wrappers launch for Dh <= 64: half the registers and FMAs, and
// twice the staged keys in the forward and dQ). fp32 FMAs; the WMMA kernels of attention_wmma.cuh are an option.
// The sizes above are the default launch plan's (boostmpi/gpu/launch_plan.py, AttentionPlan), which the
// loader passes as -D options (ATTN_*; attention.cuh checks them); registers, shared memory and spills
// are measured by tests/kernels/test_kernel_resources.py (figures: bench/log/attention_traffic.md).
#include "common.cuh"
#include "attention.cuh"

// Keys of K and of V staged at a time by the forward and the dQ pass: 32 KiB of shared memory, so
// 64 keys of bf16 and 32 of float (two blocks still fit a 64 KiB gfx90a CU).
template <typename T, int HD>
struct KeyTile {
    static constexpr int KEYS = ATTN_KV_STAGE_BYTES / (2 * HD * static_cast<int>(sizeof(T)));
    static_assert(KEYS % ATTN_SCORE_CHUNK == 0, "whole score chunks per staged tile");
};

// Sum over the LANES consecutive lanes of a row group (every lane of the warp must call it).
template <int LANES>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int m = LANES / 2; m > 0; m >>= 1) v += shfl_xor(v, m);
    return v;
}

// One row of a [B, T, heads, Dh] tensor into this lane's dims (zeros where d >= Dh or !live); the
// dims below Dh are told apart as in store_row below: a lane mask per dim (d < Dh for each k)
// spills SGPRs of the dQ pass on gfx90a (32 dims a lane, three row loads).
template <typename T, int LANES, int DIMS>
__device__ __forceinline__ void load_row(float* out, const T* row, bool live, int lane, int Dh, float factor) {
    const int full = Dh / LANES;
    const bool in_tail = lane < Dh - full * LANES;
#pragma unroll
    for (int k = 0; k < DIMS; ++k) {
        out[k] = (live && (k < full || (k == full && in_tail))) ? to_float(row[k * LANES + lane]) * factor : 0.0f;
    }
}

// The lane's dims d = k LANES + lane below Dh: every k below Dh / LANES (a test uniform over the
// block), and at k = Dh / LANES the lanes below Dh % LANES: one 64-bit lane mask on gfx90a, not
// one per k (which stay alive from the loads to the store and spill SGPRs).
template <typename T, int LANES, int DIMS>
__device__ __forceinline__ void store_row(T* row, const float* in, int lane, int Dh, float factor) {
    const int full = Dh / LANES;
    const bool in_tail = lane < Dh - full * LANES;
#pragma unroll
    for (int k = 0; k < DIMS; ++k) {
        if (k < full || (k == full && in_tail)) row[k * LANES + lane] = from_float<T>(in[k] * factor);
    }
}

// This lane's share of x . tile_row, summed over the row group (both zero past Dh).
template <int LANES, int DIMS, typename S>
__device__ __forceinline__ float group_dot(const float* x, const S* tile_row, int lane) {
    float partial = 0.0f;
#pragma unroll
    for (int k = 0; k < DIMS; ++k) partial += x[k] * to_float(tile_row[k * LANES + lane]);
    return group_sum<LANES>(partial);
}

// acc += w * tile_row over this lane's dims.
template <int LANES, int DIMS, typename S>
__device__ __forceinline__ void axpy_row(float* acc, float w, const S* tile_row, int lane) {
#pragma unroll
    for (int k = 0; k < DIMS; ++k) acc[k] += w * to_float(tile_row[k * LANES + lane]);
}

// axpy_row reading the tile row through volatile loads: the compiler may not reuse values it
// loaded for an earlier dot product with the same row (registers it does not have).
__device__ __forceinline__ float reread(const float* p) { return *reinterpret_cast<const volatile float*>(p); }
__device__ __forceinline__ float reread(const bf16* p) {
    return __uint_as_float(static_cast<unsigned int>(*reinterpret_cast<const volatile unsigned short*>(p)) << 16);
}

template <int LANES, int DIMS, typename S>
__device__ __forceinline__ void axpy_row_reread(float* acc, float w, const S* tile_row, int lane) {
#pragma unroll
    for (int k = 0; k < DIMS; ++k) acc[k] += w * reread(tile_row + k * LANES + lane);
}

// The thread's query row in the forward and the dQ pass: block -> (b, h, 64-query tile), longest
// tile first; thread -> row i of the tile and lane of its row group.
struct QueryRow {
    int slice, b, h, kv_head, q0, i, lane;
    bool live;              // i < tokens (rows past T compute on zeros and store nothing)
    long long row_offset;   // (b, i, h, 0) in [B, T, H, Dh]; row 0 for a dead row
};

__device__ __forceinline__ QueryRow query_row(int tokens, int H, int Hkv, int Dh) {
    QueryRow r;
    int tile;
    tile_and_slice((tokens + ATTN_QUERY_TILE - 1) / ATTN_QUERY_TILE, true, &tile, &r.slice);
    r.b = r.slice / H;
    r.h = r.slice - r.b * H;
    r.kv_head = r.h / (H / Hkv);
    r.q0 = tile * ATTN_QUERY_TILE;
    r.lane = threadIdx.x % ATTN_LANES_PER_ROW;
    r.i = r.q0 + static_cast<int>(threadIdx.x) / ATTN_LANES_PER_ROW;
    r.live = r.i < tokens;
    r.row_offset = token_offset(r.b, r.live ? r.i : 0, tokens, H, r.h, Dh);
    return r;
}

template <typename T, int HD>
__device__ void attention_forward(const T* q, const T* k, const T* v, T* o, float* lse, int tokens, int H, int Hkv,
                                  int Dh, float scale) {
    constexpr int KEYS = KeyTile<T, HD>::KEYS, CHUNK = ATTN_SCORE_CHUNK;
    __shared__ T k_tile[KEYS][HD];
    __shared__ T v_tile[KEYS][HD];
    constexpr int LANES = ATTN_LANES_PER_ROW, DIMS = HD / LANES;
    const QueryRow r = query_row(tokens, H, Hkv, Dh);
    const int i = r.i, lane = r.lane;

    float q_row[DIMS], acc[DIMS];
    load_row<T, LANES, DIMS>(q_row, q + r.row_offset, r.live, lane, Dh, scale);
#pragma unroll
    for (int kk = 0; kk < DIMS; ++kk) acc[kk] = 0.0f;
    float running_max = negative_infinity(), running_sum = 0.0f;

    const int key_end = min(tokens, r.q0 + ATTN_QUERY_TILE);
    for (int k0 = 0; k0 < key_end; k0 += KEYS) {
        const int n = min(KEYS, key_end - k0);
        __syncthreads();  // every row is done with the previous tile
        load_tile<T, KEYS, HD>(k_tile, k, r.b, k0, key_end, tokens, Hkv, r.kv_head, Dh);
        load_tile<T, KEYS, HD>(v_tile, v, r.b, k0, key_end, tokens, Hkv, r.kv_head, Dh);
        __syncthreads();
        for (int c0 = 0; c0 < n; c0 += CHUNK) {  // one online-softmax step per chunk of the staged keys
            float s[ATTN_SCORE_CHUNK];
            float tile_max = negative_infinity();
#pragma unroll
            for (int jj = 0; jj < CHUNK; ++jj) {
                const float dot = group_dot<LANES, DIMS>(q_row, k_tile[c0 + jj], lane);
                s[jj] = (c0 + jj < n && k0 + c0 + jj <= i) ? dot : negative_infinity();
                tile_max = fmaxf(tile_max, s[jj]);
            }
            // key 0 is in the first chunk and visible to every row, so new_max is finite
            const float new_max = fmaxf(running_max, tile_max);
            const float rescale = expf(running_max - new_max);
            float tile_sum = 0.0f;
#pragma unroll
            for (int jj = 0; jj < CHUNK; ++jj) {
                s[jj] = expf(s[jj] - new_max);
                tile_sum += s[jj];
            }
            running_sum = running_sum * rescale + tile_sum;
            running_max = new_max;
#pragma unroll
            for (int kk = 0; kk < DIMS; ++kk) acc[kk] *= rescale;
#pragma unroll
            for (int jj = 0; jj < CHUNK; ++jj) axpy_row<LANES, DIMS>(acc, s[jj], v_tile[c0 + jj], lane);
        }
    }
    if (r.live) {
        store_row<T, LANES, DIMS>(o + r.row_offset, acc, lane, Dh, 1.0f / running_sum);
        if (lane == 0) lse[static_cast<long long>(r.slice) * tokens + i] = running_max + logf(running_sum);
    }
}

template <typename T, int HD>
__device__ void attention_backward_dq(const T* q, const T* k, const T* v, const T* o, const T* d_o, const float* lse,
                                      float* delta, T* dq, int tokens, int H, int Hkv, int Dh, float scale) {
    constexpr int KEYS = KeyTile<T, HD>::KEYS;
    __shared__ T k_tile[KEYS][HD];
    __shared__ T v_tile[KEYS][HD];
    constexpr int LANES = ATTN_LANES_PER_ROW, DIMS = HD / LANES;
    const QueryRow r = query_row(tokens, H, Hkv, Dh);
    const int i = r.i, lane = r.lane;
    const long long stat = static_cast<long long>(r.slice) * tokens + (r.live ? i : 0);

    float q_row[DIMS], do_row[DIMS], acc[DIMS];
    load_row<T, LANES, DIMS>(do_row, d_o + r.row_offset, r.live, lane, Dh, 1.0f);
    load_row<T, LANES, DIMS>(acc, o + r.row_offset, r.live, lane, Dh, 1.0f);  // o, only for delta
    float partial = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DIMS; ++kk) partial += do_row[kk] * acc[kk];
    const float row_delta = group_sum<LANES>(partial);  // rowsum(dO o O) = rowsum(P o dP)
    if (r.live && lane == 0) delta[stat] = row_delta;
    load_row<T, LANES, DIMS>(q_row, q + r.row_offset, r.live, lane, Dh, scale);
#pragma unroll
    for (int kk = 0; kk < DIMS; ++kk) acc[kk] = 0.0f;
    // one lane reads the statistic, the xor-sum with the others' zeros hands it to the group exactly
    const float row_lse = group_sum<LANES>(r.live && lane == 0 ? lse[stat] : 0.0f);

    const int key_end = min(tokens, r.q0 + ATTN_QUERY_TILE);
    for (int k0 = 0; k0 < key_end; k0 += KEYS) {
        const int n = min(KEYS, key_end - k0);
        __syncthreads();
        load_tile<T, KEYS, HD>(k_tile, k, r.b, k0, key_end, tokens, Hkv, r.kv_head, Dh);
        load_tile<T, KEYS, HD>(v_tile, v, r.b, k0, key_end, tokens, Hkv, r.kv_head, Dh);
        __syncthreads();
        for (int jj = 0; jj < n; ++jj) {  // n is the same for the whole block: the shuffles stay uniform
            const float s = group_dot<LANES, DIMS>(q_row, k_tile[jj], lane);
            const float dp = group_dot<LANES, DIMS>(do_row, v_tile[jj], lane);
            const float p = k0 + jj <= i ? expf(s - row_lse) : 0.0f;
            // K read again from shared memory: kept in registers from the dot product, it spills
            axpy_row_reread<LANES, DIMS>(acc, p * (dp - row_delta), k_tile[jj], lane);
        }
    }
    if (r.live) store_row<T, LANES, DIMS>(dq + r.row_offset, acc, lane, Dh, scale);
}

template <typename T, int HD>
__device__ void attention_backward(const T* q, const T* k, const T* v, const T* d_o, const float* lse,
                                   const float* delta, T* dk, T* dv, int tokens, int H, int Hkv, int Dh, float scale) {
    __shared__ float q_tile[ATTN_BWD_QUERY_TILE][HD];
    __shared__ float do_tile[ATTN_BWD_QUERY_TILE][HD];
    __shared__ float lse_tile[ATTN_BWD_QUERY_TILE];
    __shared__ float delta_tile[ATTN_BWD_QUERY_TILE];
    constexpr int LANES = ATTN_LANES_PER_KEY, DIMS = HD / LANES;
    int tile, slice;
    tile_and_slice((tokens + ATTN_BWD_KEY_TILE - 1) / ATTN_BWD_KEY_TILE, false, &tile, &slice);
    const int b = slice / Hkv, kv_head = slice - b * Hkv, G = H / Hkv;
    const int k0 = tile * ATTN_BWD_KEY_TILE;
    const int lane = threadIdx.x % LANES;
    const int j = k0 + static_cast<int>(threadIdx.x) / LANES;
    const bool live = j < tokens;
    const long long key_offset = token_offset(b, live ? j : 0, tokens, Hkv, kv_head, Dh);

    float k_row[DIMS], v_row[DIMS], dk_acc[DIMS], dv_acc[DIMS];
    load_row<T, LANES, DIMS>(k_row, k + key_offset, live, lane, Dh, 1.0f);
    load_row<T, LANES, DIMS>(v_row, v + key_offset, live, lane, Dh, 1.0f);
#pragma unroll
    for (int kk = 0; kk < DIMS; ++kk) dk_acc[kk] = dv_acc[kk] = 0.0f;

    for (int g = 0; g < G; ++g) {
        const int h = kv_head * G + g;
        const long long stats = (static_cast<long long>(b) * H + h) * tokens;
        for (int i0 = k0; i0 < tokens; i0 += ATTN_BWD_QUERY_TILE) {
            const int n = min(ATTN_BWD_QUERY_TILE, tokens - i0);
            __syncthreads();
            load_tile<T, ATTN_BWD_QUERY_TILE, HD>(q_tile, q, b, i0, tokens, tokens, H, h, Dh);
            load_tile<T, ATTN_BWD_QUERY_TILE, HD>(do_tile, d_o, b, i0, tokens, tokens, H, h, Dh);
            const int r = static_cast<int>(threadIdx.x);
            if (r < n) {
                lse_tile[r] = lse[stats + i0 + r];
                delta_tile[r] = delta[stats + i0 + r];
            }
            __syncthreads();
            for (int ii = 0; ii < n; ++ii) {  // uniform over the block
                const float s = scale * group_dot<LANES, DIMS>(k_row, q_tile[ii], lane);
                const float dp = group_dot<LANES, DIMS>(v_row, do_tile[ii], lane);
                const float p = (live && j <= i0 + ii) ? expf(s - lse_tile[ii]) : 0.0f;
                axpy_row<LANES, DIMS>(dv_acc, p, do_tile[ii], lane);
                axpy_row<LANES, DIMS>(dk_acc, p * (dp - delta_tile[ii]), q_tile[ii], lane);
            }
        }
    }
    if (live) {
        store_row<T, LANES, DIMS>(dk + key_offset, dk_acc, lane, Dh, scale);
        store_row<T, LANES, DIMS>(dv + key_offset, dv_acc, lane, Dh, 1.0f);
    }
}

// HD: the head dims a tile holds (Dh <= HD); "" for ATTN_HEAD_DIM_MAX, "hd64_" for ATTN_HEAD_DIM_SMALL (half the
// work and staging)
#define ATTENTION_ENTRY_POINTS(T, HD, PREFIX, SUFFIX)                                                              \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_BLOCKS_PER_SM)                                 \
        attention_forward_##PREFIX##SUFFIX(const T* q, const T* k, const T* v, T* o, float* lse, int tokens, int H, \
                                           int Hkv, int Dh, float scale) {                                          \
        attention_forward<T, HD>(q, k, v, o, lse, tokens, H, Hkv, Dh, scale);                                      \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_BLOCKS_PER_SM)                                 \
        attention_backward_dq_##PREFIX##SUFFIX(const T* q, const T* k, const T* v, const T* o, const T* d_o,         \
                                               const float* lse, float* delta, T* dq, int tokens, int H, int Hkv,  \
                                               int Dh, float scale) {                                               \
        attention_backward_dq<T, HD>(q, k, v, o, d_o, lse, delta, dq, tokens, H, Hkv, Dh, scale);                  \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_BLOCKS_PER_SM)                                 \
        attention_backward_##PREFIX##SUFFIX(const T* q, const T* k, const T* v, const T* d_o, const float* lse,     \
                                            const float* delta, T* dk, T* dv, int tokens, int H, int Hkv, int Dh,  \
                                            float scale) {                                                          \
        attention_backward<T, HD>(q, k, v, d_o, lse, delta, dk, dv, tokens, H, Hkv, Dh, scale);                    \
    }

ATTENTION_ENTRY_POINTS(float, ATTN_HEAD_DIM_MAX, , f32)
ATTENTION_ENTRY_POINTS(bf16, ATTN_HEAD_DIM_MAX, , bf16)
ATTENTION_ENTRY_POINTS(float, ATTN_HEAD_DIM_SMALL, hd64_, f32)
ATTENTION_ENTRY_POINTS(bf16, ATTN_HEAD_DIM_SMALL, hd64_, bf16)

// The tensor-core kernels, with -DBOOSTMPI_ATTENTION_WMMA only (the wrapper's choice: boostmpi/gpu/tensor_cores.py)
#ifdef BOOSTMPI_ATTENTION_WMMA
#include "attention_wmma.cuh"
#endif

