// Fused softmax cross-entropy over rows of logits [N,V] with targets [N], fp32 statistics.
// Entry points softmax_xent_<T>_<I>: T = f32 | bf16 (logits), I = i32 | i64 (targets).
#include "common.cuh"

// One block per row. logits [N,V], targets [N] -> loss [N] (fp32) and, when write_grad is set,
//   dlogits [N,V] = (softmax(logits) - onehot(target)) * grad_scale
// dlogits may be logits itself (in place). loss = logsumexp(row) - row[target], with the
// logsumexp max-subtracted. A target outside [0, V) gives a NaN loss (bad data shows in the
// loss instead of faulting) and a gradient without the one-hot term.
template <typename T, int VW>
__device__ void softmax_xent_row(const T* logits, long long target, float* loss_out, T* dlogits,
                                 bool write_grad, int V, float grad_scale) {
    const bool target_valid = target >= 0 && target < V;
    // read before any thread can overwrite the row in place (the reductions below synchronise)
    const float target_logit = (threadIdx.x == 0 && target_valid) ? to_float(logits[target]) : 0.0f;

    // online logsumexp per thread: running max m and sum of exp(v - m), then merged over the block
    float m = negative_infinity();
    float sum = 0.0f;
    for (int j = threadIdx.x * VW; j < V; j += blockDim.x * VW) {
        float v[VW];
        load_vec<VW>(logits + j, v);
#pragma unroll
        for (int k = 0; k < VW; ++k) {
            if (v[k] > m) {
                sum = sum * expf(m - v[k]) + 1.0f;
                m = v[k];
            } else if (m > negative_infinity()) {  // -inf logits (masked) add nothing, not NaN
                sum += expf(v[k] - m);
            }
        }
    }
    const float row_max = block_max(m);
    const float row_sum = block_sum(sum > 0.0f ? sum * expf(m - row_max) : 0.0f);
    const float logsumexp = row_max + logf(row_sum);
    if (threadIdx.x == 0) {
        const float nan = __uint_as_float(0x7fc00000u);
        *loss_out = target_valid ? logsumexp - target_logit : nan;
    }
    if (!write_grad) return;
    for (int j = threadIdx.x * VW; j < V; j += blockDim.x * VW) {
        float v[VW];
        load_vec<VW>(logits + j, v);
#pragma unroll
        for (int k = 0; k < VW; ++k) {
            const float onehot = (j + k == target) ? 1.0f : 0.0f;
            v[k] = (expf(v[k] - logsumexp) - onehot) * grad_scale;
        }
        store_vec<VW>(dlogits + j, v);
    }
}

template <typename T, typename I>
__device__ void softmax_xent(const T* logits, const I* targets, float* loss, T* dlogits, int write_grad, int V,
                             float grad_scale) {
    const int row = blockIdx.x;
    const long long offset = static_cast<long long>(row) * V;
    const long long target = static_cast<long long>(targets[row]);
    const int VW = VecWidth<T>::value;
    if (V % VW == 0 && aligned16(logits) && aligned16(dlogits))
        softmax_xent_row<T, VW>(logits + offset, target, loss + row, dlogits + offset, write_grad != 0, V,
                                   grad_scale);
    else
        softmax_xent_row<T, 1>(logits + offset, target, loss + row, dlogits + offset, write_grad != 0, V,
                                  grad_scale);
}

#define SOFTMAX_XENT_ENTRY_POINT(T, I, SUFFIX)                                                              \
    extern "C" __global__ void softmax_xent_##SUFFIX(const T* logits, const I* targets, float* loss,         \
                                                     T* dlogits, int write_grad, int V, float grad_scale) { \
        softmax_xent<T, I>(logits, targets, loss, dlogits, write_grad, V, grad_scale);                       \
    }

SOFTMAX_XENT_ENTRY_POINT(float, int, f32_i32)
SOFTMAX_XENT_ENTRY_POINT(float, long long, f32_i64)
SOFTMAX_XENT_ENTRY_POINT(bf16, int, bf16_i32)
SOFTMAX_XENT_ENTRY_POINT(bf16, long long, bf16_i64)
