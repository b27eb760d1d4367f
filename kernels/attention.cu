// Causal grouped-query attention, fused: one kernel forward, two backward (FlashAttention-2's
// algorithm, with dQ in a pass of its own instead of atomics); and RoPE, one pass each way.
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
// twice the staged keys in the forward and dQ). fp32 FMAs; the WMMA kernels at the end are an option.
// Resources (NVRTC 12.9's ptxas report, sm_80 / sm_90; tests/kernels/test_kernel_resources.py checks them):
// registers a thread, forward 128 / 128, dQ 128 / 128, dK/dV 122 / 128; shared memory 32768,
// 32768, 16512 bytes; no spills. gfx90a (hipcc of ROCm 5.2): 158-172, 154-157, 120 VGPRs; 42, 46,
// 58 SGPRs; no SGPR or VGPR spills, no scratch; 2, 2 and 3 blocks per CU (LDS-bound).
// hd64_: registers 96-123, 92-96, 72-86; shared memory 32768, 32768, 8320 bytes; gfx90a 86-127,
// 89, 71 VGPRs, 2, 2 and 7 blocks per CU.
#include "common.cuh"

#define ATTN_HEAD_DIM_MAX 128
#define ATTN_THREADS 256  // every attention kernel's block (the wrapper launches this many)
#define ATTN_LANES_PER_ROW 4
#define ATTN_QUERY_TILE 64  // forward and dQ: 64 rows x 4 lanes
#define ATTN_KV_STAGE_BYTES 32768  // the K and V tiles staged in shared memory, in the storage type
#define ATTN_SCORE_CHUNK 16  // forward: scores held in registers at a time (one online-softmax step)
#define ATTN_LANES_PER_KEY 8
#define ATTN_BWD_KEY_TILE 32
#define ATTN_BWD_QUERY_TILE 16
// at least two resident blocks per SM: at most 128 registers a thread (sm_80)
#define ATTN_BLOCKS_PER_SM 2
static_assert(ATTN_QUERY_TILE * ATTN_LANES_PER_ROW == ATTN_THREADS, "forward, dQ: one row group per query");
static_assert(ATTN_BWD_KEY_TILE * ATTN_LANES_PER_KEY == ATTN_THREADS, "dK/dV: one row group per key");
static_assert(ATTN_BWD_QUERY_TILE <= ATTN_THREADS, "dK/dV: one thread per staged statistic");

// Element offset of (b, t, head, 0) in a [B, T, heads, Dh] tensor, in 64 bits.
__device__ __forceinline__ long long token_offset(int b, int t, int tokens, int heads, int head, int Dh) {
    return ((static_cast<long long>(b) * tokens + t) * heads + head) * Dh;
}

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

// A 1-D grid of n_tiles blocks per (batch, head) slice. Causal tiles differ in work; they are
// handed out longest first: the last query tile (meets the most keys) in the forward and dQ,
// the first key tile (seen by the most queries) in dK/dV.
__device__ __forceinline__ void tile_and_slice(int n_tiles, bool last_first, int* tile, int* slice) {
    *slice = static_cast<int>(blockIdx.x) / n_tiles;
    const int x = static_cast<int>(blockIdx.x) - *slice * n_tiles;
    *tile = last_first ? n_tiles - 1 - x : x;
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

// RoPE, forward and backward, on q or k [B, T, heads, Dh] with the model's cos, sin tables
// [T, Dh]: one thread per pair (d, d + Dh/2), read once and written once, where the unfused
// version makes several passes. With c = cos[t], s = sin[t], h = Dh/2:
//   forward:  y[d] = x[d] c[d] - x[d+h] s[d],    y[d+h] = x[d+h] c[d+h] + x[d] s[d+h]
//   backward: dx[d] = dy[d] c[d] + dy[d+h] s[d+h],  dx[d+h] = dy[d+h] c[d+h] - dy[d] s[d]
template <typename T, bool BACKWARD>
__device__ void rope(const T* x, const T* cos_table, const T* sin_table, T* out, long long pairs, int tokens,
                     int heads, int Dh) {
    const int half = Dh / 2;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs; p += stride) {
        const long long row = p / half;  // (b T + t) heads + head
        const int d = static_cast<int>(p - row * half);
        const long long t = (row / heads) % tokens;
        const long long at = row * Dh + d, table = t * Dh + d;
        const float x1 = to_float(x[at]), x2 = to_float(x[at + half]);
        const float c1 = to_float(cos_table[table]), c2 = to_float(cos_table[table + half]);
        const float s1 = to_float(sin_table[table]), s2 = to_float(sin_table[table + half]);
        out[at] = from_float<T>(BACKWARD ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
        out[at + half] = from_float<T>(BACKWARD ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
    }
}

// HD: the head dims a tile holds (Dh <= HD); "" for 128, "hd64_" for 64 (half the work and staging)
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

#define ROPE_ENTRY_POINTS(T, SUFFIX)                                                                               \
    extern "C" __global__ void rope_forward_##SUFFIX(const T* x, const T* cos_table, const T* sin_table, T* out,   \
                                                     long long pairs, int tokens, int heads, int Dh) {             \
        rope<T, false>(x, cos_table, sin_table, out, pairs, tokens, heads, Dh);                                    \
    }                                                                                                              \
    extern "C" __global__ void rope_backward_##SUFFIX(const T* dy, const T* cos_table, const T* sin_table, T* dx,  \
                                                      long long pairs, int tokens, int heads, int Dh) {            \
        rope<T, true>(dy, cos_table, sin_table, dx, pairs, tokens, heads, Dh);                                     \
    }

