// RMSNorm, forward and backward, and the two halves of online RMSNorm for bottleneck-aware
// tensor parallelism. Rows of C elements; statistics and arithmetic in fp32.
// Entry points per storage type T: <kernel>_f32 (float) and <kernel>_bf16 (bfloat16 bits).
//
// Tile plan (launch shapes in boostmpi/gpu/kernels.py; N rows, b bytes per element):
//   row kernels (rmsnorm_online_stats, rescale_rows, rmsnorm_projection): one block per row, one
//     16-byte vector per thread per pass (whole warps, at most 1,024 threads); the row's sum goes
//     from registers through one shared float per warp (block_sum).
//   rmsnorm_forward: one block per row of whole warps, each thread holding up to
//     RMSNORM_ROW_VECTORS 16-byte vectors of the row in registers between the sum and the scaling
//     (rmsnorm_forward_threads in the loader: RMSNORM_FORWARD_VECTORS per thread, at most 512
//     threads), so x is read once, all of a thread's loads in flight together; a row wider than
//     the block holds, or not 16-byte aligned, takes the two-pass loop (its second read from cache).
//   rmsnorm_backward: a block owns a column tile (one 16-byte vector per thread, at most 256
//     threads: 1,024 f32 or 2,048 bf16 columns) over a chunk of rows. Its threads keep w and
//     their columns' running dw in registers while they walk the chunk's rows, and write dw once
//     to the chunk's row of a [n_chunks, C] fp32 workspace, which the caller sums. The row
//     statistic dx needs, proj = rstd^2 * mean(dy * w * x), comes from rmsnorm_projection first.
// Why two backward kernels: a one-pass backward keeps all C of dw per block on chip (C floats of
// shared memory, 64 KiB at d_model 16,384: the whole LDS of an MI250X CU) in 1,024-thread blocks
// (at 40 registers, one block per SM); over column tiles, dw is 16 / b floats per thread.
// Bytes from DRAM per row (w, rstd and proj stay in cache; a second pass over a row of a row
// kernel is read from cache):
//   forward: x in, y out, 2Cb + 4 (the row held in registers; the two-pass loop reads it twice,
//     the second time from cache);  online stats: x in, xw out, 2Cb + 4;  rescale: 2Rb + 4
//   backward: projection reads dy, x (2Cb + 8); rmsnorm_backward reads dy, x and writes dx
//   (3Cb); 5Cb per row in all, against 3Cb for a one-pass kernel. Plus 4C bytes of workspace
//   per chunk, written once and read by the caller's sum (about 8 blocks per SM: at d_model
//   16,384 on 108 SMs, 108 chunks in bf16, 54 in f32, each 64 KiB; N x C x b is 512 MiB there).
// Resources (tests/kernels/test_kernel_resources.py measures them at these shapes with NVRTC for sm_80
// and sm_90 and hipcc for gfx90a): no spills, no scratch, no dynamic shared memory, at least 2
// resident blocks per SM/CU for every kernel; rmsnorm_backward uses 40 (f32) / 48 (bf16)
// registers at 256 threads.
#include "common.cuh"

// One block per row: x [N,C], w [C] -> y [N,C], rstd [N] (fp32).
//   rstd = 1 / sqrt(mean(x^2) + eps),   y = x * rstd * w
template <typename T, int V>
__device__ void rmsnorm_forward_row(const T* x, const T* w, T* y, float* rstd_out, int C, float eps) {
    float sum_squares = 0.0f;
    for (int j = threadIdx.x * V; j < C; j += blockDim.x * V) {
        float xv[V];
        load_vec<V>(x + j, xv);
#pragma unroll
        for (int k = 0; k < V; ++k) sum_squares += xv[k] * xv[k];
    }
    const float rstd = rsqrtf(block_sum(sum_squares) / C + eps);
    if (threadIdx.x == 0) *rstd_out = rstd;
    // the second read of the row comes from cache: a row is a few KiB
    for (int j = threadIdx.x * V; j < C; j += blockDim.x * V) {
        float xv[V], wv[V], yv[V];
        load_vec<V>(x + j, xv);
        load_vec<V>(w + j, wv);
#pragma unroll
        for (int k = 0; k < V; ++k) yv[k] = xv[k] * rstd * wv[k];
        store_vec<V>(y + j, yv);
    }
}

