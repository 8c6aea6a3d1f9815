// The batch-invariant integer GEMM: quantized weights packed once at load, multiplied by x's int8
// codes with AVX512-VNNI (vpdpbusd), for every row count (prefill chunks and decode steps alike).
//
// WHY: cpu_kernels.c's integer tiles (int_tile) keep an 8-lane sum per (row, column) and reduce it
// at the end, unpacking each weight group again for every two columns: 210-250 GOP/s at 128 rows
// here, below the float32 packed GEMM's 520 over dequantized weights, so a batch-invariant gguf
// prefill (every row on integer dots) was slower than the mode off. Here a tile is an outer
// product: per 4 k, one 32-bit broadcast of a row's four codes against 16 columns' four codes,
// 64 products per instruction.
//
// ARITHMETIC, per (row r, column c) and group g of 32 k, in this order for every tile shape:
//   s = the exact int32 sum of the 32 products codes(x) * codes(w)  (+ q8's offset, below)
//   y += float(s) * (scale_w * scale_x)                              (one FMA)
//   y += min_w * sum_x                                               (q4: one FMA)
// over g = 0, 1, ... in order, in one register, never split: a row's bits do not depend on its
// neighbours, its tile, or the threads. These are the sums cpu_kernels.c's integer tiles take,
// reduced once per group instead of once per 4 k (so the two kernels' results differ in their
// last bits, and batch-invariant engines run this one alone, at every row count).
//
// vpdpbusd multiplies unsigned by signed bytes. q4 codes are 0..15 already; int8 codes are stored
// plus 128 (0..255), and each (row, group) sum starts at -128 times the row's code sum (xc), so s
// is exact either way.
//
// LAYOUT of a panel of 32 columns, group by group: the codes, then 32 float32 scales (and 32 mins).
//   q8: 8 quads of k, each [2 halves][16 columns][4 k] bytes              (1,024 bytes)
//   q4: 4 pairs of quads, each [2 halves][16 columns][4 k] bytes, the low nibble the pair's first
//       quad, the high nibble its second                                    (512 bytes)
// so a 64-byte load is one half-panel's quad (q8) or, after a mask and a shift, two (q4).
// cpu_kernels.py packs (CpuKernels.pack_quant).
//
// TILE: QMR rows x 32 columns: 2 x QMR int32 sums and 2 x QMR float32 sums in registers, 2 weight
// vectors a quad (4 a pair of quads in q4), x's 4 codes as an embedded broadcast.
#include "packed_int.h"

#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define QNR 32
#ifndef QMR
#define QMR 4
#endif
#define QGROUP 32
// Rows per block: as many as keep the block's codes within 256 KB of L2, a multiple of QMR.
#define QX_BLOCK_BYTES (256 * 1024)
// How far ahead of its reads a tile that streams its panel from memory prefetches (into L2).
#define QPREFETCH_BYTES 4096

