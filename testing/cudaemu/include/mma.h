// The harness's <mma.h>: CUDA's warp matrix functions (nvcuda::wmma) for the shape and types the
// kernels use - bfloat16 16x16x16 with a float accumulator - with the semantics CUDA documents
// (CUDA C++ Programming Guide, "Warp Matrix Functions"; the declarations of CUDA 12.9's crt/mma.h):
//   fragment<matrix_a | matrix_b, 16, 16, 16, __nv_bfloat16, row_major | col_major> and
//   fragment<accumulator, 16, 16, 16, float>, each num_elements = 8 values x[] per lane;
//   fill_fragment, load_matrix_sync, mma_sync (d = a b + c), store_matrix_sync.
// What CUDA leaves unspecified is randomised: which matrix element a lane's x[e] holds is drawn
// per launch and per fragment kind (runtime.cpp), so a kernel that assumes a layout computes wrong
// numbers here. What CUDA requires is checked: all 32 lanes of the warp call each function (with
// the same pointer, stride and layout), the pointer is 256-bit aligned, and the stride is a
// multiple of 16 bytes (8 bfloat16 or 4 float elements). Products are exact in fp32 and summed
// in k order (the hardware's summation order is not documented either; tolerances must allow it).
#ifndef CUDAEMU_MMA_H
#define CUDAEMU_MMA_H

#include <cuda_bf16.h>

extern "C" {
const unsigned char* cudaemu_fragment_map(int kind, int line);
void cudaemu_fragment_fail(const char* message, int line);
}

namespace nvcuda {
namespace wmma {

struct matrix_a;
struct matrix_b;
struct accumulator;
struct row_major;
struct col_major;
enum layout_t { mem_row_major, mem_col_major };

template <typename T, int size>
struct __frag_base {
    enum { num_elements = size, num_storage_elements = size };
    typedef T element_type;
    typedef T storage_element_type;
    T x[size];
};

template <typename Use, int m, int n, int k, typename T, typename Layout = void>
class fragment;
template <> class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, row_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, col_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, row_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, col_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<accumulator, 16, 16, 16, float> : public __frag_base<float, 8> {};

}  // namespace wmma
}  // namespace nvcuda

namespace cudaemu {
namespace wmma_detail {
using namespace nvcuda::wmma;
constexpr unsigned long long FULL_WARP = 0xffffffffull;

// the fragment's kind (runtime.cpp draws one element map per kind) and whether its memory is row-major
template <typename F> struct Kind;
template <> struct Kind<fragment<matrix_a, 16, 16, 16, __nv_bfloat16, row_major>> { enum { value = 0, row = 1 }; };
template <> struct Kind<fragment<matrix_a, 16, 16, 16, __nv_bfloat16, col_major>> { enum { value = 1, row = 0 }; };
template <> struct Kind<fragment<matrix_b, 16, 16, 16, __nv_bfloat16, row_major>> { enum { value = 2, row = 1 }; };
template <> struct Kind<fragment<matrix_b, 16, 16, 16, __nv_bfloat16, col_major>> { enum { value = 3, row = 0 }; };
template <> struct Kind<fragment<accumulator, 16, 16, 16, float>> { enum { value = 4, row = -1 }; };

inline int lane() { return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32; }

// Every lane of the warp meets here (a shuffle over the full mask: a lane missing, or calling
// another WMMA function, is the harness's partial-warp or deadlock error), and each lane's
// pointer, stride and layout must equal lane 0's.
inline void converge(const void* p, unsigned ldm, int layout, int line) {
    const unsigned long long mine = reinterpret_cast<unsigned long long>(p);
    const unsigned long long first = shfl(SHFL_IDX, FULL_WARP, mine, 0, 32, line);
    const unsigned long long shape = (static_cast<unsigned long long>(ldm) << 8) | static_cast<unsigned>(layout + 1);
    const unsigned long long first_shape = shfl(SHFL_IDX, FULL_WARP, shape, 0, 32, line);
    if (first != mine || first_shape != shape)
        cudaemu_fragment_fail("the lanes of the warp call with different pointers, strides or layouts", line);
}

inline void check_memory(const void* p, unsigned ldm, unsigned element_bytes, int line) {
    if (reinterpret_cast<unsigned long long>(p) % 32)
        cudaemu_fragment_fail("the matrix pointer is not 256-bit aligned", line);
    if (ldm == 0 || (ldm * element_bytes) % 16)
        cudaemu_fragment_fail("the leading dimension is not a multiple of 16 bytes", line);
}

// offset of element (row, col) of a 16x16 matrix stored with leading dimension ldm
inline unsigned long long at(int position, unsigned ldm, bool row_major_memory) {
    const int r = position / 16, c = position % 16;
    return row_major_memory ? static_cast<unsigned long long>(r) * ldm + c : static_cast<unsigned long long>(c) * ldm + r;
}

inline float value(__nv_bfloat16 v) { return __bfloat162float(v); }
inline float value(float v) { return v; }

// the whole 16x16 matrix of a bfloat16 fragment, gathered from the warp's lanes by shuffles
template <typename F>
inline void gather(const F& f, float* matrix, int line) {
    const unsigned char* map = cudaemu_fragment_map(Kind<F>::value, line);
    for (int src = 0; src < 32; ++src) {
        for (int half = 0; half < 2; ++half) {
            unsigned long long bits;
            __builtin_memcpy(&bits, &f.x[4 * half], 8);
            bits = shfl(SHFL_IDX, FULL_WARP, bits, src, 32, line);
            __nv_bfloat16 four[4];
            __builtin_memcpy(four, &bits, 8);
            for (int i = 0; i < 4; ++i) matrix[map[src * 8 + 4 * half + i]] = value(four[i]);
        }
    }
}
}  // namespace wmma_detail
}  // namespace cudaemu

