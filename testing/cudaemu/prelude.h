// What CUDA (or, at a 64-wide warp, hipRTC) provides to kernel source, for the CPU harness.
//
// g++ compiles the kernel text with `-include prelude.h` and `-fsanitize=thread`: the
// sanitizer's instrumentation calls __tsan_read*/__tsan_write* before every memory access,
// and runtime.cpp implements those hooks (no TSan runtime is linked) to check shared and
// global accesses. Everything here is declarations and thin inline wrappers around the
// runtime; nothing here is instrumented state of its own.
//
// No host header is included, and the kernel text is compiled with -nostdinc -nostdinc++: the
// text sees what NVRTC and hipRTC both give a program without include paths (checked against
// NVRTC 12.9 and ROCm 5.2's hipRTC), not <cmath>'s INFINITY/NAN, <cstdint>'s fixed-width types
// (NVRTC has none of them) or the std:: namespace. An `#include <...>` in the text fails here
// as it does in NVRTC.
#ifndef CUDAEMU_PRELUDE_H
#define CUDAEMU_PRELUDE_H

// --------------------------------------------------------------------- what NVRTC predefines
typedef decltype(sizeof(0)) size_t;
extern "C" {
void* memcpy(void* dst, const void* src, size_t n);
void* memset(void* dst, int value, size_t n);
}