// The row held in registers: thread t owns vectors t, t + blockDim.x, ... (at most R of them, C <=
// R * blockDim.x * V, C % V == 0, 16-byte aligned). x is read from memory once; its vectors and w's
// are all loaded before the row's sum (w's L2 round trip overlaps x's) and kept as they are stored
// (4 registers a vector whatever T), converted where used.
// RMSNORM_ROW_VECTORS: the launch plan's (boostmpi/gpu/launch_plan.py, RmsnormPlan.held_vectors), passed by the loader.
#ifndef RMSNORM_ROW_VECTORS
#error "rmsnorm.cu takes RMSNORM_ROW_VECTORS from the launch plan: compile with boostmpi.gpu.launch_plan.compile_options(\"rmsnorm\", ...)"
#endif
// Element k of the 16 bytes held in `v` as a float, taken from v's words by value: no pointer into a
// held vector, so the held arrays stay in registers (hipcc for gfx90a puts them in scratch otherwise).
__device__ __forceinline__ unsigned int held_word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}
__device__ __forceinline__ float held_elem(const uint4& v, int k, float) { return __uint_as_float(held_word(v, k)); }
__device__ __forceinline__ float held_elem(const uint4& v, int k, bf16) {
    const unsigned int word = held_word(v, k >> 1);  // little-endian: element 2i in the low half of word i
    return __uint_as_float((k & 1) ? (word & 0xffff0000u) : (word << 16));
}
// The inverse: four floats, or eight rounded to bf16, packed into 16 bytes by value.
__device__ __forceinline__ uint4 held_pack(const float* v, float) {
    uint4 out;
    out.x = __float_as_uint(v[0]), out.y = __float_as_uint(v[1]), out.z = __float_as_uint(v[2]), out.w = __float_as_uint(v[3]);
    return out;
}
__device__ __forceinline__ unsigned int bf16_pair(float lo, float hi) {
    return static_cast<unsigned int>(from_float<bf16>(lo).bits) | (static_cast<unsigned int>(from_float<bf16>(hi).bits) << 16);
}
__device__ __forceinline__ uint4 held_pack(const float* v, bf16) {
    uint4 out;
    out.x = bf16_pair(v[0], v[1]), out.y = bf16_pair(v[2], v[3]), out.z = bf16_pair(v[4], v[5]), out.w = bf16_pair(v[6], v[7]);
    return out;
}
template <typename T, int V, int R>
__device__ void rmsnorm_forward_held(const T* x, const T* w, T* y, float* rstd_out, int C, float eps) {
    uint4 xr[R], wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int j = (threadIdx.x + r * blockDim.x) * V;
        if (j < C) {
            xr[r] = *reinterpret_cast<const uint4*>(x + j);
            wr[r] = *reinterpret_cast<const uint4*>(w + j);
        }
    }
    float sum_squares = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if ((threadIdx.x + r * blockDim.x) * V < C) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float xk = held_elem(xr[r], k, T());
                sum_squares += xk * xk;
            }
        }
    }
    const float rstd = rsqrtf(block_sum(sum_squares) / C + eps);
    if (threadIdx.x == 0) *rstd_out = rstd;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int j = (threadIdx.x + r * blockDim.x) * V;
        if (j < C) {
            float yv[V];
#pragma unroll
            for (int k = 0; k < V; ++k) yv[k] = held_elem(xr[r], k, T()) * rstd * held_elem(wr[r], k, T());
            *reinterpret_cast<uint4*>(y + j) = held_pack(yv, T());
        }
    }
}

template <typename T>
__device__ void rmsnorm_forward(const T* x, const T* w, T* y, float* rstd, int C, float eps) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * C;
    const int V = VecWidth<T>::value;
    const bool vectorised = C % V == 0 && aligned16(x) && aligned16(w) && aligned16(y);
    if (vectorised && C <= RMSNORM_ROW_VECTORS * V * static_cast<int>(blockDim.x))
        rmsnorm_forward_held<T, V, RMSNORM_ROW_VECTORS>(x + offset, w, y + offset, rstd + row, C, eps);
    else if (vectorised)
        rmsnorm_forward_row<T, V>(x + offset, w, y + offset, rstd + row, C, eps);
    else
        rmsnorm_forward_row<T, 1>(x + offset, w, y + offset, rstd + row, C, eps);
}