namespace nvcuda {
namespace wmma {

template <typename T, int size>
inline void fill_fragment(__frag_base<T, size>& f, const T& v) {
    for (int i = 0; i < size; ++i) f.x[i] = v;
}

template <typename Use, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p, unsigned ldm,
                             int line = __builtin_LINE()) {
    using namespace cudaemu::wmma_detail;
    typedef fragment<Use, 16, 16, 16, __nv_bfloat16, Layout> F;
    const unsigned char* map = cudaemu_fragment_map(Kind<F>::value, line);  // first: it refuses a 64-lane warp
    converge(p, ldm, Kind<F>::row, line);
    check_memory(p, ldm, 2, line);
    for (int e = 0; e < 8; ++e) f.x[e] = p[at(map[lane() * 8 + e], ldm, Kind<F>::row == 1)];
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t layout,
                             int line = __builtin_LINE()) {
    using namespace cudaemu::wmma_detail;
    const unsigned char* map = cudaemu_fragment_map(Kind<fragment<accumulator, 16, 16, 16, float>>::value, line);
    converge(p, ldm, layout, line);
    check_memory(p, ldm, 4, line);
    for (int e = 0; e < 8; ++e) f.x[e] = p[at(map[lane() * 8 + e], ldm, layout == mem_row_major)];
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t layout,
                              int line = __builtin_LINE()) {
    using namespace cudaemu::wmma_detail;
    const unsigned char* map = cudaemu_fragment_map(Kind<fragment<accumulator, 16, 16, 16, float>>::value, line);
    converge(p, ldm, layout, line);
    check_memory(p, ldm, 4, line);
    for (int e = 0; e < 8; ++e) p[at(map[lane() * 8 + e], ldm, layout == mem_row_major)] = f.x[e];
}

// d = a b + c over the warp: every lane's products come from the whole of a and b
template <typename LayoutA, typename LayoutB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LayoutA>& a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LayoutB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c, int line = __builtin_LINE()) {
    using namespace cudaemu::wmma_detail;
    const unsigned char* map = cudaemu_fragment_map(Kind<fragment<accumulator, 16, 16, 16, float>>::value, line);
    converge(nullptr, 16, -1, line);
    float A[256], B[256];
    gather(a, A, line);
    gather(b, B, line);
    float out[8];
    for (int e = 0; e < 8; ++e) {
        const int position = map[lane() * 8 + e], r = position / 16, col = position % 16;
        float sum = c.x[e];
        for (int k = 0; k < 16; ++k) sum += A[r * 16 + k] * B[k * 16 + col];
        out[e] = sum;
    }
    for (int e = 0; e < 8; ++e) d.x[e] = out[e];
}

}  // namespace wmma
}  // namespace nvcuda

#endif  // CUDAEMU_MMA_H
