// Shared device helpers for the boostmpi kernels: storage types, 16-byte vector loads,
// warp/block reductions and the elementwise grid-stride loop.
//
// The loader (boostmpi/gpu/kernels.py) pastes this file in place of `#include "common.cuh"`,
// so NVRTC/hipRTC see one self-contained source and CuPy's kernel cache keys on all of it.
// Nothing here needs a CUDA header: bfloat16 is handled as raw bits, so the same source
// compiles under nvcc, NVRTC and hipRTC.
#ifndef BOOSTMPI_COMMON_CUH
#define BOOSTMPI_COMMON_CUH

// The hardware warp (NVIDIA) or wavefront (AMD) width. The loader passes the device's own
// value (-DWARP_SIZE=64 on MI250X/MI300); 32 is only the default for offline compiles.
#ifndef WARP_SIZE
#define WARP_SIZE 32
#endif

#define MAX_BLOCK_THREADS 1024
#define MAX_WARPS_PER_BLOCK (MAX_BLOCK_THREADS / WARP_SIZE)

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
#define BOOSTMPI_HIP 1
#endif

// ---------------------------------------------------------------------------------------
// Storage types. Arithmetic is always fp32: load converts to float, store rounds back.

// bfloat16 as its bit pattern: the upper 16 bits of an IEEE float32.
struct bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float to_float(bf16 v) {
    return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);
}

template <typename T>
__device__ T from_float(float v);

template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }

// Round to nearest, ties to even (what ml_dtypes and __float2bfloat16 do); NaN stays NaN.
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) {
    unsigned int u = __float_as_uint(v);
    bf16 out;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        out.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);  // keep it a quiet NaN
        return out;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    out.bits = static_cast<unsigned short>(u >> 16);
    return out;
}

__device__ __forceinline__ float negative_infinity() { return __uint_as_float(0xff800000u); }

// ---------------------------------------------------------------------------------------
// 16-byte vector access. VecWidth<T> elements fill one 16-byte load (4 floats, 8 bf16).

template <typename T>
struct VecWidth {
    static const int value = 16 / sizeof(T);
};

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15u) == 0;
}

// Loads V consecutive elements as floats. V > 1 needs p 16-byte aligned.
template <int V, typename T>
__device__ __forceinline__ void load_vec(const T* p, float* out) {
    static_assert(V == 1 || V * sizeof(T) == 16, "a vector is one element or 16 bytes");
    if (V == 1) {
        out[0] = to_float(p[0]);
        return;
    }
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = to_float(elems[k]);
}

// Rounds V floats to T and stores them. V > 1 needs p 16-byte aligned.
template <int V, typename T>
__device__ __forceinline__ void store_vec(T* p, const float* in) {
    static_assert(V == 1 || V * sizeof(T) == 16, "a vector is one element or 16 bytes");
    if (V == 1) {
        p[0] = from_float<T>(in[0]);
        return;
    }
    uint4 raw;
    T* elems = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < V; ++k) elems[k] = from_float<T>(in[k]);
    *reinterpret_cast<uint4*>(p) = raw;
}

// A thread's V columns of a row (the column-tile kernels: rmsnorm_backward, btp_backward_post).
// VECTORISED: one 16-byte load or store per tensor per row; otherwise element by element (a row
// length that is not a whole number of vectors, or a pointer off 16 bytes), `width` elements of
// the thread's V, the rest taken as 0 and never stored. Loops over k are unrolled so that the
// arrays stay in registers.
template <bool VECTORISED>
struct Columns;

template <>
struct Columns<true> {
    template <int V, typename T>
    static __device__ __forceinline__ void load(const T* p, float* out, int) { load_vec<V>(p, out); }
    template <int V, typename T>
    static __device__ __forceinline__ void store(T* p, const float* in, int) { store_vec<V>(p, in); }
};

template <>
struct Columns<false> {
    template <int V, typename T>
    static __device__ __forceinline__ void load(const T* p, float* out, int width) {
#pragma unroll
        for (int k = 0; k < V; ++k) out[k] = k < width ? to_float(p[k]) : 0.0f;
    }
    template <int V, typename T>
    static __device__ __forceinline__ void store(T* p, const float* in, int width) {
#pragma unroll
        for (int k = 0; k < V; ++k)
            if (k < width) p[k] = from_float<T>(in[k]);
    }
};


// The share of one thread of a column-tile kernel over [N, C] (rmsnorm_backward,
// btp_backward_post; launch shape in boostmpi.gpu.kernels.rmsnorm_backward_launch): block b owns
// column tile b % n_tiles (V columns per thread) of the rows of chunk b / n_tiles. `width`
// columns from `j` are this thread's (none when j >= C: it may leave, no barrier follows).
struct ColumnTile {
    int chunk, j, width;
    long long row_begin, row_end;
};