// The CUDA math API's functions (device code calls the GPU's versions; here the C library's).
#define CUDAEMU_MATH1(name) float name##f(float); double name(double);
#define CUDAEMU_MATH2(name) float name##f(float, float); double name(double, double);
extern "C" {
CUDAEMU_MATH1(exp) CUDAEMU_MATH1(exp2) CUDAEMU_MATH1(exp10) CUDAEMU_MATH1(expm1) CUDAEMU_MATH1(log)
CUDAEMU_MATH1(log2) CUDAEMU_MATH1(log10) CUDAEMU_MATH1(log1p) CUDAEMU_MATH1(sqrt) CUDAEMU_MATH1(cbrt)
CUDAEMU_MATH1(sin) CUDAEMU_MATH1(cos) CUDAEMU_MATH1(tan) CUDAEMU_MATH1(asin) CUDAEMU_MATH1(acos)
CUDAEMU_MATH1(atan) CUDAEMU_MATH1(sinh) CUDAEMU_MATH1(cosh) CUDAEMU_MATH1(tanh) CUDAEMU_MATH1(asinh)
CUDAEMU_MATH1(acosh) CUDAEMU_MATH1(atanh) CUDAEMU_MATH1(erf) CUDAEMU_MATH1(erfc) CUDAEMU_MATH1(fabs)
CUDAEMU_MATH1(floor) CUDAEMU_MATH1(ceil) CUDAEMU_MATH1(trunc) CUDAEMU_MATH1(round) CUDAEMU_MATH1(rint)
CUDAEMU_MATH1(nearbyint) CUDAEMU_MATH1(lgamma) CUDAEMU_MATH1(tgamma)
CUDAEMU_MATH2(pow) CUDAEMU_MATH2(atan2) CUDAEMU_MATH2(fmin) CUDAEMU_MATH2(fmax) CUDAEMU_MATH2(fmod)
CUDAEMU_MATH2(copysign) CUDAEMU_MATH2(hypot) CUDAEMU_MATH2(remainder)
float fmaf(float, float, float);
double fma(double, double, double);
float ldexpf(float, int);
double ldexp(double, int);
}
#undef CUDAEMU_MATH1
#undef CUDAEMU_MATH2
// CUDA's C++ float overloads (exp(float) is float, not double, in device code)
#define CUDAEMU_FLOAT1(name) inline float name(float x) { return name##f(x); }
#define CUDAEMU_FLOAT2(name) inline float name(float x, float y) { return name##f(x, y); }
CUDAEMU_FLOAT1(exp) CUDAEMU_FLOAT1(exp2) CUDAEMU_FLOAT1(expm1) CUDAEMU_FLOAT1(log) CUDAEMU_FLOAT1(log2)
CUDAEMU_FLOAT1(log10) CUDAEMU_FLOAT1(log1p) CUDAEMU_FLOAT1(sqrt) CUDAEMU_FLOAT1(sin) CUDAEMU_FLOAT1(cos)
CUDAEMU_FLOAT1(tanh) CUDAEMU_FLOAT1(erf) CUDAEMU_FLOAT1(fabs) CUDAEMU_FLOAT1(floor) CUDAEMU_FLOAT1(ceil)
CUDAEMU_FLOAT2(pow) CUDAEMU_FLOAT2(fmin) CUDAEMU_FLOAT2(fmax)
#undef CUDAEMU_FLOAT1
#undef CUDAEMU_FLOAT2
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isnan(double x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isinf(double x) { return __builtin_isinf(x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isfinite(double x) { return __builtin_isfinite(x); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool signbit(double x) { return __builtin_signbit(x); }

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
    __builtin_memcpy(&bits, &v, sizeof(T));
    bits = cudaemu_shfl(kind, mask, bits, arg, width, line);
    T out;
    __builtin_memcpy(&out, &bits, sizeof(T));
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
    __builtin_memcpy(&f, &u, 4);
    return f;
}
__attribute__((no_sanitize_thread)) inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    __builtin_memcpy(&u, &f, 4);
    return u;
}
__attribute__((no_sanitize_thread)) inline float __int_as_float(int i) {
    float f;
    __builtin_memcpy(&f, &i, 4);
    return f;
}
__attribute__((no_sanitize_thread)) inline int __float_as_int(float f) {
    int i;
    __builtin_memcpy(&i, &f, 4);
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

// --------------------------------------------------------------------- AMD matrix cores (MFMA)
// __builtin_amdgcn_mfma_f32_32x32x8bf16_1k (gfx90a, hipcc/hipRTC of ROCm 5.2 accept it): D = A B + C
// over the 64-lane wavefront; A 32x8 and B 8x32 bfloat16 (bit patterns, 4 per lane in a vector of
// shorts), C and D 32x32 float (16 per lane), in the lanes AMD's Matrix Instruction Calculator gives
// for CDNA2 (https://github.com/ROCm/amd_matrix_instruction_calculator, --register-layout):
//   A[i][k]: lane i + 32 (k / 4), element k % 4     B[k][j]: lane j + 32 (k / 4), element k % 4
//   D[i][j]: lane l, element r, where j = l % 32 and i = 8 (r / 4) + 4 (l / 32) + r % 4
// Every lane of the wavefront takes part (shuffles); the broadcast controls cbsz, abid, blgp must be 0
// (others are not emulated). Products are exact in fp32, summed in k order.
typedef short cudaemu_short4 __attribute__((vector_size(8)));
typedef float cudaemu_float16 __attribute__((vector_size(64)));
extern "C" void cudaemu_fragment_fail(const char* message, int line);
namespace cudaemu {
inline cudaemu_float16 mfma_f32_32x32x8bf16_1k(cudaemu_short4 a, cudaemu_short4 b, cudaemu_float16 c, int cbsz, int abid,
                                               int blgp, int line) {
    if (warpSize != 64) cudaemu_fragment_fail("MFMA needs a 64-lane wavefront", line);
    if (cbsz || abid || blgp) cudaemu_fragment_fail("MFMA broadcast controls (cbsz, abid, blgp) other than 0", line);
    const int lane = static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 64;
    float A[32][8], B[8][32];
    for (int src = 0; src < 64; ++src) {
        const cudaemu_short4 sa = shfl(SHFL_IDX, 0ull, a, src, 64, line), sb = shfl(SHFL_IDX, 0ull, b, src, 64, line);
        for (int e = 0; e < 4; ++e) {
            A[src % 32][4 * (src / 32) + e] = __uint_as_float(static_cast<unsigned int>(static_cast<unsigned short>(sa[e])) << 16);
            B[4 * (src / 32) + e][src % 32] = __uint_as_float(static_cast<unsigned int>(static_cast<unsigned short>(sb[e])) << 16);
        }
    }
    cudaemu_float16 d;
    for (int r = 0; r < 16; ++r) {
        const int i = 8 * (r / 4) + 4 * (lane / 32) + r % 4, j = lane % 32;
        float sum = c[r];
        for (int k = 0; k < 8; ++k) sum += A[i][k] * B[k][j];
        d[r] = sum;
    }
    return d;
}
}  // namespace cudaemu
#define __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(a, b, c, cbsz, abid, blgp) \
    cudaemu::mfma_f32_32x32x8bf16_1k(a, b, c, cbsz, abid, blgp, __LINE__)

#endif  // CUDAEMU_PRELUDE_H
