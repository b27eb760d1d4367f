// Bottleneck-aware tensor parallelism's rank-R elementwise work. Forward: online RMSNorm's row
// rescale and cola's SiLU in one pass. Backward through a normed low-rank group: the elementwise
// chain as two row kernels around the GEMM dxw = dP . A^T:
//   before it:  dZ = dZs * silu'(Z) (cola; dZs itself otherwise),  dP = dZ * rstd,
//               dS = -0.5 / C_total * rstd^2 * sum_r dZ * Z
//   after it:   dx = dxw * w + 2 * x * dS (+ the residual's gradient from above, when given: the two
//               gradients that meet at the residual summed in the same pass, rounded once),
//               dw = sum over rows of dxw * x
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
// -> Z = P * rsqrt(ss_total / C_total + eps), Zs = silu(Z) (of Z as stored), in one read of P, and
// the row's statistic rstd_out [N] (fp32) that the backward reads.
template <typename T, int V>
__device__ void rescale_silu_row(const T* P, float ss_total, T* Z, T* Zs, float* rstd_out, int R, int C_total,
                                 float eps) {
    const float rstd = rsqrtf(ss_total / C_total + eps);
    if (threadIdx.x == 0) *rstd_out = rstd;
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
__device__ void btp_rescale_silu(const T* P, const float* ss_total, T* Z, T* Zs, float* rstd, int R, int C_total,
                                 float eps) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * R;
    const int V = VecWidth<T>::value;
    if (R % V == 0 && aligned16(P) && aligned16(Z) && aligned16(Zs))
        rescale_silu_row<T, V>(P + offset, ss_total[row], Z + offset, Zs + offset, rstd + row, R, C_total, eps);
    else
        rescale_silu_row<T, 1>(P + offset, ss_total[row], Z + offset, Zs + offset, rstd + row, R, C_total, eps);
}

// V consecutive floats of the float32 dxw beside V elements of T (V = 4 or 8: 16-byte loads from
// 16-byte aligned memory when VECTORISED; else element by element, `width` of them).
template <bool VECTORISED>
struct FloatColumns {
    template <int V>
    static __device__ __forceinline__ void load(const float* p, float* out, int width) {
        Columns<false>::template load<V>(p, out, width);
    }
};

template <>
struct FloatColumns<true> {
    template <int V>
    static __device__ __forceinline__ void load(const float* p, float* out, int) {
#pragma unroll
        for (int h = 0; h < V; h += 4) load_vec<4>(p + h, out + h);
    }
};

// dxw [N,Cs] (fp32), x [N,Cs], w [Cs], dS [N] (fp32) -> dx [N,Cs] (plus residual [N,Cs] when
// add_residual: the residual's gradient from above, added before the one rounding), dw_partial
// [n_chunks, Cs] (fp32, summed over chunks by the caller). The column tiles of column_tile_walk
// (common.cuh), as rmsnorm_backward: no shared memory, so any Cs fits.
template <typename T, bool VECTORISED>
__device__ void btp_backward_post_tile(const float* dxw, const T* x, const T* w, const float* dS, const T* residual,
                                       T* dx, float* dw_partial, int N, int Cs, int rows_per_chunk, bool add_residual) {
    column_tile_walk<T, VECTORISED>(w, dw_partial, N, Cs, rows_per_chunk,
                                    [=](long long offset, long long row, int width, const float* wv, float* dw) {
        constexpr int V = VecWidth<T>::value;
        const float s2 = 2.0f * dS[row];
        float gv[V], xv[V], rv[V], dxv[V];
        FloatColumns<VECTORISED>::template load<V>(dxw + offset, gv, width);
        Columns<VECTORISED>::template load<V>(x + offset, xv, width);
        if (add_residual) {
            Columns<VECTORISED>::template load<V>(residual + offset, rv, width);
        } else {
#pragma unroll
            for (int k = 0; k < V; ++k) rv[k] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
            dxv[k] = rv[k] + (gv[k] * wv[k] + s2 * xv[k]);
            dw[k] += gv[k] * xv[k];
        }
        Columns<VECTORISED>::template store<V>(dx + offset, dxv, width);
    });
}

template <typename T>
__device__ void btp_backward_post(const float* dxw, const T* x, const T* w, const float* dS, const T* residual, T* dx,
                                  float* dw_partial, int N, int Cs, int rows_per_chunk, int add_residual) {
    if (Cs % VecWidth<T>::value == 0 && aligned16(dxw) && aligned16(x) && aligned16(w) && aligned16(dx)
        && aligned16(residual))
        btp_backward_post_tile<T, true>(dxw, x, w, dS, residual, dx, dw_partial, N, Cs, rows_per_chunk, add_residual != 0);
    else
        btp_backward_post_tile<T, false>(dxw, x, w, dS, residual, dx, dw_partial, N, Cs, rows_per_chunk,
                                         add_residual != 0);
}

#define BTP_ENTRY_POINTS(T, SUFFIX)                                                                        \
    extern "C" __global__ void btp_rescale_silu_##SUFFIX(const T* P, const float* ss_total, T* Z, T* Zs,    \
                                                         float* rstd, int R, int C_total, float eps) {     \
        btp_rescale_silu<T>(P, ss_total, Z, Zs, rstd, R, C_total, eps);                                    \
    }                                                                                                      \
    extern "C" __global__ void btp_backward_pre_##SUFFIX(const T* dZs, const T* Z, const float* rstd, T* dP, \
                                                         float* dS, int R, int C_total, int act) {          \
        btp_backward_pre<T>(dZs, Z, rstd, dP, dS, R, C_total, act);                                        \
    }                                                                                                      \
    extern "C" __global__ void btp_backward_post_##SUFFIX(const float* dxw, const T* x, const T* w,        \
                                                          const float* dS, const T* residual, T* dx,       \
                                                          float* dw_partial, int N, int Cs,                \
                                                          int rows_per_chunk, int add_residual) {          \
        btp_backward_post<T>(dxw, x, w, dS, residual, dx, dw_partial, N, Cs, rows_per_chunk, add_residual); \
    }

BTP_ENTRY_POINTS(float, f32)
BTP_ENTRY_POINTS(bf16, bf16)
