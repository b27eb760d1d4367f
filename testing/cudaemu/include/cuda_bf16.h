// The harness's <cuda_bf16.h>: CUDA's bfloat16 storage type, as far as the WMMA emulation
// (mma.h here) and a kernel handing it bfloat16 pointers need it. CUDA's type is a struct
// holding the 16 bits in `__x`; arithmetic on it is not emulated (the kernels compute in fp32).
#ifndef CUDAEMU_CUDA_BF16_H
#define CUDAEMU_CUDA_BF16_H

struct __nv_bfloat16 {
    unsigned short __x;
};

inline float __bfloat162float(__nv_bfloat16 v) { return __uint_as_float(static_cast<unsigned int>(v.__x) << 16); }

// round to nearest even, NaN kept quiet (what __float2bfloat16 does)
inline __nv_bfloat16 __float2bfloat16(float f) {
    unsigned int u = __float_as_uint(f);
    __nv_bfloat16 out;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        out.__x = static_cast<unsigned short>((u >> 16) | 0x0040u);
        return out;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    out.__x = static_cast<unsigned short>(u >> 16);
    return out;
}

#endif  // CUDAEMU_CUDA_BF16_H
