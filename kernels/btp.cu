// Bottleneck-aware tensor parallelism's rank-R elementwise work. Forward: online RMSNorm's row
// rescale and cola's SiLU in one pass. Backward through a normed low-rank group: the elementwise
// chain as two row kernels around the GEMM dxw = dP . A^T:
//   before it:  dZ = dZs * silu'(Z) (cola; dZs itself otherwise),  dP = dZ * rstd,
//               dS = -0.5 / C_total * rstd^2 * sum_r dZ * Z
//   after it:   dx = dxw * w + 2 * x * dS,   dw = sum over rows of dxw * x
// (Z = rstd * sum_shards xw . A exactly; dZ and Z are replicated over the tp group, so dS is local.)
// fp32 arithmetic; dZ never goes to memory.
// Entry points per storage type T: <kernel>_f32 (float) and <kernel>_bf16 (bfloat16 bits).
#include "common.cuh"

// One block per row: dZs, Z [N,R], rstd [N] (fp32) -> dP [N,R], dS [N] (fp32).
template <typename T, int V>
__device__ void btp_backward_pre_row(const T* dZs, const T* Z, float r, T* dP, float* dS_out, int R, int C_total,
                                     bool act) {
    float dot = 0.0f;
    for (int j = threadIdx.x * V; j < R; j += blockDim.x * V) {
        float dv[V], zv[V], pv[V];
        load_vec<V>(dZs + j, dv);
        load_vec<V>(Z + j, zv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float dz = act ? dv[k] * silu_derivative(zv[k]) : dv[k];
            dot += dz * zv[k];
            pv[k] = dz * r;
        }
        store_vec<V>(dP + j, pv);
    }
    const float total = block_sum(dot);
    if (threadIdx.x == 0) *dS_out = (-0.5f / C_total) * total * (r * r);
}

template <typename T>
__device__ void btp_backward_pre(const T* dZs, const T* Z, const float* rstd, T* dP, float* dS, int R, int C_total,
                                 int act) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * R;
    const int V = VecWidth<T>::value;
    if (R % V == 0 && aligned16(dZs) && aligned16(Z) && aligned16(dP))
        btp_backward_pre_row<T, V>(dZs + offset, Z + offset, rstd[row], dP + offset, dS + row, R, C_total, act != 0);
    else
        btp_backward_pre_row<T, 1>(dZs + offset, Z + offset, rstd[row], dP + offset, dS + row, R, C_total, act != 0);
}

// Online RMSNorm's second half with cola's SiLU, one block per row: P [N,R], ss_total [N] (fp32)
// -> Z = P * rsqrt(ss_total / C_total + eps) and Zs = silu(Z) (of Z as stored), in one read of P.
template <typename T, int V>
__device__ void rescale_silu_row(const T* P, float ss_total, T* Z, T* Zs, int R, int C_total, float eps) {
    const float rstd = rsqrtf(ss_total / C_total + eps);
    for (int j = threadIdx.x * V; j < R; j += blockDim.x * V) {
        float pv[V], zv[V], sv[V];
        load_vec<V>(P + j, pv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            zv[k] = pv[k] * rstd;
            sv[k] = silu(to_float(from_float<T>(zv[k])));
        }
        store_vec<V>(Z + j, zv);
        store_vec<V>(Zs + j, sv);
    }
}

template <typename T>
__device__ void btp_rescale_silu(const T* P, const float* ss_total, T* Z, T* Zs, int R, int C_total, float eps) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * R;
    const int V = VecWidth<T>::value;
    if (R % V == 0 && aligned16(P) && aligned16(Z) && aligned16(Zs))
        rescale_silu_row<T, V>(P + offset, ss_total[row], Z + offset, Zs + offset, R, C_total, eps);
    else
        rescale_silu_row<T, 1>(P + offset, ss_total[row], Z + offset, Zs + offset, R, C_total, eps);
}

