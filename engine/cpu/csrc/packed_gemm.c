// The batch-invariant GEMM: register-blocked outer-product microkernels over weights packed once
// at load, for every row count (prefill chunks and decode steps alike).
//
// WHY: the dot-product tiles of cpu_kernels.c reduce each output's lanes at its end and load
// 10 vectors per 24 FMAs; they reached 40-63% of the float32 FMA peak at 128-2,048 rows. Here each
// output is one float32 sum over k, in order: acc += x[r, k] * w[k, c], one k at a time, in a
// register for the whole of K (never split: no partial sums to add, so no order to depend on M,
// on the tile a row lands in, or on the thread count). Batch invariance holds by construction.
//
// PACKED LAYOUT: W [N, K] becomes panels of NR columns, [ceil(N / NR)][K][NR], the last panel
// padded with zero columns: a k-step of a panel is NR consecutive weights, read as NR / lanes
// vectors. bfloat16 panels interleave their two half-panels (element 2i is column i, 2i + 1 is
// column i + NR / 2), so one shift and one mask widen a vector of 2 x lanes weights exactly into
// the two halves, with no cross-lane shuffle. cpu_kernels.py packs (CpuKernels.pack).
//
// TILES: MR rows x NR columns of sums live in registers; each k-step loads NR / lanes weight
// vectors and broadcasts MR x values:
//   AVX-512 (32 registers): 12 x 32 -> 24 sums + 2 weights + 1 broadcast; 14 loads per 24 FMAs.
//   AVX2    (16 registers):  6 x 16 -> 12 sums + 2 weights + 1 broadcast;  8 loads per 12 FMAs.
// Rows left over (M % MR) take the same microkernel with fewer rows: the same sums.
//
// BLOCKING: a thread walks its panels for each block of rows (block_rows: its x within 512 KB,
// 216 rows at K = 576, 84 at 1,536) and the panel in use (<= 196 KB) share the 1 MB L2 of a
// Zen 4/5 core; each panel streams from memory once per row block (once per call at decode sizes
// and a 128-token prompt's at K = 576), its first tile prefetching ahead (`stream`), the block's
// other tiles reading it from L2.
#include "packed_gemm.h"

#include <immintrin.h>

#define AI static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx512f")))
#define MR16 12
#define NR16 32
#define MR8 6
#define NR8 16
#ifndef X_BLOCK_BYTES
#define X_BLOCK_BYTES (512*1024)
#endif
// Rows per block: as many as keep the block's x within X_BLOCK_BYTES (half a Zen 4/5 core's L2),
// a multiple of both tiles' rows (12 and 6), at least one tile.
static int64_t block_rows(int64_t k) {
    const int64_t rows = X_BLOCK_BYTES / (k * 4) / 12 * 12;
    return rows > 12 ? rows : 12;
}
// How far ahead of its reads a tile that streams its panel from memory prefetches (into L2).
// Measured here (AMD EPYC family 26, 2 threads, 30 gate/up weights at 8 rows): the hardware
// prefetchers alone streamed 36-40 GB/s, 45-50 with this; 4 and 16 KB ahead were no better.
#define PREFETCH_BYTES 8192

int packed_width(int avx512) { return avx512 ? NR16 : NR8; }

// ---- AVX-512F: 12 x 32 ----------------------------------------------------------------------------

// R rows of sums [R][2] into y (+ bias); cols <= 32 of them valid.
AI AVX512 void store16(const int R, __m512 acc[][2], float *y, int64_t ldy, const float *bias, int cols) {
    const __mmask16 m0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, bias ? _mm512_add_ps(acc[r][0], b0) : acc[r][0]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, bias ? _mm512_add_ps(acc[r][1], b1) : acc[r][1]);
    }
}

