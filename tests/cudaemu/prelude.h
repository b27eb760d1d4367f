// What CUDA (or, at a 64-wide warp, hipRTC) provides to kernel source, for the CPU harness.
//
// g++ compiles the kernel text with `-include prelude.h` and `-fsanitize=thread`: the
// sanitizer's instrumentation calls __tsan_read*/__tsan_write* before every memory access,
// and runtime.cpp implements those hooks (no TSan runtime is linked) to check shared and
// global accesses. Everything here is declarations and thin inline wrappers around the
// runtime; nothing here is instrumented state of its own.
#ifndef CUDAEMU_PRELUDE_H
#define CUDAEMU_PRELUDE_H

#include <cmath>
#include <cstdint>
#include <cstring>

// --------------------------------------------------------------------- vector and index types
struct uint3 {
    unsigned int x, y, z;
};
typedef uint3 dim3;
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};

extern "C" {
struct cudaemu_builtins {
    uint3 threadIdx, blockIdx, blockDim, gridDim;
    int warpSize;
};
extern const cudaemu_builtins* cudaemu_vars;  // the running thread's
void cudaemu_syncthreads(int line);
unsigned long long cudaemu_shfl(int kind, unsigned long long mask, unsigned long long value, int lane_arg, int width,
                                int line);
void* cudaemu_shared_static(const void* tag, unsigned long long size, unsigned long long align, const char* name,
                            int line);
void* cudaemu_shared_dynamic(const char* name, int line);
}

#define threadIdx (cudaemu_vars->threadIdx)
#define blockIdx (cudaemu_vars->blockIdx)
#define blockDim (cudaemu_vars->blockDim)
#define gridDim (cudaemu_vars->gridDim)
#define warpSize (cudaemu_vars->warpSize)

// --------------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict

// `__shared__` declarations are rewritten by the harness (see README.md) into these calls;
// a `__shared__` left over is a declaration form the harness does not know.
#define __shared__ __shared__declaration_form_not_supported_by_cudaemu
namespace cudaemu {
template <typename T>
inline T* shared_static(const void* tag, const char* name, int line) {
    return static_cast<T*>(cudaemu_shared_static(tag, sizeof(T), alignof(T), name, line));
}
template <typename E>
inline E* shared_dynamic(const char* name, int line) {
    return static_cast<E*>(cudaemu_shared_dynamic(name, line));
}
}  // namespace cudaemu

// --------------------------------------------------------------------- barriers and shuffles
#define __syncthreads() cudaemu_syncthreads(__LINE__)

namespace cudaemu {
enum { SHFL_IDX = 0, SHFL_UP = 1, SHFL_DOWN = 2, SHFL_XOR = 3 };
template <typename T>
inline T shfl(int kind, unsigned long long mask, T v, int arg, int width, int line) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = cudaemu_shfl(kind, mask, bits, arg, width, line);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace cudaemu

#define __shfl_sync(mask, v, ...) cudaemu_shfl_sync_(__LINE__, cudaemu::SHFL_IDX, mask, v, __VA_ARGS__)
#define __shfl_up_sync(mask, v, ...) cudaemu_shfl_sync_(__LINE__, cudaemu::SHFL_UP, mask, v, __VA_ARGS__)
#define __shfl_down_sync(mask, v, ...) cudaemu_shfl_sync_(__LINE__, cudaemu::SHFL_DOWN, mask, v, __VA_ARGS__)
#define __shfl_xor_sync(mask, v, ...) cudaemu_shfl_sync_(__LINE__, cudaemu::SHFL_XOR, mask, v, __VA_ARGS__)
template <typename T>
inline T cudaemu_shfl_sync_(int line, int kind, unsigned long long mask, T v, int arg, int width = 0) {
    return cudaemu::shfl(kind, mask, v, arg, width, line);
}
// HIP's mask-less shuffles: the whole wavefront takes part (mask 0 means "every lane").
#define __shfl(v, ...) cudaemu_shfl_sync_(__LINE__, cudaemu::SHFL_IDX, 0ull, v, __VA_ARGS__)
#define __shfl_up(v, ...) cudaemu_shfl_sync_(__LINE__, cudaemu::SHFL_UP, 0ull, v, __VA_ARGS__)
#define __shfl_down(v, ...) cudaemu_shfl_sync_(__LINE__, cudaemu::SHFL_DOWN, 0ull, v, __VA_ARGS__)
#define __shfl_xor(v, ...) cudaemu_shfl_sync_(__LINE__, cudaemu::SHFL_XOR, 0ull, v, __VA_ARGS__)

// --------------------------------------------------------------------- device functions
__attribute__((no_sanitize_thread)) inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
__attribute__((no_sanitize_thread)) inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
__attribute__((no_sanitize_thread)) inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
__attribute__((no_sanitize_thread)) inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

#endif  // CUDAEMU_PRELUDE_H
