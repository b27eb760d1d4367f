// RoPE, forward and backward, on q or k [B, T, heads, Dh] with the model's cos, sin tables
// [T, Dh]: one thread per pair (d, d + Dh/2), read once and written once, where the unfused
// version makes several passes. With c = cos[t], s = sin[t], h = Dh/2:
//   forward:  y[d] = x[d] c[d] - x[d+h] s[d],    y[d+h] = x[d+h] c[d+h] + x[d] s[d+h]
//   backward: dx[d] = dy[d] c[d] + dy[d+h] s[d+h],  dx[d+h] = dy[d+h] c[d+h] - dy[d] s[d]
// Entry points per storage type T: rope_<forward|backward>_f32 (float) and _bf16 (bfloat16 bits).
// A grid-stride loop: any block size works (the wrapper's: boostmpi/gpu/launch_plan.py, rope_grid).
#include "common.cuh"

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

#define ROPE_ENTRY_POINTS(T, SUFFIX)                                                                               \
    extern "C" __global__ void rope_forward_##SUFFIX(const T* x, const T* cos_table, const T* sin_table, T* out,   \
                                                     long long pairs, int tokens, int heads, int Dh) {             \
        rope<T, false>(x, cos_table, sin_table, out, pairs, tokens, heads, Dh);                                    \
    }                                                                                                              \
    extern "C" __global__ void rope_backward_##SUFFIX(const T* dy, const T* cos_table, const T* sin_table, T* dx,  \
                                                      long long pairs, int tokens, int heads, int Dh) {            \
        rope<T, true>(dy, cos_table, sin_table, dx, pairs, tokens, heads, Dh);                                     \
    }

ROPE_ENTRY_POINTS(float, f32)
ROPE_ENTRY_POINTS(bf16, bf16)