// R rows (R <= MR16, a constant in each inlined copy) of x against one panel; cols <= 32 valid.
AI AVX512 void tile16(const int BF, const int R, const float *x, int64_t ldx, const void *panel, int64_t k,
                      float *y, int64_t ldy, const float *bias, int cols, int stream) {
    __m512 acc[MR16][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float *wf = (const float *)panel;
    const __m512i *wh = (const __m512i *)panel;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
#pragma GCC unroll 4  // the loop's own instructions: 268 -> 278 GFLOP/s a core here at 2,048 rows
    for (int64_t i = 0; i < k; i++) {
        if (stream) {  // a k-step is 128 bytes of float32 weights, 64 of bfloat16
            const char *ahead = (const char *)panel + i * (BF ? 64 : 128) + PREFETCH_BYTES;
            _mm_prefetch(ahead, _MM_HINT_T1);
            if (!BF) _mm_prefetch(ahead + 64, _MM_HINT_T1);
        }
        __m512 w0, w1;
        if (BF) {
            const __m512i v = _mm512_loadu_si512(wh + i);
            w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            w1 = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        } else {
            w0 = _mm512_loadu_ps(wf + i * NR16);
            w1 = _mm512_loadu_ps(wf + i * NR16 + 16);
        }
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * ldx + i]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    store16(R, acc, y, ldy, bias, cols);
}

// Rows [r0, r1) against one panel: 12-row tiles, then one tile of the rest.
AI AVX512 void rows16(const int BF, const packed_job_t *j, int64_t r0, int64_t r1, const void *panel, int64_t c0,
                      int cols) {
    const float *bias = j->bias ? j->bias + c0 : 0;
    int64_t r = r0;
    for (; r + MR16 <= r1; r += MR16)
        tile16(BF, MR16, j->x + r * j->ldx, j->ldx, panel, j->k, j->y + r * j->ldy + c0, j->ldy, bias, cols, r == r0);
    const float *x = j->x + r * j->ldx;
    float *y = j->y + r * j->ldy + c0;
#define TAIL16(R) case R: tile16(BF, R, x, j->ldx, panel, j->k, y, j->ldy, bias, cols, r == r0); break;
    switch (r1 - r) {
        TAIL16(1) TAIL16(2) TAIL16(3) TAIL16(4) TAIL16(5) TAIL16(6)
        TAIL16(7) TAIL16(8) TAIL16(9) TAIL16(10) TAIL16(11)
    }
#undef TAIL16
}

AI AVX512 void panels16(const int BF, const packed_job_t *j, int64_t p0, int64_t p1) {
    const int64_t panel_bytes = j->k * NR16 * (BF ? 2 : 4);
    const int64_t mc = block_rows(j->k);
    for (int64_t r0 = 0; r0 < j->m; r0 += mc) {
        const int64_t r1 = r0 + mc < j->m ? r0 + mc : j->m;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t c0 = p * NR16, left = j->n - c0;
            rows16(BF, j, r0, r1, (const char *)j->w + p * panel_bytes, c0, left < NR16 ? (int)left : NR16);
        }
    }
}

static AVX512 void run16(const packed_job_t *j, int64_t p0, int64_t p1) {
    if (j->fmt == PACKED_BF16)
        panels16(1, j, p0, p1);
    else
        panels16(0, j, p0, p1);
}

// ---- AVX512-BF16: 12 x 32, products in k-pairs ------------------------------------------------------
//
// vdpbf16ps multiplies 16 lanes of bfloat16 PAIRS and adds both products to a float32 sum: twice
// the products of an FMA per instruction, at the same rate (the probe: 1,004 against 538 GFLOP/s
// on 2 cores of a family-26 EPYC), so a compute-bound prefill runs up to twice as fast. It takes
// bfloat16 on both sides: x is rounded to bfloat16 once per call (packed_round_rows), each element
// by itself, so a row's bits still do not depend on its neighbours. Each sum still runs over the
// k-pairs in order, in one register, with no split of K: invariant by construction, as above.
// (The instruction's own rounding between a pair's two products is the CPU's: on one machine it
// is fixed, across CPU vendors it may differ, as any two kernels' may.)
//
// LAYOUT: a panel's k-step is one pair of k for 32 columns, [32][2] bfloat16: two vectors, the
// columns 0-15 and 16-31, each lane one column's (k, k + 1). x's pair is one 32-bit broadcast.
// TILE: as tile16, 12 x 32: 24 sums + 2 weight vectors + 1 broadcast, 14 loads per 24 dot products.

#define AVX512BF16 __attribute__((target("avx512f,avx512bf16")))

int packed_has_bf16_dot(void) { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f"); }

int64_t packed_xh_stride(int64_t k) { return (k + 15) / 16 * 16; }

AVX512BF16 void packed_round_rows(const void *job, int64_t r0, int64_t r1) {
    const packed_job_t *j = job;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = j->x + r * j->ldx;
        uint16_t *h = j->xh + r * j->ldxh;
        for (int64_t i = 0; i < j->ldxh; i += 16) {  // zeros past k: the odd k's pair, the last vector
            const int64_t left = j->k - i;
            const __mmask16 valid = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, x + i));
            _mm256_storeu_si256((__m256i *)(h + i), (__m256i)v);
        }
    }
}