ATTENTION_ENTRY_POINTS(float, ATTN_HEAD_DIM_MAX, , f32)
ATTENTION_ENTRY_POINTS(bf16, ATTN_HEAD_DIM_MAX, , bf16)
ATTENTION_ENTRY_POINTS(float, 64, hd64_, f32)
ATTENTION_ENTRY_POINTS(bf16, 64, hd64_, bf16)
ROPE_ENTRY_POINTS(float, f32)
ROPE_ENTRY_POINTS(bf16, bf16)

// ------------------------------------------------------------------------------------------------
// Tensor cores (CUDA WMMA), compiled only with -DBOOSTMPI_ATTENTION_WMMA
// (which NVRTC accepts with CUDA's crt/mma.h on its include path: docs/GPU.md), which the wrapper
// adds for bf16 on 32-lane devices of compute capability 8.0 or later unless BOOSTMPI_ATTENTION_TENSOR_CORES=0.
// Each kernel is a template on HD, the head dims its tiles hold (128, or 64 in the tc_hd64_ entry
// points at the end, for Dh <= 64); the sizes below are HD = 128's.
// attention_forward_tc_bf16: the forward of attention_forward_bf16 with QK^T and PV on WMMA (bf16
// 16x16x16, fp32 accumulate); attention_backward_tc_bf16 and attention_backward_dq_tc_bf16 (below) the
// backward's two passes.
// One block per (b, h, 64-query tile), 4 warps of 32 lanes, warp w owning queries 16w .. 16w + 15;
// 64-key tiles of K, then V, staged as bf16. Per key tile and warp: S = Q K^T (4 x 8 mma_sync) to
// shared memory; each row's online softmax by two lanes (32 scores each); P as bf16 to shared
// memory; O = O rescale + P V (8 x 4 mma_sync). WMMA leaves the row of an accumulator element
// unspecified: each warp loads a 16 x 16 matrix of row numbers into an accumulator fragment once,
// and element e of every accumulator fragment belongs to row rows.x[e] (the same fragment type has
// one element map), which is how O is rescaled per row without assuming a layout.
#ifdef BOOSTMPI_ATTENTION_WMMA
#include <mma.h>
#include <cuda_bf16.h>

#define ATTN_TC_WARPS 4
#define ATTN_TC_THREADS 128
#define ATTN_TC_KEYS 64
static_assert(ATTN_TC_WARPS * 16 == ATTN_QUERY_TILE, "one 16-row strip of the query tile per warp");
static_assert(ATTN_TC_THREADS == ATTN_TC_WARPS * 32, "32-lane warps");

template <int HD>
struct __align__(32) TcTile {  // WMMA loads need 256-bit aligned rows
    bf16 v[ATTN_TC_KEYS][HD];
};
struct __align__(32) TcScores {
    float s[ATTN_TC_WARPS][16][ATTN_TC_KEYS];
};
struct __align__(32) TcProbs {
    bf16 p[ATTN_TC_WARPS][16][ATTN_TC_KEYS];
};