template <int V>
__device__ __forceinline__ ColumnTile column_tile(int N, int C, int rows_per_chunk) {
    const int tile_columns = blockDim.x * V;
    const int n_tiles = (C + tile_columns - 1) / tile_columns;
    ColumnTile t;
    t.chunk = blockIdx.x / n_tiles;
    t.j = (blockIdx.x % n_tiles) * tile_columns + threadIdx.x * V;
    t.width = C - t.j < V ? C - t.j : V;
    t.row_begin = static_cast<long long>(t.chunk) * rows_per_chunk;
    t.row_end = t.row_begin + rows_per_chunk < N ? t.row_begin + rows_per_chunk : N;
    return t;
}

// The walk of such a kernel that also sums a weight's gradient: the thread keeps w's columns (wv)
// and its running dw in registers, calls row(offset, row, width, wv, dw) for each row of its chunk
// (offset = row * C + j, the row's first column of this thread), and writes its dw once, to the
// chunk's row of dw_partial [n_chunks, C] (fp32, summed over chunks by the caller): no shared memory,
// no atomics, every dw_partial element written by exactly one thread.
template <typename T, bool VECTORISED, typename Row>
__device__ __forceinline__ void column_tile_walk(const T* w, float* dw_partial, int N, int C, int rows_per_chunk,
                                                 Row row) {
    const int V = VecWidth<T>::value;
    const ColumnTile tile = column_tile<V>(N, C, rows_per_chunk);
    if (tile.j >= C) return;  // no barrier or shuffle follows: threads past the row's end may leave
    float wv[V], dw[V];
    Columns<VECTORISED>::template load<V>(w + tile.j, wv, tile.width);
#pragma unroll
    for (int k = 0; k < V; ++k) dw[k] = 0.0f;
    for (long long r = tile.row_begin; r < tile.row_end; ++r) row(r * C + tile.j, r, tile.width, wv, dw);
    Columns<false>::template store<V>(dw_partial + static_cast<long long>(tile.chunk) * C + tile.j, dw, tile.width);
}

// ---------------------------------------------------------------------------------------
// Reductions. HIP has no *_sync shuffles before ROCm 6.2 (and then with a 64-bit mask),
// so the one shuffle we use is chosen here.

__device__ __forceinline__ float shfl_xor(float v, int lane_mask) {
#ifdef BOOSTMPI_HIP
    return __shfl_xor(v, lane_mask);
#else
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

struct SumOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) v = op(v, shfl_xor(v, offset));
    return v;
}

// Every thread of the block gets the reduction of `v` over the block. blockDim.x must be a
// multiple of WARP_SIZE and every thread must call it (it synchronises the block). The
// per-warp partials are combined in warp order, so the result is deterministic.
template <typename Op>
__device__ float block_reduce(float v, Op op) {
    __shared__ float warp_partials[MAX_WARPS_PER_BLOCK];
    v = warp_reduce(v, op);
    const int warp = threadIdx.x / WARP_SIZE;
    if (threadIdx.x % WARP_SIZE == 0) warp_partials[warp] = v;
    __syncthreads();
    float total = warp_partials[0];
    for (int i = 1; i < static_cast<int>(blockDim.x / WARP_SIZE); ++i) total = op(total, warp_partials[i]);
    __syncthreads();  // warp_partials is reused by the next call
    return total;
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, SumOp()); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, MaxOp()); }

// ---------------------------------------------------------------------------------------
// Elementwise work over n elements: calls op.template apply<V>(i) for the chunk starting at
// i in a grid-stride loop, 16-byte chunks over the largest whole-vector prefix when every
// pointer the op touches is aligned, single elements for the rest.
template <typename T, typename Op>
__device__ void elementwise(long long n, bool all_aligned, const Op& op) {
    const int V = VecWidth<T>::value;
    const long long n_vectorised = all_aligned ? n / V * V : 0;
    const long long thread = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long n_threads = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = thread * V; i < n_vectorised; i += n_threads * V) op.template apply<V>(i);
    for (long long i = n_vectorised + thread; i < n; i += n_threads) op.template apply<1>(i);
}

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

// silu(a) = a * s,  silu'(a) = s * (1 + a * (1 - s)),  with s = sigmoid(a)
__device__ __forceinline__ float silu(float a) { return a * sigmoid(a); }

__device__ __forceinline__ float silu_derivative(float a) {
    const float s = sigmoid(a);
    return s * (1.0f + a * (1.0f - s));
}

#endif  // BOOSTMPI_COMMON_CUH