// Backward, first kernel, one block per row: dy, x [N,C], w [C], rstd [N] -> proj [N] (fp32),
//   proj = rstd^2 * mean(dy * w * x)
// the row's only statistic that dx needs (rmsnorm_backward then works on column tiles).
template <typename T, int V>
__device__ void rmsnorm_projection_row(const T* dy, const T* x, const T* w, float r, float* proj_out, int C) {
    float dot = 0.0f;
    for (int j = threadIdx.x * V; j < C; j += blockDim.x * V) {
        float dyv[V], xv[V], wv[V];
        load_vec<V>(dy + j, dyv);
        load_vec<V>(x + j, xv);
        load_vec<V>(w + j, wv);
#pragma unroll
        for (int k = 0; k < V; ++k) dot += dyv[k] * wv[k] * xv[k];
    }
    const float total = block_sum(dot);
    if (threadIdx.x == 0) *proj_out = r * r * (total / C);
}

template <typename T>
__device__ void rmsnorm_projection(const T* dy, const T* x, const T* w, const float* rstd, float* proj, int C) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * C;
    const int V = VecWidth<T>::value;
    if (C % V == 0 && aligned16(dy) && aligned16(x) && aligned16(w))
        rmsnorm_projection_row<T, V>(dy + offset, x + offset, w, rstd[row], proj + row, C);
    else
        rmsnorm_projection_row<T, 1>(dy + offset, x + offset, w, rstd[row], proj + row, C);
}

// Backward, second kernel: dy, x [N,C], w [C], rstd, proj [N] -> dx [N,C], dw_partial [n_chunks, C].
//   dx = rstd * (dy * w - x * proj)                          (per element)
//   dw = sum over rows of dy * x * rstd                      (dw_partial summed by the caller)
// The column tiles of column_tile_walk (common.cuh): block b owns column tile b % n_tiles
// (VecWidth<T> columns per thread) of the rows of chunk b / n_tiles (rows_per_chunk rows, the last
// chunk fewer); each thread keeps w and its running dw in registers and writes its dw once.
template <typename T, bool VECTORISED>
__device__ void rmsnorm_backward_tile(const T* dy, const T* x, const T* w, const float* rstd, const float* proj,
                                      T* dx, float* dw_partial, int N, int C, int rows_per_chunk) {
    column_tile_walk<T, VECTORISED>(w, dw_partial, N, C, rows_per_chunk,
                                    [=](long long offset, long long row, int width, const float* wv, float* dw) {
        constexpr int V = VecWidth<T>::value;
        const float r = rstd[row], p = proj[row];
        float dyv[V], xv[V], dxv[V];
        Columns<VECTORISED>::template load<V>(dy + offset, dyv, width);
        Columns<VECTORISED>::template load<V>(x + offset, xv, width);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            dxv[k] = r * (dyv[k] * wv[k] - xv[k] * p);
            dw[k] += dyv[k] * xv[k] * r;
        }
        Columns<VECTORISED>::template store<V>(dx + offset, dxv, width);
    });
}

template <typename T>
__device__ void rmsnorm_backward(const T* dy, const T* x, const T* w, const float* rstd, const float* proj, T* dx,
                                 float* dw_partial, int N, int C, int rows_per_chunk) {
    if (C % VecWidth<T>::value == 0 && aligned16(dy) && aligned16(x) && aligned16(w) && aligned16(dx))
        rmsnorm_backward_tile<T, true>(dy, x, w, rstd, proj, dx, dw_partial, N, C, rows_per_chunk);
    else
        rmsnorm_backward_tile<T, false>(dy, x, w, rstd, proj, dx, dw_partial, N, C, rows_per_chunk);
}