template <int HD>
__device__ __forceinline__ void attention_forward_tc(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, int tokens, int H, int Hkv, int Dh, float scale) {
    using namespace nvcuda;
    typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;
    __shared__ TcTile<HD> kv;
    __shared__ TcScores scores;
    __shared__ TcProbs probs;
    __shared__ float row_factor[ATTN_TC_WARPS][16];
    const int DIM_TILES = HD / 16, KEY_TILES = ATTN_TC_KEYS / 16;
    int tile, slice;
    tile_and_slice((tokens + ATTN_QUERY_TILE - 1) / ATTN_QUERY_TILE, true, &tile, &slice);
    const int b = slice / H, h = slice - b * H, kv_head = h / (H / Hkv);
    const int q0 = tile * ATTN_QUERY_TILE, warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const int row = lane / 2, half = lane % 2;  // softmax: two lanes a row, 32 of the 64 keys each
    const int i = q0 + 16 * warp + row;         // this lane's query in the softmax

    // Q: staged through the K/V buffer, then 8 fragments a warp in registers
    load_tile<bf16, ATTN_TC_KEYS, HD>(kv.v, q, b, q0, tokens, tokens, H, h, Dh);
    // the accumulator's row map: element e of a fragment holds row rows.x[e]
    for (int e = lane; e < 256; e += 32) scores.s[warp][e / 16][e % 16] = static_cast<float>(e / 16);
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> q_frag[DIM_TILES];
    for (int kk = 0; kk < DIM_TILES; ++kk)
        wmma::load_matrix_sync(q_frag[kk], reinterpret_cast<const __nv_bfloat16*>(&kv.v[16 * warp][16 * kk]), HD);
    Acc rows;
    wmma::load_matrix_sync(rows, &scores.s[warp][0][0], ATTN_TC_KEYS, wmma::mem_row_major);
    Acc out[DIM_TILES];
    for (int n = 0; n < DIM_TILES; ++n) wmma::fill_fragment(out[n], 0.0f);
    float running_max = negative_infinity(), running_sum = 0.0f;

    const int key_end = min(tokens, q0 + ATTN_QUERY_TILE);
    for (int k0 = 0; k0 < key_end; k0 += ATTN_TC_KEYS) {
        __syncthreads();  // Q (first tile) or the previous V tile is no longer read
        load_tile<bf16, ATTN_TC_KEYS, HD>(kv.v, k, b, k0, key_end, tokens, Hkv, kv_head, Dh);
        __syncthreads();
        // (loops over fragments in arrays are unrolled, the others not: hoisted fragment loads spill)
#pragma unroll 1
        for (int n = 0; n < KEY_TILES; ++n) {  // S = Q K^T: K row-major [key][dim] is K^T column-major
            Acc s;
            wmma::fill_fragment(s, 0.0f);
#pragma unroll
            for (int kk = 0; kk < DIM_TILES; ++kk) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> k_frag;
                wmma::load_matrix_sync(k_frag, reinterpret_cast<const __nv_bfloat16*>(&kv.v[16 * n][16 * kk]), HD);
                wmma::mma_sync(s, q_frag[kk], k_frag, s);
            }
            wmma::store_matrix_sync(&scores.s[warp][0][16 * n], s, ATTN_TC_KEYS, wmma::mem_row_major);
        }
        __syncthreads();  // the scores are written; K is no longer read
        load_tile<bf16, ATTN_TC_KEYS, HD>(kv.v, v, b, k0, key_end, tokens, Hkv, kv_head, Dh);
        // online softmax of this lane's half row (keys at or past key_end, or after query i, masked)
        float tile_max = negative_infinity();
        for (int c = 32 * half; c < 32 * half + 32; ++c) {
            const float s = k0 + c <= i && k0 + c < key_end ? scale * scores.s[warp][row][c] : negative_infinity();
            tile_max = fmaxf(tile_max, s);
        }
        tile_max = fmaxf(tile_max, shfl_xor(tile_max, 1));
        const float new_max = fmaxf(running_max, tile_max);  // key 0 is in the first tile: finite
        const float rescale = expf(running_max - new_max);
        float tile_sum = 0.0f;
        for (int c = 32 * half; c < 32 * half + 32; ++c) {
            const float s = k0 + c <= i && k0 + c < key_end ? scale * scores.s[warp][row][c] : negative_infinity();
            const float p = expf(s - new_max);
            probs.p[warp][row][c] = from_float<bf16>(p);  // P V runs on P rounded to bf16
            tile_sum += p;  // the row sum in fp32, as the log-sum-exp needs (FlashAttention-2 does the same)
        }
        tile_sum += shfl_xor(tile_sum, 1);
        running_sum = rescale * running_sum + tile_sum;
        running_max = new_max;
        if (half == 0) row_factor[warp][row] = rescale;
        __syncthreads();  // V, P and the factors are written
#pragma unroll
        for (int n = 0; n < DIM_TILES; ++n) {  // O = O rescale + P V
            for (int e = 0; e < out[n].num_elements; ++e) out[n].x[e] *= row_factor[warp][static_cast<int>(rows.x[e])];
#pragma unroll 1
            for (int kk = 0; kk < KEY_TILES; ++kk) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> p_frag;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> v_frag;
                wmma::load_matrix_sync(p_frag, reinterpret_cast<const __nv_bfloat16*>(&probs.p[warp][0][16 * kk]),
                                       ATTN_TC_KEYS);
                wmma::load_matrix_sync(v_frag, reinterpret_cast<const __nv_bfloat16*>(&kv.v[16 * kk][16 * n]), HD);
                wmma::mma_sync(out[n], p_frag, v_frag, out[n]);
            }
        }
    }
    // o = O / l, through the warp's score rows (16 x 64 floats: four 16 x 16 output tiles at a time)
    __syncthreads();
    if (half == 0) row_factor[warp][row] = 1.0f / running_sum;
    if (half == 0 && i < tokens) lse[static_cast<long long>(slice) * tokens + i] = running_max + logf(running_sum);
    __syncthreads();
    for (int n0 = 0; n0 < DIM_TILES; n0 += KEY_TILES) {
        for (int n = n0; n < n0 + KEY_TILES; ++n) {
            for (int e = 0; e < out[n].num_elements; ++e) out[n].x[e] *= row_factor[warp][static_cast<int>(rows.x[e])];
            wmma::store_matrix_sync(&scores.s[warp][0][16 * (n - n0)], out[n], ATTN_TC_KEYS, wmma::mem_row_major);
        }
        __syncthreads();
        if (i < tokens) {
            for (int c = 32 * half; c < 32 * half + 32; ++c) {
                const int d = 16 * n0 + c;
                if (d < Dh) o[token_offset(b, i, tokens, H, h, Dh) + d] = from_float<bf16>(scores.s[warp][row][c]);
            }
        }
        __syncthreads();
    }
}
// attention_backward_tc_bf16: the dK/dV pass of attention_backward_bf16 with its four products on WMMA
// (bf16 16x16x16, fp32 accumulate), after attention_backward_dq_tc_bf16 (below). One block per
// (b, kv head, 64-key tile), 4 warps of 32 lanes, warp w owning keys 16w .. 16w + 15, whose dK and dV
// (16 x 128 each) stay in 16 accumulator fragments. K and V staged as bf16 (32 KiB); for each query
// head of the group and each 16-query tile from the key tile's first key to T: Q and dO staged as
// bf16, then per warp S^T = K Q^T (8 mma_sync) to shared memory; P^T = exp(scale S^T - lse) by
// element position (masked: query before key, or past T), rounded to bf16 in shared memory, fp32
// kept; dV += P^T dO (8); dP^T = V dO^T (8) to shared memory; dS^T = P^T (dP^T - delta) as bf16 over
// P^T; dK += dS^T Q (8); dk *= scale at the store. The accumulators are never read element by element
// (only scaled uniformly), so no fragment layout is assumed. Global bytes: those of the FMA pass with
// 64-key tiles (Q, dO, lse and delta read once per key tile and query head).
#define ATTN_TC_BWD_KEYS 64
#define ATTN_TC_BWD_QUERIES 16
static_assert(ATTN_TC_WARPS * 16 == ATTN_TC_BWD_KEYS, "one 16-key strip of the key tile per warp");