AI AVX512BF16 void tile_dot(const int R, const uint32_t *xp, int64_t ldxp, const void *panel, int64_t pairs,
                            float *y, int64_t ldy, const float *bias, int cols, int stream) {
    __m512 acc[MR16][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512i *w = (const __m512i *)panel;
#pragma GCC unroll 4
    for (int64_t i = 0; i < pairs; i++) {
        if (stream) {  // a k-pair step is 128 bytes
            const char *ahead = (const char *)panel + i * 128 + PREFETCH_BYTES;
            _mm_prefetch(ahead, _MM_HINT_T1);
            _mm_prefetch(ahead + 64, _MM_HINT_T1);
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + 2 * i), w1 = (__m512bh)_mm512_loadu_si512(w + 2 * i + 1);
        for (int r = 0; r < R; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[r * ldxp + i]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
    store16(R, acc, y, ldy, bias, cols);
}

AI AVX512BF16 void rows_dot(const packed_job_t *j, int64_t r0, int64_t r1, const void *panel, int64_t c0, int cols) {
    const float *bias = j->bias ? j->bias + c0 : 0;
    const int64_t ldxp = j->ldxh / 2, pairs = (j->k + 1) / 2;
    const uint32_t *xp = (const uint32_t *)j->xh;
    int64_t r = r0;
    for (; r + MR16 <= r1; r += MR16)
        tile_dot(MR16, xp + r * ldxp, ldxp, panel, pairs, j->y + r * j->ldy + c0, j->ldy, bias, cols, r == r0);
    const uint32_t *x = xp + r * ldxp;
    float *y = j->y + r * j->ldy + c0;
#define TAILDOT(R) case R: tile_dot(R, x, ldxp, panel, pairs, y, j->ldy, bias, cols, r == r0); break;
    switch (r1 - r) {
        TAILDOT(1) TAILDOT(2) TAILDOT(3) TAILDOT(4) TAILDOT(5) TAILDOT(6)
        TAILDOT(7) TAILDOT(8) TAILDOT(9) TAILDOT(10) TAILDOT(11)
    }
#undef TAILDOT
}

static AVX512BF16 void run_dot(const packed_job_t *j, int64_t p0, int64_t p1) {
    const int64_t panel_bytes = (j->k + 1) / 2 * NR16 * 2 * 2;
    const int64_t mc = block_rows(j->k);
    for (int64_t r0 = 0; r0 < j->m; r0 += mc) {
        const int64_t r1 = r0 + mc < j->m ? r0 + mc : j->m;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t c0 = p * NR16, left = j->n - c0;
            rows_dot(j, r0, r1, (const char *)j->w + p * panel_bytes, c0, left < NR16 ? (int)left : NR16);
        }
    }
}

// ---- AVX2 + FMA: 6 x 16 ---------------------------------------------------------------------------

AI void tile8(const int BF, const int R, const float *x, int64_t ldx, const void *panel, int64_t k, float *y,
              int64_t ldy, const float *bias, int cols, int stream) {
    __m256 acc[MR8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float *wf = (const float *)panel;
    const __m256i *wh = (const __m256i *)panel;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000);
#pragma GCC unroll 4
    for (int64_t i = 0; i < k; i++) {
        if (stream)  // a k-step is 64 bytes of float32 weights, 32 of bfloat16: a line per step or two
            _mm_prefetch((const char *)panel + i * (BF ? 32 : 64) + PREFETCH_BYTES, _MM_HINT_T1);
        __m256 w0, w1;
        if (BF) {
            const __m256i v = _mm256_loadu_si256(wh + i);
            w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            w1 = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        } else {
            w0 = _mm256_loadu_ps(wf + i * NR8);
            w1 = _mm256_loadu_ps(wf + i * NR8 + 8);
        }
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    // Masked stores, not a scalar loop over cols: with one, gcc 12 kept acc[][] in memory,
    // storing every sum on every k-step (130 GFLOP/s, against the dot tiles' 200).
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
    const __m256 b0 = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
    for (int r = 0; r < R; r++) {
        _mm256_maskstore_ps(y + r * ldy, m0, bias ? _mm256_add_ps(acc[r][0], b0) : acc[r][0]);
        _mm256_maskstore_ps(y + r * ldy + 8, m1, bias ? _mm256_add_ps(acc[r][1], b1) : acc[r][1]);
    }
}

AI void rows8(const int BF, const packed_job_t *j, int64_t r0, int64_t r1, const void *panel, int64_t c0, int cols) {
    const float *bias = j->bias ? j->bias + c0 : 0;
    int64_t r = r0;
    for (; r + MR8 <= r1; r += MR8)
        tile8(BF, MR8, j->x + r * j->ldx, j->ldx, panel, j->k, j->y + r * j->ldy + c0, j->ldy, bias, cols, r == r0);
    const float *x = j->x + r * j->ldx;
    float *y = j->y + r * j->ldy + c0;
#define TAIL8(R) case R: tile8(BF, R, x, j->ldx, panel, j->k, y, j->ldy, bias, cols, r == r0); break;
    switch (r1 - r) { TAIL8(1) TAIL8(2) TAIL8(3) TAIL8(4) TAIL8(5) }
#undef TAIL8
}

AI void panels8(const int BF, const packed_job_t *j, int64_t p0, int64_t p1) {
    const int64_t panel_bytes = j->k * NR8 * (BF ? 2 : 4);
    const int64_t mc = block_rows(j->k);
    for (int64_t r0 = 0; r0 < j->m; r0 += mc) {
        const int64_t r1 = r0 + mc < j->m ? r0 + mc : j->m;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t c0 = p * NR8, left = j->n - c0;
            rows8(BF, j, r0, r1, (const char *)j->w + p * panel_bytes, c0, left < NR8 ? (int)left : NR8);
        }
    }
}

void packed_panels(const packed_job_t *j, int64_t p0, int64_t p1) {
    if (j->fmt == PACKED_BF16_DOT)
        run_dot(j, p0, p1);
    else if (j->nr == NR16)
        run16(j, p0, p1);
    else if (j->fmt == PACKED_BF16)
        panels8(1, j, p0, p1);
    else
        panels8(0, j, p0, p1);
}