// Online RMSNorm, first half, one block per row. From this rank's shard x [N,Cs], w [Cs]:
//   xw [N,Cs] = x * w,   ss [N] = sum(x^2) (fp32)
// in one read of x. The caller multiplies xw by its A shard, all-reduces that product and ss
// together, and applies rescale_rows: rmsnorm(x, w) @ A = rsqrt(ss/C + eps) * sum_s (x_s*w_s) @ A_s.
template <typename T, int V>
__device__ void rmsnorm_online_stats_row(const T* x, const T* w, T* xw, float* ss_out, int Cs) {
    float sum_squares = 0.0f;
    for (int j = threadIdx.x * V; j < Cs; j += blockDim.x * V) {
        float xv[V], wv[V], xwv[V];
        load_vec<V>(x + j, xv);
        load_vec<V>(w + j, wv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            sum_squares += xv[k] * xv[k];
            xwv[k] = xv[k] * wv[k];
        }
        store_vec<V>(xw + j, xwv);
    }
    const float total = block_sum(sum_squares);
    if (threadIdx.x == 0) *ss_out = total;
}

template <typename T>
__device__ void rmsnorm_online_stats(const T* x, const T* w, T* xw, float* ss, int Cs) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * Cs;
    const int V = VecWidth<T>::value;
    if (Cs % V == 0 && aligned16(x) && aligned16(w) && aligned16(xw))
        rmsnorm_online_stats_row<T, V>(x + offset, w, xw + offset, ss + row, Cs);
    else
        rmsnorm_online_stats_row<T, 1>(x + offset, w, xw + offset, ss + row, Cs);
}

// The residual add before a norm with online RMSNorm's first half, one block per row. From this
// rank's shards h, y [N,Cs] (the residual and the branch output added to it), w [Cs]:
//   s [N,Cs] = h + y (the new residual, rounded to T),  xw [N,Cs] = s * w,  ss [N] = sum(s^2) (fp32)
// in one read of h and y: the statistic and xw are of s as stored, as when the sum is written first.
// s is also written to s2 (s2 may be s itself: the same bytes stored twice): a second copy of the residual, which the layer's last
// GEMM accumulates its output into (cuBLAS beta = 1) while the norm's backward keeps the first.
template <typename T, int V>
__device__ void residual_online_stats_row(const T* h, const T* y, const T* w, T* s, T* s2, T* xw, float* ss_out,
                                          int Cs) {
    float sum_squares = 0.0f;
    for (int j = threadIdx.x * V; j < Cs; j += blockDim.x * V) {
        float hv[V], v[V];  // v: y, then w, then x * w (registers for 1,024 threads at 2 blocks per SM)
        load_vec<V>(h + j, hv);
        load_vec<V>(y + j, v);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            hv[k] = to_float(from_float<T>(hv[k] + v[k]));  // the sum as stored
            sum_squares += hv[k] * hv[k];
        }
        store_vec<V>(s + j, hv);
        store_vec<V>(s2 + j, hv);
        load_vec<V>(w + j, v);
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] *= hv[k];
        store_vec<V>(xw + j, v);
    }
    const float total = block_sum(sum_squares);
    if (threadIdx.x == 0) *ss_out = total;
}

template <typename T>
__device__ void residual_online_stats(const T* h, const T* y, const T* w, T* s, T* s2, T* xw, float* ss, int Cs) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * Cs;
    const int V = VecWidth<T>::value;
    if (Cs % V == 0 && aligned16(h) && aligned16(y) && aligned16(w) && aligned16(s) && aligned16(s2) && aligned16(xw))
        residual_online_stats_row<T, V>(h + offset, y + offset, w, s + offset, s2 + offset, xw + offset, ss + row, Cs);
    else
        residual_online_stats_row<T, 1>(h + offset, y + offset, w, s + offset, s2 + offset, xw + offset, ss + row, Cs);
}

// Online RMSNorm, second half, one block per row: P [N,R], ss_total [N] summed over the whole
// C_total -> out [N,R] = P * rsqrt(ss_total / C_total + eps). out may be P itself.
template <typename T, int V>
__device__ void rescale_row(const T* P, float ss_total, T* out, int R, int C_total, float eps) {
    const float rstd = rsqrtf(ss_total / C_total + eps);
    for (int j = threadIdx.x * V; j < R; j += blockDim.x * V) {
        float pv[V];
        load_vec<V>(P + j, pv);
#pragma unroll
        for (int k = 0; k < V; ++k) pv[k] *= rstd;
        store_vec<V>(out + j, pv);
    }
}

