// The low-rank bottleneck's elementwise work, fused: SiLU on the rank-R activation (cola) and
// the MLP gate product, forward and backward. Every kernel reads its inputs once and writes
// each output once; nothing intermediate goes to memory. fp32 arithmetic.
// Entry points per storage type T: <kernel>_f32 (float) and <kernel>_bf16 (bfloat16 bits).
#include "common.cuh"

// z = silu(a)
template <typename T>
struct SiluForward {
    const T* a;
    T* z;
    template <int V>
    __device__ void apply(long long i) const {
        float av[V], zv[V];
        load_vec<V>(a + i, av);
#pragma unroll
        for (int k = 0; k < V; ++k) zv[k] = silu(av[k]);
        store_vec<V>(z + i, zv);
    }
};

// da = dz * silu'(a)
template <typename T>
struct SiluBackward {
    const T* a;
    const T* dz;
    T* da;
    template <int V>
    __device__ void apply(long long i) const {
        float av[V], dzv[V], dav[V];
        load_vec<V>(a + i, av);
        load_vec<V>(dz + i, dzv);
#pragma unroll
        for (int k = 0; k < V; ++k) dav[k] = dzv[k] * silu_derivative(av[k]);
        store_vec<V>(da + i, dav);
    }
};

// y = act(g) * u, act = silu when `act` is set, identity otherwise
template <typename T>
struct GateForward {
    const T* g;
    const T* u;
    T* y;
    bool act;
    template <int V>
    __device__ void apply(long long i) const {
        float gv[V], uv[V], yv[V];
        load_vec<V>(g + i, gv);
        load_vec<V>(u + i, uv);
#pragma unroll
        for (int k = 0; k < V; ++k) yv[k] = (act ? silu(gv[k]) : gv[k]) * uv[k];
        store_vec<V>(y + i, yv);
    }
};

// dg = dy * u * act'(g),  du = dy * act(g): both from one read of g, u, dy; act(g) is never stored
template <typename T>
struct GateBackward {
    const T* g;
    const T* u;
    const T* dy;
    T* dg;
    T* du;
    bool act;
    template <int V>
    __device__ void apply(long long i) const {
        float gv[V], uv[V], dyv[V], dgv[V], duv[V];
        load_vec<V>(g + i, gv);
        load_vec<V>(u + i, uv);
        load_vec<V>(dy + i, dyv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            if (act) {
                const float s = sigmoid(gv[k]);
                duv[k] = dyv[k] * (gv[k] * s);
                dgv[k] = dyv[k] * uv[k] * (s * (1.0f + gv[k] * (1.0f - s)));
            } else {
                duv[k] = dyv[k] * gv[k];
                dgv[k] = dyv[k] * uv[k];
            }
        }
        store_vec<V>(dg + i, dgv);
        store_vec<V>(du + i, duv);
    }
};

#define LOWRANK_ENTRY_POINTS(T, SUFFIX)                                                                    \
    extern "C" __global__ void silu_forward_##SUFFIX(const T* a, T* z, long long n) {                      \
        const SiluForward<T> op = {a, z};                                                                  \
        elementwise<T>(n, aligned16(a) && aligned16(z), op);                                               \
    }                                                                                                      \
    extern "C" __global__ void silu_backward_##SUFFIX(const T* a, const T* dz, T* da, long long n) {       \
        const SiluBackward<T> op = {a, dz, da};                                                            \
        elementwise<T>(n, aligned16(a) && aligned16(dz) && aligned16(da), op);                             \
    }                                                                                                      \
    extern "C" __global__ void gate_forward_##SUFFIX(const T* g, const T* u, T* y, long long n, int act) { \
        const GateForward<T> op = {g, u, y, act != 0};                                                     \
        elementwise<T>(n, aligned16(g) && aligned16(u) && aligned16(y), op);                               \
    }                                                                                                      \
    extern "C" __global__ void gate_backward_##SUFFIX(const T* g, const T* u, const T* dy, T* dg, T* du,   \
                                                      long long n, int act) {                              \
        const GateBackward<T> op = {g, u, dy, dg, du, act != 0};                                           \
        elementwise<T>(n, aligned16(g) && aligned16(u) && aligned16(dy) && aligned16(dg) && aligned16(du), \
                       op);                                                                                \
    }

LOWRANK_ENTRY_POINTS(float, f32)
LOWRANK_ENTRY_POINTS(bf16, bf16)
