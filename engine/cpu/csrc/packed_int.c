// The batch-invariant integer GEMM: quantized weights packed once at load, multiplied by x's
// 16-bit codes with AVX512-VNNI (vpdpbusd), for every row count (prefill chunks and decode steps).
//
// WHY: cpu_kernels.c's integer tiles (int_tile) keep an 8-lane sum per (row, column) and reduce it
// at the end, unpacking each weight group again for every two columns: 210-250 GOP/s at 128 rows
// here, below the float32 packed GEMM's 520 over dequantized weights. Here a tile is an outer
// product: per 4 k, one 32-bit broadcast of a row's four codes against 16 columns' four codes, 64
// products per instruction.
//
// x's CODES: each group of 32 is scaled to 16-bit codes, q = round(x * 32,512 / max|x_g|)
// (cpu_kernels.c fill_xwide), so an element is within max|x_g| / 65,024 of x. vpdpbusd takes bytes,
// so q is held as a high and a low byte, q = 256 hi + lo, and each group takes two sums, one over
// each, added in integers. Int8 codes alone (within max|x_g| / 254, as llama.cpp's Q8 activations
// and the integer tiles) were measured with quality.py on SmolLM2's gguf: mean KL against float32
// 0.0036 with every prefill row on them, against 0.00028 with float32 prefill rows, top-1 96.7%
// against 99.5%; two bytes cost 1.6x the time of one (128 rows, SmolLM2 q4: 35 against 22 ms).
//
// ARITHMETIC, per (row r, column c) and group g of 32 k, in this order for every tile shape:
//   s = 256 * sum(hi * w) + sum(lo * w)  exact in int32 (|s| <= 32 * 255 * 32,512 < 2^31; q8's
//                                        offset below)
//   y += float(s) * (scale_w * scale_x)  (one FMA; int8 weights: y += float(s) * scale_x, and y is
//                                        multiplied by the column's one scale after the last group)
//   y += min_w * sum_x                   (q4: one FMA; sum_x = scale_x times the codes' sum)
// over g = 0, 1, ... in order, in one register, never split: a row's bits do not depend on its
// neighbours, its tile, or the threads.
//
// vpdpbusd multiplies unsigned by signed bytes. q4 codes are 0..15 already; int8 codes are stored
// plus 128 (0..255), and each (row, group) sum starts at -128 times the row's byte sum (xc, xc_lo),
// so s is exact either way.
//
// LAYOUT of a panel of 32 columns, group by group: the codes, then 32 float32 scales (and 32 mins).
//   q8: 8 quads of k, each [2 halves][16 columns][4 k] bytes              (1,024 bytes)
//   q4: 4 pairs of quads, each [2 halves][16 columns][4 k] bytes, the low nibble the pair's first
//       quad, the high nibble its second                                    (512 bytes)
//   int8: q8's codes with no scales in the groups; the 32 columns' scales after the last group
//       (so the weight keeps its own size: scales per group would add 12.5%)
// so a 64-byte load is one half-panel's quad (q8) or, after a mask and a shift, two (q4).
// cpu_kernels.py packs (CpuKernels.pack_quant).
//
// TILE: QMR = 3 rows x 32 columns: 4 x 3 int32 sums (high and low, two halves) and 2 x 3 float32
// sums in registers, 2 weight vectors a quad (4 a pair of quads in q4), x's 4 bytes as a broadcast.
// Measured at 128 / 512 rows (SmolLM2 q4, 30 layers): 2 rows 36.8 / 146 ms, 3 rows 35.3 / 139,
// 4 rows 35.8 / 165, 5 rows 47.4 / 189 (the 4 x 5 int sums spill). At 8 rows 4-row tiles (4 + 4)
// ran 20% faster with the weights in cache, but 15-20% slower streaming them from memory, as a
// decode step does (roofline.py: gate/up 383-402 against 463-486 GOP/s), so 3 rows serve all.
#include "packed_int.h"

#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define QNR 32
#define QMR 3  // rows per tile (qrows' tail switch takes the 1 and 2 left over)
#define QGROUP 32
// Rows per block: as many as keep the block's codes within 256 KB of L2, a multiple of QMR.
#define QX_BLOCK_BYTES (256 * 1024)
// How far ahead of its reads a tile that streams its panel from memory prefetches (into L2).
#define QPREFETCH_BYTES 4096

