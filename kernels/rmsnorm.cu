// RMSNorm, forward and backward, and the two halves of online RMSNorm for bottleneck-aware
// tensor parallelism. Rows of C elements; statistics and arithmetic in fp32.
// Entry points per storage type T: <kernel>_f32 (float) and <kernel>_bf16 (bfloat16 bits).
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

template <typename T>
__device__ void rmsnorm_forward(const T* x, const T* w, T* y, float* rstd, int C, float eps) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * C;
    const int V = VecWidth<T>::value;
    if (C % V == 0 && aligned16(x) && aligned16(w) && aligned16(y))
        rmsnorm_forward_row<T, V>(x + offset, w, y + offset, rstd + row, C, eps);
    else
        rmsnorm_forward_row<T, 1>(x + offset, w, y + offset, rstd + row, C, eps);
}

// Blocks stride over rows: dy, x [N,C], w [C], rstd [N] -> dx [N,C], dw_partial [gridDim.x, C].
//   dx = rstd * (dy * w) - x * rstd^3 * mean(dy * w * x)      (per row)
//   dw = sum over rows of dy * x * rstd                        (dw_partial summed by the caller)
// A thread owns the same columns in every row, so it accumulates its share of dw in shared
// memory (C floats, dynamic) with no atomics; each block writes its partial sums once.
template <typename T, int V>
__device__ void rmsnorm_backward_rows(const T* dy, const T* x, const T* w, const float* rstd, T* dx,
                                      float* dw_partial, int N, int C) {
    extern __shared__ float dw_accumulator[];
    for (int j = threadIdx.x * V; j < C; j += blockDim.x * V) {
#pragma unroll
        for (int k = 0; k < V; ++k) dw_accumulator[j + k] = 0.0f;
    }
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const long long offset = static_cast<long long>(row) * C;
        const float r = rstd[row];
        float dot = 0.0f;
        for (int j = threadIdx.x * V; j < C; j += blockDim.x * V) {
            float dyv[V], xv[V], wv[V];
            load_vec<V>(dy + offset + j, dyv);
            load_vec<V>(x + offset + j, xv);
            load_vec<V>(w + j, wv);
#pragma unroll
            for (int k = 0; k < V; ++k) dot += dyv[k] * wv[k] * xv[k];
        }
        const float x_coefficient = r * r * r * (block_sum(dot) / C);
        for (int j = threadIdx.x * V; j < C; j += blockDim.x * V) {
            float dyv[V], xv[V], wv[V], dxv[V];
            load_vec<V>(dy + offset + j, dyv);
            load_vec<V>(x + offset + j, xv);
            load_vec<V>(w + j, wv);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                dxv[k] = r * (dyv[k] * wv[k]) - xv[k] * x_coefficient;
                dw_accumulator[j + k] += dyv[k] * xv[k] * r;
            }
            store_vec<V>(dx + offset + j, dxv);
        }
    }
    float* block_dw = dw_partial + static_cast<long long>(blockIdx.x) * C;
    for (int j = threadIdx.x * V; j < C; j += blockDim.x * V) {
#pragma unroll
        for (int k = 0; k < V; ++k) block_dw[j + k] = dw_accumulator[j + k];
    }
}

template <typename T>
__device__ void rmsnorm_backward(const T* dy, const T* x, const T* w, const float* rstd, T* dx,
                                 float* dw_partial, int N, int C) {
    const int V = VecWidth<T>::value;
    if (C % V == 0 && aligned16(dy) && aligned16(x) && aligned16(w) && aligned16(dx))
        rmsnorm_backward_rows<T, V>(dy, x, w, rstd, dx, dw_partial, N, C);
    else
        rmsnorm_backward_rows<T, 1>(dy, x, w, rstd, dx, dw_partial, N, C);
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

#define RMSNORM_ENTRY_POINTS(T, SUFFIX)                                                                   \
    extern "C" __global__ void rmsnorm_forward_##SUFFIX(const T* x, const T* w, T* y, float* rstd, int C, \
                                                        float eps) {                                      \
        rmsnorm_forward<T>(x, w, y, rstd, C, eps);                                                        \
    }                                                                                                     \
    extern "C" __global__ void rmsnorm_backward_##SUFFIX(const T* dy, const T* x, const T* w,             \
                                                         const float* rstd, T* dx, float* dw_partial,     \
                                                         int N, int C) {                                  \
        rmsnorm_backward<T>(dy, x, w, rstd, dx, dw_partial, N, C);                                        \
    }                                                                                                     \
    extern "C" __global__ void rmsnorm_online_stats_##SUFFIX(const T* x, const T* w, T* xw, float* ss,    \
                                                             int Cs) {                                    \
        rmsnorm_online_stats<T>(x, w, xw, ss, Cs);                                                        \
    }                                                                                                     \
    extern "C" __global__ void rescale_rows_##SUFFIX(const T* P, const float* ss_total, T* out, int R,    \
                                                     int C_total, float eps) {                            \
        rescale_rows<T>(P, ss_total, out, R, C_total, eps);                                               \
    }

RMSNORM_ENTRY_POINTS(float, f32)
RMSNORM_ENTRY_POINTS(bf16, bf16)