template <int HD>
struct __align__(32) TcBackwardTiles {
    bf16 k[ATTN_TC_BWD_KEYS][HD];
    bf16 v[ATTN_TC_BWD_KEYS][HD];
    bf16 q[ATTN_TC_BWD_QUERIES][HD];
    bf16 d_o[ATTN_TC_BWD_QUERIES][HD];
    float s[ATTN_TC_WARPS][16][ATTN_TC_BWD_QUERIES];  // S^T, then dP^T, of each warp's keys
    bf16 p[ATTN_TC_WARPS][16][ATTN_TC_BWD_QUERIES];   // P^T, then dS^T
    float lse[ATTN_TC_BWD_QUERIES];
    float delta[ATTN_TC_BWD_QUERIES];
};

// out[16][16] = A B^T: A a warp's 16 staged rows, B 16 staged rows (both [row][dim], ld HD: B row-major
// is B^T column-major), over the HD dims.
template <int HD>
__device__ __forceinline__ void strip_times_staged_t(float* out, const __nv_bfloat16* a, const __nv_bfloat16* b) {
    using namespace nvcuda;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll 1
    for (int kk = 0; kk < HD / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a_frag;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b_frag;
        wmma::load_matrix_sync(a_frag, a + 16 * kk, HD);
        wmma::load_matrix_sync(b_frag, b + 16 * kk, HD);
        wmma::mma_sync(acc, a_frag, b_frag, acc);
    }
    wmma::store_matrix_sync(out, acc, ATTN_TC_BWD_QUERIES, wmma::mem_row_major);
}

