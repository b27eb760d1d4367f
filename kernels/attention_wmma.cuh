// The attention's tensor-core kernels (CUDA WMMA), included by attention.cu only with -DBOOSTMPI_ATTENTION_WMMA
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
// Their tile sizes come from the launch plan as the FMA kernels' do (attention.cuh).
#ifndef BOOSTMPI_ATTENTION_WMMA_CUH
#define BOOSTMPI_ATTENTION_WMMA_CUH
#include <mma.h>
#include <cuda_bf16.h>

#if !defined(ATTN_TC_WARPS) || !defined(ATTN_TC_THREADS) || !defined(ATTN_TC_KEYS) || !defined(ATTN_TC_BWD_KEYS) || \
    !defined(ATTN_TC_BWD_QUERIES) || !defined(ATTN_TC_DQ_KEYS)
#error "the tensor-core attention kernels take their tile sizes from the launch plan: compile with boostmpi.gpu.launch_plan.compile_options(\"attention\", ..., wmma=True)"
#endif
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
template <int HD>
struct __align__(32) TcDqTiles {
    bf16 k[ATTN_TC_DQ_KEYS][HD];  // (with v: Q, then dO, staged at the start)
    bf16 v[ATTN_TC_DQ_KEYS][HD];
    float s[ATTN_TC_WARPS][16][ATTN_TC_DQ_KEYS];  // S, then dP, of each warp's queries
    bf16 ds[ATTN_TC_WARPS][16][ATTN_TC_DQ_KEYS];
    float lse[ATTN_TC_WARPS][16];
    float delta[ATTN_TC_WARPS][16];
};
static_assert(2 * ATTN_TC_DQ_KEYS >= ATTN_QUERY_TILE, "Q stages through K and V");

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
ATTENTION_TC_ENTRY_POINTS(ATTN_HEAD_DIM_SMALL, hd64_)
#endif  // BOOSTMPI_ATTENTION_WMMA_CUH

