/* The stand-in's libhipblas: the two GEMMs boostmpi calls, with hipblas.h's C prototypes (ROCm/hipBLAS,
 * library/include/hipblas.h), each handing its arguments to the Python stand-in (cupy/cuda/hipblas_lib.py),
 * which checks them and computes the product on the stand-in's memory. Loaded by ctypes exactly as the
 * real library is, so the caller's declarations are exercised through a real C call. Enumerations are C
 * ints; hipblasStride is int64_t; hipblasHandle_t is void*. STANDIN_ABI picks the release it stands for:
 * 0 = hipBLAS 1.x (ROCm 5: the plain names, hipblasDatatype_t), 1 = hipBLAS 2.x (ROCm 6: those and the
 * _v2 names with hipDataType / hipblasComputeType_t), 2 = hipBLAS 3 (ROCm 7: the v2 signature under the
 * plain names). The arguments are laid out alike in all of them; only the enumeration values differ. */
#include <stdint.h>

#ifndef STANDIN_ABI
#define STANDIN_ABI 2
#endif

typedef int (*standin_gemm)(void* handle, int transA, int transB, int m, int n, int k, const void* alpha,
                            const void* A, int aType, int lda, int64_t strideA, const void* B, int bType, int ldb,
                            int64_t strideB, const void* beta, void* C, int cType, int ldc, int64_t strideC,
                            int batchCount, int computeType, int algo, int strided, int abi);

static standin_gemm forward_to = 0;

void standin_register(standin_gemm callback) { forward_to = callback; }

#define GEMM_EX(NAME, ABI)                                                                                      \
    int NAME(void* handle, int transA, int transB, int m, int n, int k, const void* alpha, const void* A,       \
             int aType, int lda, const void* B, int bType, int ldb, const void* beta, void* C, int cType,       \
             int ldc, int computeType, int algo) {                                                              \
        if (!forward_to) return 1; /* HIPBLAS_STATUS_NOT_INITIALIZED */                                        \
        return forward_to(handle, transA, transB, m, n, k, alpha, A, aType, lda, 0, B, bType, ldb, 0, beta, C, \
                          cType, ldc, 0, 1, computeType, algo, 0, ABI);                                         \
    }

#define GEMM_STRIDED_BATCHED_EX(NAME, ABI)                                                                      \
    int NAME(void* handle, int transA, int transB, int m, int n, int k, const void* alpha, const void* A,       \
             int aType, int lda, int64_t strideA, const void* B, int bType, int ldb, int64_t strideB,           \
             const void* beta, void* C, int cType, int ldc, int64_t strideC, int batchCount, int computeType,   \
             int algo) {                                                                                        \
        if (!forward_to) return 1;                                                                             \
        return forward_to(handle, transA, transB, m, n, k, alpha, A, aType, lda, strideA, B, bType, ldb,       \
                          strideB, beta, C, cType, ldc, strideC, batchCount, computeType, algo, 1, ABI);        \
    }

#if STANDIN_ABI == 2
GEMM_EX(hipblasGemmEx, 2)
GEMM_STRIDED_BATCHED_EX(hipblasGemmStridedBatchedEx, 2)
#else
GEMM_EX(hipblasGemmEx, 0)
GEMM_STRIDED_BATCHED_EX(hipblasGemmStridedBatchedEx, 0)
#endif
#if STANDIN_ABI == 1
GEMM_EX(hipblasGemmEx_v2, 1)
GEMM_STRIDED_BATCHED_EX(hipblasGemmStridedBatchedEx_v2, 1)
#endif