// acc[n] += A B[:, 16n .. 16n + 15]: A the warp's staged 16 x 16 (ld 16), B 16 staged rows of HD dims.
template <int HD>
__device__ __forceinline__ void accumulate_strip_times_staged(
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>* acc, const __nv_bfloat16* a,
    const __nv_bfloat16* b) {
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a_frag;
    wmma::load_matrix_sync(a_frag, a, ATTN_TC_BWD_QUERIES);
#pragma unroll
    for (int n = 0; n < HD / 16; ++n) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b_frag;
        wmma::load_matrix_sync(b_frag, b + 16 * n, HD);
        wmma::mma_sync(acc[n], a_frag, b_frag, acc[n]);
    }
}

template <int HD>
__device__ __forceinline__ void attention_backward_tc(const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* delta, bf16* dk, bf16* dv, int tokens, int H, int Hkv, int Dh, float scale) {
    using namespace nvcuda;
    typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;
    __shared__ TcBackwardTiles<HD> t;
    const int DIM_TILES = HD / 16, PER_LANE = 16 * ATTN_TC_BWD_QUERIES / 32;
    int tile, slice;
    tile_and_slice((tokens + ATTN_TC_BWD_KEYS - 1) / ATTN_TC_BWD_KEYS, false, &tile, &slice);
    const int b = slice / Hkv, kv_head = slice - b * Hkv, G = H / Hkv;
    const int k0 = tile * ATTN_TC_BWD_KEYS, warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;

    load_tile<bf16, ATTN_TC_BWD_KEYS, HD>(t.k, k, b, k0, tokens, tokens, Hkv, kv_head, Dh);
    load_tile<bf16, ATTN_TC_BWD_KEYS, HD>(t.v, v, b, k0, tokens, tokens, Hkv, kv_head, Dh);
    Acc dk_acc[DIM_TILES], dv_acc[DIM_TILES];
#pragma unroll
    for (int n = 0; n < DIM_TILES; ++n) {
        wmma::fill_fragment(dk_acc[n], 0.0f);
        wmma::fill_fragment(dv_acc[n], 0.0f);
    }
    const __nv_bfloat16* k_strip = reinterpret_cast<const __nv_bfloat16*>(&t.k[16 * warp][0]);
    const __nv_bfloat16* v_strip = reinterpret_cast<const __nv_bfloat16*>(&t.v[16 * warp][0]);
    const __nv_bfloat16* q_tile = reinterpret_cast<const __nv_bfloat16*>(&t.q[0][0]);
    const __nv_bfloat16* do_tile = reinterpret_cast<const __nv_bfloat16*>(&t.d_o[0][0]);
    const __nv_bfloat16* p_strip = reinterpret_cast<const __nv_bfloat16*>(&t.p[warp][0][0]);

    for (int g = 0; g < G; ++g) {
        const int h = kv_head * G + g;
        const long long stats = (static_cast<long long>(b) * H + h) * tokens;
#pragma unroll 1
        for (int i0 = k0; i0 < tokens; i0 += ATTN_TC_BWD_QUERIES) {
            const int n_rows = min(ATTN_TC_BWD_QUERIES, tokens - i0);
            __syncthreads();  // the previous query tile is no longer read
            load_tile<bf16, ATTN_TC_BWD_QUERIES, HD>(t.q, q, b, i0, tokens, tokens, H, h, Dh);
            load_tile<bf16, ATTN_TC_BWD_QUERIES, HD>(t.d_o, d_o, b, i0, tokens, tokens, H, h, Dh);
            const int r = static_cast<int>(threadIdx.x);
            if (r < ATTN_TC_BWD_QUERIES) {
                t.lse[r] = r < n_rows ? lse[stats + i0 + r] : 0.0f;
                t.delta[r] = r < n_rows ? delta[stats + i0 + r] : 0.0f;
            }
            __syncthreads();
            strip_times_staged_t<HD>(&t.s[warp][0][0], k_strip, q_tile);  // S^T = K Q^T
            __syncthreads();  // S^T is written
            float p[PER_LANE];  // this lane's elements e = lane + 32 m of the warp's 16 x 16 P^T, fp32
#pragma unroll
            for (int m = 0; m < PER_LANE; ++m) {
                const int e = lane + 32 * m, key = e / ATTN_TC_BWD_QUERIES, c = e % ATTN_TC_BWD_QUERIES;
                const int j = k0 + 16 * warp + key, i = i0 + c;
                p[m] = j <= i && i < tokens ? expf(scale * t.s[warp][key][c] - t.lse[c]) : 0.0f;
                t.p[warp][key][c] = from_float<bf16>(p[m]);  // P^T dO runs on P rounded to bf16
            }
            __syncthreads();  // P^T is written
            accumulate_strip_times_staged<HD>(dv_acc, p_strip, do_tile);  // dV += P^T dO
            strip_times_staged_t<HD>(&t.s[warp][0][0], v_strip, do_tile);  // dP^T = V dO^T
            __syncthreads();  // dP^T is written, P^T is no longer read
#pragma unroll
            for (int m = 0; m < PER_LANE; ++m) {
                const int e = lane + 32 * m, key = e / ATTN_TC_BWD_QUERIES, c = e % ATTN_TC_BWD_QUERIES;
                t.p[warp][key][c] = from_float<bf16>(p[m] * (t.s[warp][key][c] - t.delta[c]));
            }
            __syncthreads();  // dS^T is written
            accumulate_strip_times_staged<HD>(dk_acc, p_strip, q_tile);  // dK += dS^T Q
        }
    }
    // dK (times scale) and dV through the warp's score rows, one 16 x 16 tile at a time
#pragma unroll
    for (int n = 0; n < 2 * DIM_TILES; ++n) {
        Acc& acc = n < DIM_TILES ? dk_acc[n] : dv_acc[n - DIM_TILES];
        const float factor = n < DIM_TILES ? scale : 1.0f;
        for (int e = 0; e < acc.num_elements; ++e) acc.x[e] *= factor;
        __syncthreads();
        wmma::store_matrix_sync(&t.s[warp][0][0], acc, ATTN_TC_BWD_QUERIES, wmma::mem_row_major);
        __syncthreads();
        bf16* out = n < DIM_TILES ? dk : dv;
#pragma unroll
        for (int m = 0; m < PER_LANE; ++m) {
            const int e = lane + 32 * m, key = e / 16, c = e % 16;
            const int j = k0 + 16 * warp + key, d = 16 * (n % DIM_TILES) + c;
            if (j < tokens && d < Dh) out[token_offset(b, j, tokens, Hkv, kv_head, Dh) + d] = from_float<bf16>(t.s[warp][key][c]);
        }
    }
}
// attention_backward_dq_tc_bf16: the dQ pass of attention_backward_dq_bf16 with its three products on
// WMMA. One block per (b, h, 64-query tile), 4 warps of 32 lanes, warp w owning queries 16w .. 16w + 15:
// delta = rowsum(dO o O) first (two lanes a row; written for the dK/dV pass), Q and dO staged
// through shared memory into 8 + 8 matrix_a fragments a warp, dQ (16 x 128) in 8 accumulator
// fragments. Per 32-key tile up to the query tile's last query (K and V staged as bf16): S = Q K^T
// (16 mma_sync) to shared memory, P = exp(scale S - lse) by element position (masked: key after
// query) kept in fp32, dP = dO V^T (16) over S, dS = P (dP - delta) as bf16, dQ += dS K (16); dq *= scale
// at the store. No accumulator element is read by position. Global bytes: those of the FMA dQ pass.
#define ATTN_TC_DQ_KEYS 32

