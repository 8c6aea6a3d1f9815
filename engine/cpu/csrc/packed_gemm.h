// The batch-invariant GEMM over weights packed at load (packed_gemm.c), run on cpu_kernels.c's
// threads: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 x and y, float32 or bfloat16 W; or,
// format PACKED_BF16_DOT, x rounded to bfloat16 and products taken in pairs by vdpbf16ps.
#pragma once
#include <stdint.h>

// The packed weight's format.
enum {
    PACKED_F32 = 0,       // float32 panels [ceil(n / nr)][k][nr]
    PACKED_BF16 = 1,      // bfloat16 panels, their two half-panels interleaved
    PACKED_BF16_DOT = 2,  // bfloat16 panels of k-pairs, [ceil(n / 32)][ceil(k / 2)][32][2] (AVX512-BF16)
};

typedef struct {
    const float *x;
    const void *w;  // packed as `fmt` says (packed_gemm.c)
    const float *bias;
    float *y;
    int64_t m, k, n, ldx, ldy;
    int fmt;  // PACKED_*
    int nr;   // 32: the AVX-512 microkernels; 16: the AVX2 one
    uint16_t *xh;  // PACKED_BF16_DOT: x rounded to bfloat16, rows of ldxh, zero past k (packed_round_rows)
    int64_t ldxh;
} packed_job_t;

// The panel width of the microkernel for this ISA: 32 on AVX-512F (avx512 != 0), else 16.
int packed_width(int avx512);

// Whether this CPU runs PACKED_BF16_DOT (AVX512-BF16).
int packed_has_bf16_dot(void);

// The bfloat16 row stride of x for PACKED_BF16_DOT: k rounded up to whole 16-element vectors.
int64_t packed_xh_stride(int64_t k);

// Rows [r0, r1) of a PACKED_BF16_DOT job's x into its xh, rounded to nearest even (a rows job:
// `job` is the packed_job_t; each row's rounding is its own, so the split changes no bit).
void packed_round_rows(const void *job, int64_t r0, int64_t r1);

// Panels [p0, p1) of the job, every row (a thread's share: panels never split K).
void packed_panels(const packed_job_t *j, int64_t p0, int64_t p1);
