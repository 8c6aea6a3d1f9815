// The batch-invariant integer GEMM over quantized weights packed at load (packed_int.c), run on
// cpu_kernels.c's threads: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x made int8 per row and group of
// 32 (cpu_kernels.c fill_xcodes), W 4-bit codes with a scale and a min per group (q4), or int8
// codes with a scale per group (q8; int8 weights' one scale per row is repeated per group).
#pragma once
#include <stdint.h>

typedef struct {
    const uint8_t *w;   // panels [ceil(n / 32)][k / 32][qpacked_group_bytes(q4)] (packed_int.c)
    const int8_t *xq;   // x's int8 codes [m][k]
    const float *xd;    // their scales [m][k / 32]
    const float *xs;    // q4: each group's scale times its codes' sum [m][k / 32] (the mins' term)
    const int32_t *xc;  // q8: -128 times each group's codes' sum [m][k / 32] (the codes' offset)
    const float *bias;
    float *y;
    int64_t m, k, n, ldy;
    int q4;  // 1: 4-bit codes, scales and mins; 0: int8 codes stored plus 128, scales
} qpacked_job_t;

// Whether this CPU runs the integer microkernel (AVX512-VNNI with AVX512-BW).
int qpacked_has_vnni(void);

// The bytes of one panel's group of 32 k: codes, then 32 scales (and 32 mins in q4).
int64_t qpacked_group_bytes(int q4);

// Panels [p0, p1) of the job, every row (a thread's share: panels never split K).
void qpacked_panels(const qpacked_job_t *j, int64_t p0, int64_t p1);