template <int HD>
struct __align__(32) TcDqTiles {
    bf16 k[ATTN_TC_DQ_KEYS][HD];  // (with v: Q, then dO, staged at the start)
    bf16 v[ATTN_TC_DQ_KEYS][HD];
    float s[ATTN_TC_WARPS][16][ATTN_TC_DQ_KEYS];  // S, then dP, of each warp's queries
    bf16 ds[ATTN_TC_WARPS][16][ATTN_TC_DQ_KEYS];
    float lse[ATTN_TC_WARPS][16];
    float delta[ATTN_TC_WARPS][16];
};
static_assert(2 * ATTN_TC_DQ_KEYS >= 4 * 16, "Q stages through K and V");

// out[16][ATTN_TC_DQ_KEYS] = A B^T for a warp's 16 rows of A held as fragments a[d] (dims 16d .. 16d + 15)
// and B the staged [key][dim] tile (row-major, so B^T is column-major), one 16-key block at a time.
template <int HD>
__device__ __forceinline__ void rows_times_staged_t(
    float* out, const nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major>* a,
    const __nv_bfloat16* tile) {
    using namespace nvcuda;
#pragma unroll 1
    for (int n = 0; n < ATTN_TC_DQ_KEYS / 16; ++n) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
            wmma::load_matrix_sync(b, tile + (16 * n) * HD + 16 * kk, HD);
            wmma::mma_sync(acc, a[kk], b, acc);
        }
        wmma::store_matrix_sync(out + 16 * n, acc, ATTN_TC_DQ_KEYS, wmma::mem_row_major);
    }
}

