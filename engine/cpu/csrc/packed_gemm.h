// The batch-invariant GEMM over weights packed at load (packed_gemm.c), run on cpu_kernels.c's
// threads: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 x and y, float32 or bfloat16 W.
#pragma once
#include <stdint.h>

typedef struct {
    const float *x;
    const void *w;  // packed: panels of `nr` columns, [ceil(n / nr)][k][nr] (packed_gemm.c)
    const float *bias;
    float *y;
    int64_t m, k, n, ldx, ldy;
    int bf16;  // W is bfloat16, its pairs of half-panels interleaved (packed_gemm.c)
    int nr;    // 32: the AVX-512 microkernel; 16: the AVX2 one
} packed_job_t;

// The panel width of the microkernel for this ISA: 32 on AVX-512F (avx512 != 0), else 16.
int packed_width(int avx512);

// Panels [p0, p1) of the job, every row (a thread's share: panels never split K).
void packed_panels(const packed_job_t *j, int64_t p0, int64_t p1);