int qpacked_has_vnni(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

// A group's bytes: its codes, then (q8, q4) its 32 scales, and (q4) its 32 mins.
AI int64_t group_bytes(int fmt) { return fmt == QPACKED_Q4 ? 512 + 2 * QNR * 4 : fmt == QPACKED_Q8 ? 1024 + QNR * 4 : 1024; }

int64_t qpacked_panel_bytes(int fmt, int64_t k) { return k / QGROUP * group_bytes(fmt) + (fmt == QPACKED_INT8 ? QNR * 4 : 0); }

AI int32_t quad(const int8_t *p) {  // four codes as one 32-bit lane (memcpy: no aliasing assumption)
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

// R rows (from r0) against one panel; cols <= 32 of its columns valid.
AI VNNI void qtile(const int F, const int R, const qpacked_job_t *j, int64_t r0, const uint8_t *panel, int64_t c0,
                   int cols, int stream) {
    const int Q4 = F == QPACKED_Q4;
    const int64_t k = j->k, groups = k / QGROUP, gbytes = group_bytes(F), codes = Q4 ? 512 : 1024;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[QMR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = panel + g * gbytes;
        if (stream)
            for (int64_t b = 0; b < gbytes; b += 64) _mm_prefetch((const char *)p + QPREFETCH_BYTES + b, _MM_HINT_T1);
        __m512i hi[QMR][2], lo[QMR][2];  // the sums over x's high and low bytes
        for (int r = 0; r < R; r++) {
            const int64_t at = (r0 + r) * groups + g;
            hi[r][0] = hi[r][1] = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(j->xc[at]);
            lo[r][0] = lo[r][1] = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(j->xc_lo[at]);
        }
        const int64_t x0 = r0 * k + g * QGROUP;
#define DOT(w0, w1, r, at)                                                                         \
    do {                                                                                           \
        const __m512i xh = _mm512_set1_epi32(quad(j->xq + x0 + (r) * k + (at)));                  \
        const __m512i xl = _mm512_set1_epi32(quad(j->xq_lo + x0 + (r) * k + (at)));               \
        hi[r][0] = _mm512_dpbusd_epi32(hi[r][0], w0, xh), hi[r][1] = _mm512_dpbusd_epi32(hi[r][1], w1, xh); \
        lo[r][0] = _mm512_dpbusd_epi32(lo[r][0], w0, xl), lo[r][1] = _mm512_dpbusd_epi32(lo[r][1], w1, xl); \
    } while (0)
        if (Q4) {
            for (int h = 0; h < 4; h++) {
                const __m512i a = _mm512_loadu_si512(p + h * 128), b = _mm512_loadu_si512(p + h * 128 + 64);
                const __m512i a0 = _mm512_and_si512(a, low), a1 = _mm512_and_si512(_mm512_srli_epi16(a, 4), low);
                const __m512i b0 = _mm512_and_si512(b, low), b1 = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
                for (int r = 0; r < R; r++) DOT(a0, b0, r, 8 * h);
                for (int r = 0; r < R; r++) DOT(a1, b1, r, 8 * h + 4);
            }
        } else {
            for (int q = 0; q < 8; q++) {
                const __m512i a = _mm512_loadu_si512(p + q * 128), b = _mm512_loadu_si512(p + q * 128 + 64);
                for (int r = 0; r < R; r++) DOT(a, b, r, 4 * q);
            }
        }
#undef DOT
        const float *dw = (const float *)(p + codes);
        const __m512 d0 = F == QPACKED_INT8 ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(dw);
        const __m512 d1 = F == QPACKED_INT8 ? d0 : _mm512_loadu_ps(dw + 16);
        for (int r = 0; r < R; r++) {  // 256 high + low: the codes' exact sum (|.| < 2^31, packed_int.h)
            const __m512 dx = _mm512_set1_ps(j->xd[(r0 + r) * groups + g]);
            const __m512i s0 = _mm512_add_epi32(_mm512_slli_epi32(hi[r][0], 8), lo[r][0]);
            const __m512i s1 = _mm512_add_epi32(_mm512_slli_epi32(hi[r][1], 8), lo[r][1]);
            const __m512 e0 = F == QPACKED_INT8 ? dx : _mm512_mul_ps(d0, dx);  // int8: its scale at the end
            const __m512 e1 = F == QPACKED_INT8 ? dx : _mm512_mul_ps(d1, dx);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), e0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), e1, acc[r][1]);
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
    // int8: y = acc * its column's scale (after the panel's groups) + bias, one explicit FMA, so no
    // tile shape's code can round it differently (acc * 1 + 0 = acc for the others: the same bits).
    const float *dw = (const float *)(panel + groups * gbytes);
    const __m512 d0 = F == QPACKED_INT8 ? _mm512_maskz_loadu_ps(k0, dw) : _mm512_set1_ps(1.0f);
    const __m512 d1 = F == QPACKED_INT8 ? _mm512_maskz_loadu_ps(k1, dw + 16) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < R; r++) {
        float *y = j->y + (r0 + r) * j->ldy + c0;
        _mm512_mask_storeu_ps(y, k0, _mm512_fmadd_ps(acc[r][0], d0, b0));
        _mm512_mask_storeu_ps(y + 16, k1, _mm512_fmadd_ps(acc[r][1], d1, b1));
    }
}

// Rows [r0, r1) against one panel: QMR-row tiles, then one tile of the rest.
AI VNNI void qrows(const int F, const qpacked_job_t *j, int64_t r0, int64_t r1, const uint8_t *panel, int64_t c0,
                   int cols) {
    int64_t r = r0;
    for (; r + QMR <= r1; r += QMR) qtile(F, QMR, j, r, panel, c0, cols, r == r0);
#define QTAIL(R) case R: qtile(F, R, j, r, panel, c0, cols, r == r0); break;
    switch (r1 - r) { QTAIL(1) QTAIL(2) }  // the rest: fewer than QMR rows
#undef QTAIL
}

AI VNNI void qpanels(const int F, const qpacked_job_t *j, int64_t p0, int64_t p1) {
    const int64_t panel_bytes = qpacked_panel_bytes(F, j->k);
    int64_t mc = QX_BLOCK_BYTES / (2 * j->k) / QMR * QMR;  // two bytes of codes per k
    mc = mc > QMR ? mc : QMR;
    for (int64_t r0 = 0; r0 < j->m; r0 += mc) {
        const int64_t r1 = r0 + mc < j->m ? r0 + mc : j->m;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t c0 = p * QNR, left = j->n - c0;
            qrows(F, j, r0, r1, j->w + p * panel_bytes, c0, left < QNR ? (int)left : QNR);
        }
    }
}

VNNI void qpacked_panels(const qpacked_job_t *j, int64_t p0, int64_t p1) {
    switch (j->fmt) {
        case QPACKED_Q8: qpanels(QPACKED_Q8, j, p0, p1); break;
        case QPACKED_Q4: qpanels(QPACKED_Q4, j, p0, p1); break;
        case QPACKED_INT8: qpanels(QPACKED_INT8, j, p0, p1); break;
    }
}
