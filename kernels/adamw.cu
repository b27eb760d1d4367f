// AdamW over the flat float32 master buffer in one pass: every parameter tensor of the slice at
// once (the multi-tensor update), each element read and written once instead of by the dozen
// vector operations (and two more per weight-decay range) of the NumPy code in
// boostmpi/train/optim.py, which is its specification:
//   g = g * grad_scale
//   m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
//   p -= (lr wd) p                                   where weight decay applies
//   p -= m / (sqrt(v) / sqrt(bc2) + eps) * (lr / bc1)
// Weight decay applies on [bounds[2i], bounds[2i+1]) (sorted, disjoint): an element is inside
// when an odd number of bounds lie at or below it (a binary search over the few bounds).
#include "common.cuh"

__device__ __forceinline__ bool decayed(const long long* bounds, int n_bounds, long long i) {
    int lo = 0, hi = n_bounds;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (bounds[mid] <= i)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (lo & 1) != 0;
}

struct AdamWStep {
    float* p;
    const float* g;
    float* m;
    float* v;
    const long long* bounds;
    int n_bounds;
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, grad_scale, step_size, sqrt_bc2;
    template <int V>
    __device__ void apply(long long i) const {
        float pv[V], gv[V], mv[V], vv[V];
        load_vec<V>(p + i, pv);
        load_vec<V>(g + i, gv);
        load_vec<V>(m + i, mv);
        load_vec<V>(v + i, vv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float grad = gv[k] * grad_scale;
            mv[k] = mv[k] * beta1 + grad * one_minus_beta1;
            vv[k] = vv[k] * beta2 + grad * grad * one_minus_beta2;
            if (n_bounds > 0 && decayed(bounds, n_bounds, i + k)) pv[k] -= pv[k] * decay;
            pv[k] -= mv[k] / (sqrtf(vv[k]) / sqrt_bc2 + eps) * step_size;
        }
        store_vec<V>(p + i, pv);
        store_vec<V>(m + i, mv);
        store_vec<V>(v + i, vv);
    }
};

// p, g, m, v [n] float32; bounds [n_bounds] int64; 1 - beta rounded once from double on the host. decay = lr * weight_decay, step_size = lr / bc1,
// sqrt_bc2 = sqrt(bc2) (bias corrections bc = 1 - beta^t, computed on the host).
extern "C" __global__ void adamw_step_f32(float* p, const float* g, float* m, float* v, long long n,
                                          const long long* bounds, int n_bounds, float beta1,
                                          float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                                          float decay, float grad_scale, float step_size, float sqrt_bc2) {
    const AdamWStep op{p, g, m, v, bounds, n_bounds, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay,
                       grad_scale, step_size, sqrt_bc2};
    elementwise<float>(n, aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v), op);
}

// The same update, for a step captured once in a CUDA graph and replayed (boostmpi/train/graph_step.py),
// whose launch arguments are fixed at the capture: what changes per step is read from the device.
// scalars[3] float32 = {lr * wd, lr / bc1, sqrt(bc2)}, written by the host before each step (the
// values adamw_step_f32 is handed); the gradient scale is the clipping coefficient of the norm
// sqrt(*grad_sq), computed as boostmpi/train/optim.py's clip_coefficient does, in float64: 1 unless
// max_norm > 0 and the norm is finite and above max_norm, then max_norm / (norm + 1e-6), rounded
// once to float32 (as the host's coefficient is when it is passed by value).
__device__ __forceinline__ float clip_scale(double grad_sq, double max_norm) {
    const double norm = sqrt(grad_sq);
    if (max_norm <= 0.0 || !isfinite(norm) || norm <= max_norm) return 1.0f;
    return static_cast<float>(max_norm / (norm + 1e-6));
}

extern "C" __global__ void adamw_step_device_f32(float* p, const float* g, float* m, float* v, long long n,
                                                 const long long* bounds, int n_bounds, float beta1,
                                                 float one_minus_beta1, float beta2, float one_minus_beta2,
                                                 float eps, const float* scalars, const double* grad_sq,
                                                 double max_norm) {
    const AdamWStep op{p, g, m, v, bounds, n_bounds, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, scalars[0],
                       clip_scale(*grad_sq, max_norm), scalars[1], scalars[2]};
    elementwise<float>(n, aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v), op);
}

// The squared L2 norm of the gradient over a set of ranges of the flat float32 buffer, every
// parameter block at once (the clipping norm's multi-tensor reduction; boostmpi.parallel.engine's
// NumPy `_grad_sq` is its specification): ranges [bounds[2i], bounds[2i+1]) of g, each thread
// striding through every range with the whole grid, its sum in fp32, the block's sum (in warp
// order, deterministic) written to partial[blockIdx.x]; the caller sums the partials.
extern "C" __global__ void sum_squares_ranges_f32(const float* g, const long long* bounds, int n_ranges,
                                                  float* partial) {
    const long long thread = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long n_threads = static_cast<long long>(gridDim.x) * blockDim.x;
    float acc = 0.0f;
    for (int r = 0; r < n_ranges; ++r) {
        const long long hi = bounds[2 * r + 1];
        for (long long i = bounds[2 * r] + thread; i < hi; i += n_threads) acc += g[i] * g[i];
    }
    const float total = block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = total;
}