// V consecutive floats (V = 4 or 8: 16-byte loads from 16-byte aligned memory; V = 1: one float).
template <int V>
struct FloatLoad {
    static __device__ __forceinline__ void load(const float* p, float* out) {
#pragma unroll
        for (int h = 0; h < V; h += 4) load_vec<4>(p + h, out + h);
    }
};

template <>
struct FloatLoad<1> {
    static __device__ __forceinline__ void load(const float* p, float* out) { out[0] = p[0]; }
};

// Blocks stride over rows: dxw [N,Cs] (fp32), x [N,Cs], w [Cs], dS [N] (fp32) -> dx [N,Cs],
// dw_partial [gridDim.x, Cs] (fp32; summed over blocks by the caller). A thread owns the same
// columns in every row and keeps its share of dw in shared memory (Cs floats, dynamic).
template <typename T, int V>
__device__ void btp_backward_post_rows(const float* dxw, const T* x, const T* w, const float* dS, T* dx,
                                       float* dw_partial, int N, int Cs) {
    extern __shared__ float dw_accumulator[];
    for (int j = threadIdx.x * V; j < Cs; j += blockDim.x * V) {
#pragma unroll
        for (int k = 0; k < V; ++k) dw_accumulator[j + k] = 0.0f;
    }
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const long long offset = static_cast<long long>(row) * Cs;
        const float s2 = 2.0f * dS[row];
        for (int j = threadIdx.x * V; j < Cs; j += blockDim.x * V) {
            float gv[V], xv[V], wv[V], dxv[V];
            FloatLoad<V>::load(dxw + offset + j, gv);
            load_vec<V>(x + offset + j, xv);
            load_vec<V>(w + j, wv);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                dxv[k] = gv[k] * wv[k] + s2 * xv[k];
                dw_accumulator[j + k] += gv[k] * xv[k];
            }
            store_vec<V>(dx + offset + j, dxv);
        }
    }
    float* block_dw = dw_partial + static_cast<long long>(blockIdx.x) * Cs;
    for (int j = threadIdx.x * V; j < Cs; j += blockDim.x * V) {
#pragma unroll
        for (int k = 0; k < V; ++k) block_dw[j + k] = dw_accumulator[j + k];
    }
}

template <typename T>
__device__ void btp_backward_post(const float* dxw, const T* x, const T* w, const float* dS, T* dx,
                                  float* dw_partial, int N, int Cs) {
    const int V = VecWidth<T>::value;
    if (Cs % V == 0 && aligned16(dxw) && aligned16(x) && aligned16(w) && aligned16(dx))
        btp_backward_post_rows<T, V>(dxw, x, w, dS, dx, dw_partial, N, Cs);
    else
        btp_backward_post_rows<T, 1>(dxw, x, w, dS, dx, dw_partial, N, Cs);
}

#define BTP_ENTRY_POINTS(T, SUFFIX)                                                                        \
    extern "C" __global__ void btp_rescale_silu_##SUFFIX(const T* P, const float* ss_total, T* Z, T* Zs,    \
                                                         int R, int C_total, float eps) {                  \
        btp_rescale_silu<T>(P, ss_total, Z, Zs, R, C_total, eps);                                          \
    }                                                                                                      \
    extern "C" __global__ void btp_backward_pre_##SUFFIX(const T* dZs, const T* Z, const float* rstd, T* dP, \
                                                         float* dS, int R, int C_total, int act) {          \
        btp_backward_pre<T>(dZs, Z, rstd, dP, dS, R, C_total, act);                                        \
    }                                                                                                      \
    extern "C" __global__ void btp_backward_post_##SUFFIX(const float* dxw, const T* x, const T* w,        \
                                                          const float* dS, T* dx, float* dw_partial, int N, \
                                                          int Cs) {                                        \
        btp_backward_post<T>(dxw, x, w, dS, dx, dw_partial, N, Cs);                                        \
    }

BTP_ENTRY_POINTS(float, f32)
BTP_ENTRY_POINTS(bf16, bf16)