int qpacked_has_vnni(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

int64_t qpacked_group_bytes(int q4) { return q4 ? 512 + 2 * QNR * 4 : 1024 + QNR * 4; }

AI int32_t quad(const int8_t *p) {  // four codes as one 32-bit lane (memcpy: no aliasing assumption)
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

// R rows (from r0) against one panel; cols <= 32 of its columns valid.
AI VNNI void qtile(const int Q4, const int R, const qpacked_job_t *j, int64_t r0, const uint8_t *panel, int64_t c0,
                   int cols, int stream) {
    const int64_t k = j->k, groups = k / QGROUP, gbytes = qpacked_group_bytes(Q4), codes = Q4 ? 512 : 1024;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[QMR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = panel + g * gbytes;
        if (stream)
            for (int64_t b = 0; b < gbytes; b += 64) _mm_prefetch((const char *)p + QPREFETCH_BYTES + b, _MM_HINT_T1);
        __m512i s[QMR][2];
        for (int r = 0; r < R; r++)
            s[r][0] = s[r][1] = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(j->xc[(r0 + r) * groups + g]);
        const int8_t *xq = j->xq + r0 * k + g * QGROUP;
        if (Q4) {
            for (int h = 0; h < 4; h++) {
                const __m512i a = _mm512_loadu_si512(p + h * 128), b = _mm512_loadu_si512(p + h * 128 + 64);
                const __m512i a0 = _mm512_and_si512(a, low), a1 = _mm512_and_si512(_mm512_srli_epi16(a, 4), low);
                const __m512i b0 = _mm512_and_si512(b, low), b1 = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
                for (int r = 0; r < R; r++) {
                    const __m512i x0 = _mm512_set1_epi32(quad(xq + r * k + 8 * h));
                    const __m512i x1 = _mm512_set1_epi32(quad(xq + r * k + 8 * h + 4));
                    s[r][0] = _mm512_dpbusd_epi32(s[r][0], a0, x0);
                    s[r][1] = _mm512_dpbusd_epi32(s[r][1], b0, x0);
                    s[r][0] = _mm512_dpbusd_epi32(s[r][0], a1, x1);
                    s[r][1] = _mm512_dpbusd_epi32(s[r][1], b1, x1);
                }
            }
        } else {
            for (int q = 0; q < 8; q++) {
                const __m512i a = _mm512_loadu_si512(p + q * 128), b = _mm512_loadu_si512(p + q * 128 + 64);
                for (int r = 0; r < R; r++) {
                    const __m512i x = _mm512_set1_epi32(quad(xq + r * k + 4 * q));
                    s[r][0] = _mm512_dpbusd_epi32(s[r][0], a, x);
                    s[r][1] = _mm512_dpbusd_epi32(s[r][1], b, x);
                }
            }
        }
        const float *dw = (const float *)(p + codes);
        const __m512 d0 = _mm512_loadu_ps(dw), d1 = _mm512_loadu_ps(dw + 16);
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(j->xd[(r0 + r) * groups + g]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(d0, dx), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(d1, dx), acc[r][1]);
        }
        if (Q4) {
            const __m512 m0 = _mm512_loadu_ps(dw + QNR), m1 = _mm512_loadu_ps(dw + QNR + 16);
            for (int r = 0; r < R; r++) {
                const __m512 xs = _mm512_set1_ps(j->xs[(r0 + r) * groups + g]);
                acc[r][0] = _mm512_fmadd_ps(m0, xs, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(m1, xs, acc[r][1]);
            }
        }
    }
    const __mmask16 k0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    const float *bias = j->bias ? j->bias + c0 : 0;
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(k1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        float *y = j->y + (r0 + r) * j->ldy + c0;
        _mm512_mask_storeu_ps(y, k0, bias ? _mm512_add_ps(acc[r][0], b0) : acc[r][0]);
        _mm512_mask_storeu_ps(y + 16, k1, bias ? _mm512_add_ps(acc[r][1], b1) : acc[r][1]);
    }
}

// Rows [r0, r1) against one panel: QMR-row tiles, then one tile of the rest.
AI VNNI void qrows(const int Q4, const qpacked_job_t *j, int64_t r0, int64_t r1, const uint8_t *panel, int64_t c0,
                   int cols) {
    int64_t r = r0;
    for (; r + QMR <= r1; r += QMR) qtile(Q4, QMR, j, r, panel, c0, cols, r == r0);
#define QTAIL(R) case R: qtile(Q4, R, j, r, panel, c0, cols, r == r0); break;
    switch (r1 - r) {
        QTAIL(1) QTAIL(2) QTAIL(3)
#if QMR > 4
        QTAIL(4)
#endif
#if QMR > 5
        QTAIL(5)
#endif
    }
#undef QTAIL
}

AI VNNI void qpanels(const int Q4, const qpacked_job_t *j, int64_t p0, int64_t p1) {
    const int64_t panel_bytes = j->k / QGROUP * qpacked_group_bytes(Q4);
    int64_t mc = QX_BLOCK_BYTES / j->k / QMR * QMR;
    mc = mc > QMR ? mc : QMR;
    for (int64_t r0 = 0; r0 < j->m; r0 += mc) {
        const int64_t r1 = r0 + mc < j->m ? r0 + mc : j->m;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t c0 = p * QNR, left = j->n - c0;
            qrows(Q4, j, r0, r1, j->w + p * panel_bytes, c0, left < QNR ? (int)left : QNR);
        }
    }
}

VNNI void qpacked_panels(const qpacked_job_t *j, int64_t p0, int64_t p1) {
    if (j->q4)
        qpanels(1, j, p0, p1);
    else
        qpanels(0, j, p0, p1);
}