template <typename T>
__device__ void rescale_rows(const T* P, const float* ss_total, T* out, int R, int C_total, float eps) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * R;
    const int V = VecWidth<T>::value;
    if (R % V == 0 && aligned16(P) && aligned16(out))
        rescale_row<T, V>(P + offset, ss_total[row], out + offset, R, C_total, eps);
    else
        rescale_row<T, 1>(P + offset, ss_total[row], out + offset, R, C_total, eps);
}

// The column tiles' last step: dw [C] += the sum over chunks of dw_partial [n_chunks, C] (fp32), one
// launch instead of a reduction and an addition. A block owns DW_COLUMNS columns; DW_ROW_GROUPS
// threads per column each sum every DW_ROW_GROUPS-th chunk in order, then the first sums the groups'
// totals in group order (deterministic) and adds the column's total to dw. Launch: dw_accumulate_launch
// in boostmpi/gpu/launch_plan.py (DW_COLUMNS x DW_ROW_GROUPS threads, ceil(C / DW_COLUMNS) blocks).
#if !defined(DW_COLUMNS) || !defined(DW_ROW_GROUPS)
#error "rmsnorm.cu takes DW_COLUMNS and DW_ROW_GROUPS from the launch plan: compile with boostmpi.gpu.launch_plan.compile_options(\"rmsnorm\", ...)"
#endif

extern "C" __global__ void dw_accumulate_f32(const float* dw_partial, float* dw, int n_chunks, int C) {
    __shared__ float group_sums[DW_ROW_GROUPS][DW_COLUMNS];
    const int column = threadIdx.x % DW_COLUMNS, group = threadIdx.x / DW_COLUMNS;
    const long long j = static_cast<long long>(blockIdx.x) * DW_COLUMNS + column;
    float sum = 0.0f;
    if (j < C) {
#pragma unroll 4
        for (int c = group; c < n_chunks; c += DW_ROW_GROUPS) sum += dw_partial[static_cast<long long>(c) * C + j];
    }
    group_sums[group][column] = sum;
    __syncthreads();
    if (group == 0 && j < C) {
        float total = 0.0f;
        for (int g = 0; g < DW_ROW_GROUPS; ++g) total += group_sums[g][column];
        dw[j] += total;
    }
}

#define RMSNORM_ENTRY_POINTS(T, SUFFIX)                                                                   \
    extern "C" __global__ void rmsnorm_forward_##SUFFIX(const T* x, const T* w, T* y, float* rstd, int C, \
                                                        float eps) {                                      \
        rmsnorm_forward<T>(x, w, y, rstd, C, eps);                                                        \
    }                                                                                                     \
    extern "C" __global__ void rmsnorm_projection_##SUFFIX(const T* dy, const T* x, const T* w,           \
                                                           const float* rstd, float* proj, int C) {       \
        rmsnorm_projection<T>(dy, x, w, rstd, proj, C);                                                   \
    }                                                                                                     \
    extern "C" __global__ void rmsnorm_backward_##SUFFIX(const T* dy, const T* x, const T* w,             \
                                                         const float* rstd, const float* proj, T* dx,     \
                                                         float* dw_partial, int N, int C,                 \
                                                         int rows_per_chunk) {                            \
        rmsnorm_backward<T>(dy, x, w, rstd, proj, dx, dw_partial, N, C, rows_per_chunk);                  \
    }                                                                                                     \
    extern "C" __global__ void rmsnorm_online_stats_##SUFFIX(const T* x, const T* w, T* xw, float* ss,    \
                                                             int Cs) {                                    \
        rmsnorm_online_stats<T>(x, w, xw, ss, Cs);                                                        \
    }                                                                                                     \
    extern "C" __global__ void residual_online_stats_##SUFFIX(const T* h, const T* y, const T* w, T* s,     \
                                                              T* s2, T* xw, float* ss, int Cs) {           \
        residual_online_stats<T>(h, y, w, s, s2, xw, ss, Cs);                                              \
    }                                                                                                     \
    extern "C" __global__ void rescale_rows_##SUFFIX(const T* P, const float* ss_total, T* out, int R,    \
                                                     int C_total, float eps) {                            \
        rescale_rows<T>(P, ss_total, out, R, C_total, eps);                                               \
    }

RMSNORM_ENTRY_POINTS(float, f32)
RMSNORM_ENTRY_POINTS(bf16, bf16)
