// The batch-invariant integer GEMM over quantized weights packed at load (packed_int.c), run on
// cpu_kernels.c's threads: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x made 16-bit codes per row and
// group of 32, held as two int8 halves (cpu_kernels.c fill_xwide), W 4-bit codes with a scale and a
// min per group (q4), or int8 codes with a scale per group (q8) or per column (int8).
#pragma once
#include <stdint.h>

typedef struct {
    const uint8_t *w;      // panels [ceil(n / 32)][qpacked_panel_bytes(fmt, k)] (packed_int.c)
    const int8_t *xq;      // the high bytes of x's codes [m][k]: code = 256 high + low
    const int8_t *xq_lo;   // their low bytes [m][k]
    const float *xd;       // the codes' scales [m][k / 32]
    const float *xs;       // q4: each group's scale times its codes' sum [m][k / 32] (the mins' term)
    const int32_t *xc;     // q8: -128 times each group's high bytes' sum [m][k / 32] (the codes' offset)
    const int32_t *xc_lo;  // the same for the low bytes
    const float *bias;
    float *y;
    int64_t m, k, n, ldy;
    int fmt;  // QPACKED_*
} qpacked_job_t;

// The packed weight's format (packed_int.c lays each out).
enum {
    QPACKED_Q8 = 0,    // int8 codes stored plus 128, a scale per group
    QPACKED_Q4 = 1,    // 4-bit codes, a scale and a min per group
    QPACKED_INT8 = 2,  // int8 codes stored plus 128, one scale per column, after the panel's groups
};

// Whether this CPU runs the integer microkernel (AVX512-VNNI with AVX512-BW).
int qpacked_has_vnni(void);

// The bytes of one 32-column panel of a weight of format fmt with k inputs.
int64_t qpacked_panel_bytes(int fmt, int64_t k);

// Panels [p0, p1) of the job, every row (a thread's share: panels never split K).
void qpacked_panels(const qpacked_job_t *j, int64_t p0, int64_t p1);