template <int HD>
__device__ __forceinline__ void attention_backward_dq_tc(const bf16* q, const bf16* k, const bf16* v, const bf16* o, const bf16* d_o, const float* lse, float* delta, bf16* dq, int tokens, int H, int Hkv, int Dh, float scale) {
    using namespace nvcuda;
    typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;
    typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> RowA;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> RowB;
    __shared__ TcDqTiles<HD> t;
    const int DIM_TILES = HD / 16, KEY_TILES = ATTN_TC_DQ_KEYS / 16;
    int tile, slice;
    tile_and_slice((tokens + ATTN_QUERY_TILE - 1) / ATTN_QUERY_TILE, true, &tile, &slice);
    const int b = slice / H, h = slice - b * H, kv_head = h / (H / Hkv);
    const int q0 = tile * ATTN_QUERY_TILE, warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    {  // delta = rowsum(dO o O), two lanes a row; lse of the row
        const int row = lane / 2, half = lane % 2, i = q0 + 16 * warp + row;
        float partial = 0.0f;
        if (i < tokens) {
            const long long at = token_offset(b, i, tokens, H, h, Dh);
            for (int d = half; d < Dh; d += 2) partial += to_float(d_o[at + d]) * to_float(o[at + d]);
        }
        partial += shfl_xor(partial, 1);
        if (half == 0) {
            t.delta[warp][row] = partial;
            t.lse[warp][row] = i < tokens ? lse[static_cast<long long>(slice) * tokens + i] : 0.0f;
            if (i < tokens) delta[static_cast<long long>(slice) * tokens + i] = partial;
        }
    }
    const __nv_bfloat16* staged = reinterpret_cast<const __nv_bfloat16*>(&t.k[0][0]);
    RowA q_frag[DIM_TILES], do_frag[DIM_TILES];
    load_tile<bf16, ATTN_QUERY_TILE, HD>(reinterpret_cast<bf16 (*)[HD]>(&t.k[0][0]), q, b, q0, tokens, tokens, H, h, Dh);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < DIM_TILES; ++kk) wmma::load_matrix_sync(q_frag[kk], staged + (16 * warp) * HD + 16 * kk, HD);
    __syncthreads();
    load_tile<bf16, ATTN_QUERY_TILE, HD>(reinterpret_cast<bf16 (*)[HD]>(&t.k[0][0]), d_o, b, q0, tokens, tokens, H, h, Dh);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < DIM_TILES; ++kk) wmma::load_matrix_sync(do_frag[kk], staged + (16 * warp) * HD + 16 * kk, HD);
    Acc dq_acc[DIM_TILES];
#pragma unroll
    for (int n = 0; n < DIM_TILES; ++n) wmma::fill_fragment(dq_acc[n], 0.0f);
    const __nv_bfloat16* k_tile = reinterpret_cast<const __nv_bfloat16*>(&t.k[0][0]);
    const __nv_bfloat16* v_tile = reinterpret_cast<const __nv_bfloat16*>(&t.v[0][0]);
    const __nv_bfloat16* ds_strip = reinterpret_cast<const __nv_bfloat16*>(&t.ds[warp][0][0]);
    float p[16];  // this lane's column (key c0 + lane) of the warp's 16 x 32 P, fp32

    const int key_end = min(tokens, q0 + ATTN_QUERY_TILE);
#pragma unroll 1
    for (int k0 = 0; k0 < key_end; k0 += ATTN_TC_DQ_KEYS) {
        __syncthreads();  // dO (first tile) or the previous K and V are no longer read
        load_tile<bf16, ATTN_TC_DQ_KEYS, HD>(t.k, k, b, k0, key_end, tokens, Hkv, kv_head, Dh);
        load_tile<bf16, ATTN_TC_DQ_KEYS, HD>(t.v, v, b, k0, key_end, tokens, Hkv, kv_head, Dh);
        __syncthreads();
        rows_times_staged_t<HD>(&t.s[warp][0][0], q_frag, k_tile);  // S = Q K^T
        __syncthreads();  // S is written
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            const int i = q0 + 16 * warp + r, j = k0 + lane;
            p[r] = j <= i && i < tokens ? expf(scale * t.s[warp][r][lane] - t.lse[warp][r]) : 0.0f;
        }
        __syncthreads();  // S is no longer read
        rows_times_staged_t<HD>(&t.s[warp][0][0], do_frag, v_tile);  // dP = dO V^T
        __syncthreads();  // dP is written
#pragma unroll
        for (int r = 0; r < 16; ++r) t.ds[warp][r][lane] = from_float<bf16>(p[r] * (t.s[warp][r][lane] - t.delta[warp][r]));
        __syncthreads();  // dS is written
#pragma unroll
        for (int n = 0; n < DIM_TILES; ++n) {  // dQ += dS K
#pragma unroll 1
            for (int kk = 0; kk < KEY_TILES; ++kk) {
                RowA ds_frag;
                RowB k_frag;
                wmma::load_matrix_sync(ds_frag, ds_strip + 16 * kk, ATTN_TC_DQ_KEYS);
                wmma::load_matrix_sync(k_frag, k_tile + (16 * kk) * HD + 16 * n, HD);
                wmma::mma_sync(dq_acc[n], ds_frag, k_frag, dq_acc[n]);
            }
        }
    }
    // dq = dQ scale, through the warp's score rows (two 16 x 16 tiles at a time)
    const int i = q0 + 16 * warp + lane / 2;
#pragma unroll
    for (int n0 = 0; n0 < DIM_TILES; n0 += KEY_TILES) {
        __syncthreads();
#pragma unroll
        for (int n = n0; n < n0 + KEY_TILES; ++n) {
            for (int e = 0; e < dq_acc[n].num_elements; ++e) dq_acc[n].x[e] *= scale;
            wmma::store_matrix_sync(&t.s[warp][0][16 * (n - n0)], dq_acc[n], ATTN_TC_DQ_KEYS, wmma::mem_row_major);
        }
        __syncthreads();
        if (i < tokens) {
            for (int c = 16 * (lane % 2); c < 16 * (lane % 2) + 16; ++c) {
                const int d = 16 * n0 + c;
                if (d < Dh) dq[token_offset(b, i, tokens, H, h, Dh) + d] = from_float<bf16>(t.s[warp][lane / 2][c]);
            }
        }
    }
}

// The entry points: HD = 128 (<kernel>_tc_bf16) and HD = 64 (<kernel>_tc_hd64_bf16, which the wrapper
// launches for Dh <= 64: half the staging and the products, as the FMA kernels' hd64_ variants).
#define ATTENTION_TC_ENTRY_POINTS(HD, PREFIX)                                                                      \
    extern "C" __global__ void __launch_bounds__(ATTN_TC_THREADS, ATTN_BLOCKS_PER_SM)                              \
        attention_forward_tc_##PREFIX##bf16(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,      \
                                            int tokens, int H, int Hkv, int Dh, float scale) {                     \
        attention_forward_tc<HD>(q, k, v, o, lse, tokens, H, Hkv, Dh, scale);                                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATTN_TC_THREADS, ATTN_BLOCKS_PER_SM)                              \
        attention_backward_dq_tc_##PREFIX##bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* o,       \
                                                const bf16* d_o, const float* lse, float* delta, bf16* dq,         \
                                                int tokens, int H, int Hkv, int Dh, float scale) {                 \
        attention_backward_dq_tc<HD>(q, k, v, o, d_o, lse, delta, dq, tokens, H, Hkv, Dh, scale);                 \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATTN_TC_THREADS, ATTN_BLOCKS_PER_SM)                              \
        attention_backward_tc_##PREFIX##bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* d_o,        \
                                             const float* lse, const float* delta, bf16* dk, bf16* dv, int tokens, \
                                             int H, int Hkv, int Dh, float scale) {                                \
        attention_backward_tc<HD>(q, k, v, d_o, lse, delta, dk, dv, tokens, H, Hkv, Dh, scale);                   \
    }

ATTENTION_TC_ENTRY_POINTS(ATTN_HEAD_DIM_MAX, )
ATTENTION_TC_ENTRY_POINTS(64, hd64_)
#endif  // BOOSTMPI_ATTENTION_WMMA
