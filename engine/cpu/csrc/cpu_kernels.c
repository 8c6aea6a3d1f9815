// kvharbor's CPU kernels for a float32 decode step, AVX2 + FMA (the float32 and bfloat16 linears
// also on AVX-512F where the CPU has it), called through ctypes
// (engine/cpu/cpu_kernels.py): the linears (y = x @ W^T + bias for a few rows) and paged decode
// attention, on a small pool of persistent threads.
//
// LINEAR: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Why: torch's float32 matmul (MKL) reached 4-20 GFLOP/s on a decode step's shapes here (1-8
// rows against SmolLM2's 576-1536-wide weights, 2 cores), and 4-14 on the 49,152 x 576 LM head,
// far below both the cores' FMA rate and the memory bandwidth a step needs (each weight read once).
//
// The weight stays as torch holds it, row-major [N, K]: no packed copy, so no extra memory and
// prefill keeps using MKL on the same tensor. (Batch-invariant engines pack their weights once and
// run packed_gemm.c instead, for every row count.) A tile is R rows of x (held in L1) against C rows of
// W, R x C <= 8 vector sums over K in registers; each weight row is read once per R rows of x.
// The C sums of a tile are reduced across lanes at the end (one hadd tree for all eight).
// Work is split by output columns.
//
// DECODE ATTENTION: one query per sequence against its K/V through its block table, read in place
// from the paged cache (no gather), one pass of online softmax per (sequence, KV head), the
// KV head's query heads together (GQA). Work is split by (sequence, KV head).
//
// THREADS: the caller is thread 0; idle workers spin briefly, then sleep on a futex, so they
// neither hold a core between steps nor pay a wake-up per call when calls come back to back.

#include <float.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "packed_gemm.h"
#include "packed_int.h"

#define MAX_THREADS 64
static int spin_rounds = 2000;  // _mm_pause rounds an idle worker spins before it sleeps
#define COL_ALIGN 8        // thread shares start on a multiple of this many columns

// Weight formats (the Q of every template below; engine/quantize.py makes them):
//   0 float32 [n, k]
//   1 int8 [n, k], one float scale per row                          (--quantization int8)
//   2 4-bit [n, k/2] in groups of 32: a group's 16 bytes hold its elements j (low nibble) and
//     j + 16 (high nibble), as GGUF's Q4_0/Q4_1 blocks do; w = q * scale[g] + min[g]
//     with one float scale and min per (row, group)                 (--quantization int4, gguf)
//   3 int8 [n, k] in groups of 32, w = q * scale[g]                  (gguf's Q8_0)
//   4 bfloat16 [n, k], no scale: widened exactly to float, products summed in float (the
//     bfloat16 model's linears in batch-invariant mode, and its LM head's float32 logits)
#define GROUP 32
#define GROUPED(Q) ((Q) == 2 || (Q) == 3)

typedef struct {
    const float *x;
    const void *w;
    const float *scale, *mins, *bias;
    float *y;
    int64_t m, k, n, ldx, ldy;
} linear_job_t;

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;  // rows of dim floats (kv_fmt 0), dim int8 + a bf16 scale (1), dim bf16 (2)
    const int32_t *tables, *ctx_lens;
    float *out;
    int64_t q_row, head_stride, table_stride, out_row, seqs, heads, kv_heads, dim, block_size;
    float scale, softcap;  // softcap 0: none; else each score becomes softcap * tanh(score / softcap)
    int kv_fmt;
    int64_t window;  // 0: the whole context; else only its last `window` positions (sliding window)
    const int64_t *tile_starts;  // tiles + 1 row offsets: a tile's rows share their sequence's table
    int64_t tiles;
} attention_job_t;

static int job_kind;  // 0 linear, 1 decode attention, 2 linear of weight format job_q, 3 dequantize,
                      // 4 the same linear through integer dot products, 5 LoRA shrink, 6 LoRA expand,
                      // 7 linear over packed weights (packed_gemm.c), 8 a pointwise op's rows (share_rows),
                      // 9 linear over packed quantized weights (packed_int.c)
// One projection's LoRA deltas for decode rows (kvharbor_lora_decode): x, a, bt and y all float32
// or all bfloat16 (`bf16`); row_slot[r] is row r's slot, or -1 for the base model.
#define LORA_MAX_SUBS 4
typedef struct {
    int bf16, enabled;  // enabled: bit j set for each sub-projection j to add
    const void *x, *a, *bt[LORA_MAX_SUBS];
    void *y;
    const int32_t *row_slot;
    float *s;  // [m, subs, rank]: each row's shrink by its own slot
    int64_t ldx, ldy, m, k, subs, slots, rank, outs[LORA_MAX_SUBS], offsets[LORA_MAX_SUBS];
} lora_job_t;

static int job_q;
static linear_job_t job;
static lora_job_t ljob;
static attention_job_t ajob;
static packed_job_t pjob;
static qpacked_job_t qjob;
// A pointwise op over rows, shared out by rows (each row's arithmetic is its own: the split never
// changes a bit).
typedef struct {
    void (*fn)(const void *args, int64_t r0, int64_t r1);
    const void *args;
    int64_t rows;
} rows_job_t;
static rows_job_t rjob;
#define SHARE_ROWS 32  // rows from which such a pass is split over the threads (rows_shared)
static atomic_int generation;  // bumped for every job; workers wait for it to change
static atomic_int pending;     // workers still busy with the current job
static int num_threads = 1;
static int started;
static pthread_t workers[MAX_THREADS];
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;  // one job at a time, whoever calls

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

// A bfloat16 (the int8 KV rows' scale, engine/kv/kv_quant.py) as a float: its 16 bits are the top
// half of the float's.
static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

// float -> bfloat16 bits, round to nearest even (as torch's .to(torch.bfloat16)).
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffff) > 0x7f800000) return (uint16_t)((v.u >> 16) | 0x40);  // NaN stays NaN
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

// 8 bfloat16 weights as 8 floats (the same shift, 8 lanes at once).
static inline __m256 load_bf16(const uint16_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// 8 int8 weights as 8 floats.
static inline __m256 load_q8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

// 8 weights of a grouped row as floats: elements [8 * sub, 8 * sub + 8) of the group at p (its
// 16 nibble bytes in format 2, its 32 int8 in format 3), with the group's scale s and min mn.
static inline __attribute__((always_inline)) __m256 load_grouped(const int Q, const uint8_t *p, const int sub,
                                                                 __m256 s, __m256 mn) {
    if (Q == 3) return _mm256_mul_ps(load_q8((const int8_t *)p + 8 * sub), s);
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + (sub & 1) * 8)));
    if (sub & 2) v = _mm256_srli_epi32(v, 4);
    v = _mm256_and_si256(v, _mm256_set1_epi32(15));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, mn);
}

// The 32 codes of one group as 4 x 8 floats, unscaled: q (0..15) in format 2, q (-127..127) in 3.
static inline __attribute__((always_inline)) void group_codes(const int Q, const uint8_t *p, __m256 w[4]) {
    if (Q == 3) {
        for (int s = 0; s < 4; s++) w[s] = load_q8((const int8_t *)p + 8 * s);
        return;
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// Sums over each group of 32 of each row of x: [m, k / 32], for the mins of format 2
// (sum_j (q_j s + mn) x_j = s sum_j q_j x_j + mn sum_j x_j). Filled per call: by fill_xsums from x,
// or by fill_xcodes from x's rounded codes (the integer path).
static float *xsums;
static int64_t xsums_len;

// buf grown to hold `need` elements of `elem` bytes (its capacity in *len), or NULL when out of
// memory (buf is then still valid and still the caller's).
static void *grown(void *buf, int64_t *len, int64_t need, size_t elem) {
    if (need <= *len) return buf;
    void *bigger = realloc(buf, (size_t)need * elem);
    if (bigger) *len = need;
    return bigger;
}

// Grouped formats: per group, the 32 codes are widened once per column and multiplied unscaled
// by each row's 32 x (4 FMAs into a temporary), and the temporary is added with the group's
// scale (1 FMA): 5 FMAs per row and group instead of dequantizing every weight first. Format 2's
// mins come in at the end, as mins . xsums.
static inline __attribute__((always_inline)) void grouped_tile(const int Q, const int R, const int C, const float *x,
                                                               int64_t ldx, const void *w, const float *scale,
                                                               const float *mins, int64_t k, int64_t n, float *y,
                                                               int64_t ldy, const float *bias, const float *xs) {
    const int64_t groups = k / GROUP, row_bytes = Q == 2 ? k / 2 : k, group_bytes = Q == 2 ? 16 : 32;
    const uint8_t *wb = (const uint8_t *)w + n * row_bytes;
    const float *sc = scale + n * groups;
    const char *next = (const char *)(wb + C * row_bytes);
    __m256 acc[4][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        // A line of each of the next tile's rows every 64 / group_bytes groups (see tile()).
        if ((g * group_bytes & 63) == 0)
            for (int q = 0; q < C; q++) _mm_prefetch(next + ((g * group_bytes / 64) * C + q) * 64, _MM_HINT_T0);
        const float *xg = x + g * GROUP;
        for (int c = 0; c < C; c++) {
            __m256 wv[4];
            group_codes(Q, wb + c * row_bytes + g * group_bytes, wv);
            const __m256 s = _mm256_broadcast_ss(sc + c * groups + g);
            for (int r = 0; r < R; r++) {
                __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xg + r * ldx), wv[0]);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + r * ldx + 8), wv[1], t);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + r * ldx + 16), wv[2], t);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + r * ldx + 24), wv[3], t);
                acc[r][c] = _mm256_fmadd_ps(t, s, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum(acc[r][c]);
            if (Q == 2) {
                const float *mn = mins + (n + c) * groups, *xr = xs + r * groups;
                __m256 v = _mm256_setzero_ps();
                int64_t g = 0;
                for (; g + 8 <= groups; g += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(xr + g), v);
                s += hsum(v);
                for (; g < groups; g++) s += mn[g] * xr[g];
            }
            y[r * ldy + n + c] = bias ? s + bias[n + c] : s;
        }
}

// R rows of x (row stride ldx) against C rows of w starting at column n; R, C and Q are constants
// in every inlined copy, so acc[][] lives in registers and the weight type's branches fold away.
// Q = 0: w is float; Q = 1: w is int8 with one float scale per row (the sums are scaled at the end);
// Q = 4: w is bfloat16; Q = 2, 3: grouped formats (grouped_tile): unscaled codes times x, each group's sum scaled once,
// format 2's mins added at the end; k is then a multiple of GROUP.
static inline __attribute__((always_inline)) void tile(const int Q, const int R, const int C, const float *x,
                                                       int64_t ldx, const void *w, const float *scale,
                                                       const float *mins, int64_t k, int64_t n, float *y,
                                                       int64_t ldy, const float *bias) {
    if (GROUPED(Q)) {
        grouped_tile(Q, R, C, x, ldx, w, scale, mins, k, n, y, ldy, bias, xsums + (x - job.x) / ldx * (k / GROUP));
        return;
    }
    __m256 acc[4][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const float *wf = (const float *)w + n * k;
    const int8_t *wq = (const int8_t *)w + n * k;
    const uint16_t *wh = (const uint16_t *)w + n * k;
    // The next tile's C weight rows follow these in memory: prefetch them a line at a time, as
    // fast as this tile consumes its own (C half-lines a step in float, C quarter-lines in
    // bfloat16, C eighth-lines in int8), so the next tile starts warm.
    const char *next = Q == 1 ? (const char *)(wq + C * k) : Q == 4 ? (const char *)(wh + C * k) : (const char *)(wf + C * k);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        if (!Q)
            for (int q = 0; q < (C + 1) / 2; q++) _mm_prefetch(next + ((i / 8) * ((C + 1) / 2) + q) * 64, _MM_HINT_T0);
        else if ((i & (Q == 4 ? 31 : 63)) == 0)
            for (int q = 0; q < C; q++) _mm_prefetch(next + ((i / (Q == 4 ? 32 : 64)) * C + q) * 64, _MM_HINT_T0);
        __m256 wv[8];
        for (int c = 0; c < C; c++)
            wv[c] = Q == 1 ? load_q8(wq + c * k + i) : Q == 4 ? load_bf16(wh + c * k + i) : _mm256_loadu_ps(wf + c * k + i);
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum(acc[r][c]);
            for (int64_t j = i; j < k; j++)
                s += x[r * ldx + j] * (Q == 1 ? (float)wq[c * k + j] : Q == 4 ? bf16_to_float(wh[c * k + j]) : wf[c * k + j]);
            if (Q == 1) s *= scale[n + c];
            y[r * ldy + n + c] = bias ? s + bias[n + c] : s;
        }
}

// Every row of x against C columns from n: 4-row tiles, then the remainder. With C = 3 a tile
// keeps 12 sums, 3 weight vectors and one x vector: all 16 registers, so 12 FMAs are in flight.
static inline __attribute__((always_inline)) void column_group(const int Q, const int C, const linear_job_t *j,
                                                               int64_t n) {
    int64_t r = 0;
    for (; r + 4 <= j->m; r += 4)
        tile(Q, 4, C, j->x + r * j->ldx, j->ldx, j->w, j->scale, j->mins, j->k, n, j->y + r * j->ldy, j->ldy, j->bias);
    const float *x = j->x + r * j->ldx;
    float *y = j->y + r * j->ldy;
    switch (j->m - r) {
        case 3: tile(Q, 3, C, x, j->ldx, j->w, j->scale, j->mins, j->k, n, y, j->ldy, j->bias); break;
        case 2: tile(Q, 2, C, x, j->ldx, j->w, j->scale, j->mins, j->k, n, y, j->ldy, j->bias); break;
        case 1: tile(Q, 1, C, x, j->ldx, j->w, j->scale, j->mins, j->k, n, y, j->ldy, j->bias); break;
    }
}

// Columns [n0, n1) for all rows. NOTE: columns outside, rows inside: a pair of weight rows
// (2 x K floats) stays in L1 while every 4-row group of x passes over it, so each weight is read
// from memory once per call whatever M is (rows outside re-read the 113 MB LM head per group).
static inline __attribute__((always_inline)) void columns(const int Q, int64_t n0, int64_t n1) {
    const linear_job_t j = job;
    int64_t n = n0;
    if (j.m == 1) {
        for (; n + 8 <= n1; n += 8) tile(Q, 1, 8, j.x, j.ldx, j.w, j.scale, j.mins, j.k, n, j.y, j.ldy, j.bias);
        for (; n < n1; n++) tile(Q, 1, 1, j.x, j.ldx, j.w, j.scale, j.mins, j.k, n, j.y, j.ldy, j.bias);
        return;
    }
    if (j.m == 2) {
        for (; n + 4 <= n1; n += 4) tile(Q, 2, 4, j.x, j.ldx, j.w, j.scale, j.mins, j.k, n, j.y, j.ldy, j.bias);
        for (; n < n1; n++) tile(Q, 2, 1, j.x, j.ldx, j.w, j.scale, j.mins, j.k, n, j.y, j.ldy, j.bias);
        return;
    }
    if (GROUPED(Q)) {  // 4 code vectors per column: 2 columns keep 8 sums in the 16 registers
        for (; n + 2 <= n1; n += 2) column_group(Q, 2, &j, n);
    } else {
        for (; n + 3 <= n1; n += 3) column_group(Q, 3, &j, n);
    }
    for (; n < n1; n++) column_group(Q, 1, &j, n);
}

// ---- the same tiles on 16 lanes, where the CPU has AVX-512F ---------------------------------------
//
// Float32 and bfloat16 weights (formats 0 and 4) take these on AVX-512 CPUs (Zen 4 and later,
// Intel since Skylake-SP): twice the products per instruction, and 32 registers, so a tile of
// 4 rows x 6 columns keeps 24 sums with 6 weight vectors and one x vector (10 loads per 24 FMAs
// against 7 per 12 on AVX2). Chosen once per process for every row count alike (linear_isa), so
// a row's sums never depend on which tile ran them: each output is one 16-lane sum over k in
// order, reduced in _mm512_reduce_add_ps's fixed tree, then the k % 16 tail, then the bias.
#define AVX512 __attribute__((target("avx512f")))

static inline __attribute__((always_inline)) AVX512 __m512 load_bf16_16(const uint16_t *p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

static inline __attribute__((always_inline)) AVX512 void tile16(const int Q, const int R, const int C, const float *x,
                                                                int64_t ldx, const void *w, int64_t k, int64_t n,
                                                                float *y, int64_t ldy, const float *bias) {
    __m512 acc[4][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const float *wf = (const float *)w + n * k;
    const uint16_t *wh = (const uint16_t *)w + n * k;
    // As tile(): the next tile's rows a line at a time, as fast as this one reads its own (C
    // lines a step in float, C half-lines in bfloat16).
    const char *next = Q == 4 ? (const char *)(wh + C * k) : (const char *)(wf + C * k);
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        if (!Q)
            for (int q = 0; q < C; q++) _mm_prefetch(next + ((i / 16) * C + q) * 64, _MM_HINT_T0);
        else if ((i & 31) == 0)
            for (int q = 0; q < C; q++) _mm_prefetch(next + ((i / 32) * C + q) * 64, _MM_HINT_T0);
        __m512 wv[8];
        for (int c = 0; c < C; c++) wv[c] = Q == 4 ? load_bf16_16(wh + c * k + i) : _mm512_loadu_ps(wf + c * k + i);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * ldx + i);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = _mm512_reduce_add_ps(acc[r][c]);
            for (int64_t j = i; j < k; j++) s += x[r * ldx + j] * (Q == 4 ? bf16_to_float(wh[c * k + j]) : wf[c * k + j]);
            y[r * ldy + n + c] = bias ? s + bias[n + c] : s;
        }
}

static inline __attribute__((always_inline)) AVX512 void column_group16(const int Q, const int C, const linear_job_t *j,
                                                                        int64_t n) {
    int64_t r = 0;
    for (; r + 4 <= j->m; r += 4) tile16(Q, 4, C, j->x + r * j->ldx, j->ldx, j->w, j->k, n, j->y + r * j->ldy, j->ldy, j->bias);
    const float *x = j->x + r * j->ldx;
    float *y = j->y + r * j->ldy;
    switch (j->m - r) {
        case 3: tile16(Q, 3, C, x, j->ldx, j->w, j->k, n, y, j->ldy, j->bias); break;
        case 2: tile16(Q, 2, C, x, j->ldx, j->w, j->k, n, y, j->ldy, j->bias); break;
        case 1: tile16(Q, 1, C, x, j->ldx, j->w, j->k, n, y, j->ldy, j->bias); break;
    }
}

// As columns(): columns outside, rows inside; 1 and 2 rows take wider tiles (memory-bound).
static inline __attribute__((always_inline)) AVX512 void columns16(const int Q, int64_t n0, int64_t n1) {
    const linear_job_t j = job;
    int64_t n = n0;
    if (j.m == 1)
        for (; n + 8 <= n1; n += 8) tile16(Q, 1, 8, j.x, j.ldx, j.w, j.k, n, j.y, j.ldy, j.bias);
    else if (j.m == 2)
        for (; n + 4 <= n1; n += 4) tile16(Q, 2, 4, j.x, j.ldx, j.w, j.k, n, j.y, j.ldy, j.bias);
    else
        for (; n + 6 <= n1; n += 6) column_group16(Q, 6, &j, n);
    for (; n < n1; n++) column_group16(Q, 1, &j, n);
}

static AVX512 void run_columns16(int q, int64_t n0, int64_t n1) {
    if (q == 4) columns16(4, n0, n1);
    else columns16(0, n0, n1);
}

// 1: formats 0 and 4 run on 16 lanes (the CPU has AVX-512F); 0: on 8. Picked when the threads are
// set (CpuKernels does that first), or by kvharbor_linear_isa.
static int linear_isa = -1;

static void pick_linear_isa(void) {
    if (linear_isa < 0) linear_isa = __builtin_cpu_supports("avx512f") ? 1 : 0;
}

static void run_columns(int q, int64_t n0, int64_t n1) {
    if (linear_isa == 1 && (q == 0 || q == 4)) {
        run_columns16(q, n0, n1);
        return;
    }
    switch (q) {
        case 0: columns(0, n0, n1); break;
        case 1: columns(1, n0, n1); break;
        case 2: columns(2, n0, n1); break;
        case 3: columns(3, n0, n1); break;
        case 4: columns(4, n0, n1); break;
    }
}

// ---- integer dot products for up to 32 rows ------------------------------------------------------
//
// A grouped product of a decode step's rows is bound by widening the weights to floats (13 ops per
// 32 weights per column), not by memory. Here x is made int8 too, per group of 32 (a scale each, as
// llama.cpp's Q8 activations), and each group is one maddubs (u8 x s8 pairs to s16) and one madd
// (to s32) per row: 4 ops to unpack 32 nibbles, 5 per row. Signed weights (formats 1 and 3) use
// maddubs(|w|, sign(x, w)). The sums are exact integers; the error is x's rounding, at most half
// of its group's step (max|x_g| / 254) per element. Measured on the AMD EPYC (2 threads, SmolLM2's
// four projection shapes x 30 layers, weights streamed from memory) against the float path that
// shares widened codes across rows: 1.1-1.2x (int4) and 1.3-1.5x (int8) at 4-8 rows, 1.3-1.5x at
// 12-32, and 1.4x at 1-2 rows (the batch-1 step, gguf). So every row count the kernel takes for a
// quantized weight (up to engine/model.py's QUANT_MAX_ROWS) goes through here.
#define INT_ROWS 32
#define WIDE_CODES 32512  // fill_xwide's largest code: 127 * 256, so the high byte stays within -127..127

static int8_t *xcodes;      // [m, k] int8 codes of x
static float *xscales;      // [m, k / 32] their scales
static int32_t *xcomp;      // [m, k / 32] -128 times the high bytes' sums (fill_xwide; packed_int.c's int8 codes)
static int8_t *xcodes_lo;   // [m, k] the low bytes of x's 16-bit codes (fill_xwide; xcodes the high)
static int32_t *xcomp_lo;   // [m, k / 32] -128 times their sums
static int64_t xcodes_len, xscales_len, xcomp_len, xcodes_lo_len, xcomp_lo_len;

typedef struct {
    const float *x;
    int64_t ldx, k;
} xcodes_args_t;

// One group of 32 of x into v, and its largest |x| (a NaN is dropped by max_ps: `nan`, where given,
// gets whether the group holds one).
static inline float group_amax(const float *p, __m256 v[4], int *nan) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 top = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
    for (int s = 0; s < 4; s++) {
        v[s] = _mm256_loadu_ps(p + 8 * s);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[s]));
        if (nan) unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[s], v[s], _CMP_UNORD_Q));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
    if (nan) *nan = _mm256_movemask_ps(unordered) != 0;
    return _mm_cvtss_f32(t);
}

// 32 int32 codes (within -128..127) as 32 int8 in element order: the packs interleave 128-bit
// lanes; the permute undoes it.
static inline __m256i int8_codes(const __m256i q[4]) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Rows [r0, r1) of x as codes, scales and sums (fill_xcodes; each row's are its own).
static void xcodes_rows(const void *args, int64_t r0, int64_t r1) {
    const xcodes_args_t *a = args;
    const float *x = a->x;
    const int64_t ldx = a->ldx, k = a->k, groups = k / GROUP;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < groups; g++) {
            __m256 v[4];
            const float amax = group_amax(x + r * ldx + g * GROUP, v, NULL), d = amax > 0 ? amax / 127.0f : 1.0f;
            const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            __m256i q[4];
            for (int s = 0; s < 4; s++) q[s] = _mm256_cvtps_epi32(_mm256_mul_ps(v[s], inv));  // round to nearest
            _mm256_storeu_si256((__m256i *)(xcodes + r * k + g * GROUP), int8_codes(q));
            xscales[r * groups + g] = d;
            // The group's sum for format 2's mins, of the rounded x as the codes hold it: the mins'
            // term then rounds as the codes' term does, and their errors cancel where w = q * s + min
            // is small, instead of adding min x (x's rounding) on top (llama.cpp's Q8_1 keeps this
            // sum for the same reason). On the tiny test models it cut the largest logit move (against
            // float32 on the same weights) from 1.6-4.4 to 0.3-1.0 under int4, Q4_0 and Q4_1.
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            xsums[r * groups + g] = d * hsum(_mm256_cvtepi32_ps(total));
        }
}

static void rows_shared(void (*fn)(const void *, int64_t, int64_t), const void *args, int64_t rows);

// The buffers fill_xcodes and fill_xwide write, grown for m rows of k (under call_lock).
static int fill_xcodes_buffers(int64_t m, int64_t k) {
    const int64_t groups = k / GROUP;
    int8_t *codes = grown(xcodes, &xcodes_len, m * k, 1);
    if (!codes) return -1;
    xcodes = codes;
    float *scales = grown(xscales, &xscales_len, m * groups, sizeof(float));
    if (!scales) return -1;
    xscales = scales;
    float *sums = grown(xsums, &xsums_len, m * groups, sizeof(float));
    if (!sums) return -1;
    xsums = sums;
    return 0;
}

// x's codes, their scales and their groups' sums (xsums) for this call (under call_lock), a
// prefill chunk's rows shared over the threads. Returns -1 when out of memory.
static int fill_xcodes(const float *x, int64_t ldx, int64_t m, int64_t k) {
    if (fill_xcodes_buffers(m, k) != 0) return -1;
    const xcodes_args_t args = {x, ldx, k};
    rows_shared(xcodes_rows, &args, m);
    return 0;
}

// 32 int32 codes of one group (|q| <= 32,512) as two int8 vectors in element order: the high bytes
// hi = (q + 128) >> 8 (-127..127) and the low lo = q - 256 hi (-128..127), so q = 256 hi + lo exactly.
static inline void split_codes(const __m256i q[4], int8_t *hi_out, int8_t *lo_out, __m256i *hi_sum, __m256i *lo_sum) {
    const __m256i half = _mm256_set1_epi32(128);
    __m256i hi[4], lo[4];
    for (int s = 0; s < 4; s++) {
        hi[s] = _mm256_srai_epi32(_mm256_add_epi32(q[s], half), 8);
        lo[s] = _mm256_sub_epi32(q[s], _mm256_slli_epi32(hi[s], 8));
    }
    _mm256_storeu_si256((__m256i *)hi_out, int8_codes(hi));
    _mm256_storeu_si256((__m256i *)lo_out, int8_codes(lo));
    *hi_sum = _mm256_add_epi32(_mm256_add_epi32(hi[0], hi[1]), _mm256_add_epi32(hi[2], hi[3]));
    *lo_sum = _mm256_add_epi32(_mm256_add_epi32(lo[0], lo[1]), _mm256_add_epi32(lo[2], lo[3]));
}

// Rows [r0, r1) of x as 16-bit codes per group of 32 (fill_xwide; each row's are its own).
static void xwide_rows(const void *args, int64_t r0, int64_t r1) {
    const xcodes_args_t *a = args;
    const int64_t ldx = a->ldx, k = a->k, groups = k / GROUP;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < groups; g++) {
            __m256 v[4];
            int nan;
            const float amax = group_amax(a->x + r * ldx + g * GROUP, v, &nan);
            // A group whose largest |x| is below WIDE_CODES / FLT_MAX (~1e-34) would scale by inf:
            // it counts as zero (its products are below 1e-34 |w|). An inf x gives the group scale
            // inf (its sums inf or NaN), a NaN x scale NaN: non-finite x stays non-finite in y,
            // as in float products, instead of turning into finite garbage.
            const float inv1 = amax > 0 ? (float)WIDE_CODES / amax : 0.0f;
            const int tiny = inv1 > FLT_MAX;
            const float d = nan ? NAN : amax > 0 && !tiny ? amax / (float)WIDE_CODES : 1.0f;
            const __m256 inv = _mm256_set1_ps(tiny || amax == INFINITY ? 0.0f : inv1);
            const __m256i top_code = _mm256_set1_epi32(WIDE_CODES), bottom_code = _mm256_set1_epi32(-WIDE_CODES);
            __m256i q[4], hi_sum, lo_sum;
            for (int s = 0; s < 4; s++) {  // round to nearest; NaN's INT_MIN clamped to the codes' range
                q[s] = _mm256_cvtps_epi32(_mm256_mul_ps(v[s], inv));
                q[s] = _mm256_min_epi32(_mm256_max_epi32(q[s], bottom_code), top_code);
            }
            split_codes(q, xcodes + r * k + g * GROUP, xcodes_lo + r * k + g * GROUP, &hi_sum, &lo_sum);
            xscales[r * groups + g] = d;
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            xsums[r * groups + g] = d * hsum(_mm256_cvtepi32_ps(total));  // exact sum: |.| <= 32 * 32,512
            xcomp[r * groups + g] = -128 * (int32_t)hsum(_mm256_cvtepi32_ps(hi_sum));
            xcomp_lo[r * groups + g] = -128 * (int32_t)hsum(_mm256_cvtepi32_ps(lo_sum));
        }
}

// x as 16-bit codes per group of 32 for packed_int.c (under call_lock): a code q = round(x * 32,512 /
// max|x_g|), so each element is within max|x_g| / 65,024 of x (int8 codes alone: / 254, which
// cost a gguf engine's prefill 13x its KL against float32), held as its high bytes (xcodes) and
// low bytes (xcodes_lo), with their sums (xcomp, xcomp_lo) and the group's scale and sum (xscales,
// xsums). Returns -1 when out of memory.
static int fill_xwide(const float *x, int64_t ldx, int64_t m, int64_t k) {
    if (fill_xcodes_buffers(m, k) != 0) return -1;
    int8_t *lo = grown(xcodes_lo, &xcodes_lo_len, m * k, 1);
    if (!lo) return -1;
    xcodes_lo = lo;
    int32_t *comp = grown(xcomp, &xcomp_len, m * (k / GROUP), sizeof(int32_t));
    if (!comp) return -1;
    xcomp = comp;
    comp = grown(xcomp_lo, &xcomp_lo_len, m * (k / GROUP), sizeof(int32_t));
    if (!comp) return -1;
    xcomp_lo = comp;
    const xcodes_args_t args = {x, ldx, k};
    rows_shared(xwide_rows, &args, m);
    return 0;
}

// 32 weight codes of one group as bytes in element order: unsigned 0..15 (format 2) or int8.
static inline __attribute__((always_inline)) __m256i group_codes_i8(const int Q, const uint8_t *p) {
    if (Q != 2) return _mm256_loadu_si256((const __m256i *)p);
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// The 32 products u8 x s8 of a group, summed in fours into 8 int32 lanes: one VNNI instruction
// where the build has it (cpu_kernels.py adds -mavxvnni on CPUs that report avx_vnni, or
// -mavx512vnni -mavx512vl on those with AVX512-VNNI alone, as AMD's Zen 4: the same vpdpbusd on
// 256-bit registers, EVEX-encoded), else maddubs (pairs to int16: |w| <= 127 and |x| <= 127, so no
// pair saturates) and madd. The sums are the same integers either way.
#if defined(__AVXVNNI__)
#define INT_DOT 1
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define INT_DOT 2
#else
#define INT_DOT 0
#endif
static inline __m256i dot_u8s8(__m256i u, __m256i s, __m256i ones) {
#if INT_DOT == 1
    (void)ones;
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif INT_DOT == 2
    (void)ones;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones);
#endif
}

// R (1-4) rows from r0 against C columns from n in format Q (1-3), through the codes of x.
static inline __attribute__((always_inline)) void int_tile(const int Q, const int R, const int C, int64_t r0,
                                                           int64_t n) {
    const linear_job_t *j = &job;
    const int64_t k = j->k, groups = k / GROUP, row_bytes = Q == 2 ? k / 2 : k, group_bytes = Q == 2 ? 16 : 32;
    const uint8_t *wb = (const uint8_t *)j->w + n * row_bytes;
    const char *next = (const char *)(wb + C * row_bytes);
    const __m256i ones = _mm256_set1_epi16(1);
    if (Q == 2)  // this tile's mins, read at its end: from memory they stalled it there (8 rows: -10%)
        for (int64_t b = 0; b < C * groups * 4; b += 64)
            _mm_prefetch((const char *)(j->mins + n * groups) + b, _MM_HINT_T0);
    __m256 acc[4][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if ((g * group_bytes & 63) == 0)
            for (int q = 0; q < C; q++) _mm_prefetch(next + ((g * group_bytes / 64) * C + q) * 64, _MM_HINT_T0);
        for (int c = 0; c < C; c++) {
            const __m256i w = group_codes_i8(Q, wb + c * row_bytes + g * group_bytes);
            const __m256i uw = Q == 2 ? w : _mm256_sign_epi8(w, w);  // |w|
            const __m256 dw = Q == 1 ? _mm256_set1_ps(1.0f) : _mm256_broadcast_ss(j->scale + (n + c) * groups + g);
            for (int r = 0; r < R; r++) {  // x's codes from L1 (not held in registers: measured no slower)
                const __m256i xr = _mm256_loadu_si256((const __m256i *)(xcodes + (r0 + r) * k + g * GROUP));
                const __m256i xs = Q == 2 ? xr : _mm256_sign_epi8(xr, w);
                const __m256i sum = dot_u8s8(uw, xs, ones);
                const __m256 dx = _mm256_broadcast_ss(xscales + (r0 + r) * groups + g);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, dx), acc[r][c]);
            }
        }
    }
    // Format 2's mins . xsums goes into the same lanes before the one reduction, the last partial
    // 8 groups through a masked load: a second reduction and a scalar tail per (row, column), with
    // the mins read from memory, were a third of an 8-row q4 product's time here (34 -> 27 ms for
    // SmolLM2's layers at 8 rows with both fixes; int8 weights take 19-21).
    const int64_t whole = groups & ~(int64_t)7;
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(groups - whole)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            __m256 v = acc[r][c];
            if (Q == 2) {
                const float *mn = j->mins + (n + c) * groups, *xr = xsums + (r0 + r) * groups;
                for (int64_t g = 0; g < whole; g += 8)
                    v = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(xr + g), v);
                if (whole < groups)
                    v = _mm256_fmadd_ps(_mm256_maskload_ps(mn + whole, tail), _mm256_maskload_ps(xr + whole, tail), v);
            }
            float s = hsum(v);
            if (Q == 1) s *= j->scale[n + c];
            float *y = j->y + (r0 + r) * j->ldy;
            y[n + c] = j->bias ? s + j->bias[n + c] : s;
        }
}

// Every row against C columns from n: 4-row tiles, then the remainder (the columns' codes stay
// in L1 while the row tiles pass over them).
static inline __attribute__((always_inline)) void int_rows(const int Q, const int C, int64_t n) {
    int64_t r = 0;
    for (; r + 4 <= job.m; r += 4) int_tile(Q, 4, C, r, n);
    switch (job.m - r) {
        case 3: int_tile(Q, 3, C, r, n); break;
        case 2: int_tile(Q, 2, C, r, n); break;
        case 1: int_tile(Q, 1, C, r, n); break;
    }
}

static inline __attribute__((always_inline)) void int_columns(const int Q, int64_t n0, int64_t n1) {
    int64_t n = n0;
    if (job.m == 1) {
        for (; n + 8 <= n1; n += 8) int_tile(Q, 1, 8, 0, n);
        for (; n < n1; n++) int_tile(Q, 1, 1, 0, n);
    } else if (job.m == 2) {
        for (; n + 4 <= n1; n += 4) int_tile(Q, 2, 4, 0, n);
        for (; n < n1; n++) int_tile(Q, 2, 1, 0, n);
    } else {
        for (; n + 2 <= n1; n += 2) int_rows(Q, 2, n);
        for (; n < n1; n++) int_rows(Q, 1, n);
    }
}

static void run_int_columns(int q, int64_t n0, int64_t n1) {
    switch (q) {
        case 1: int_columns(1, n0, n1); break;
        case 2: int_columns(2, n0, n1); break;
        case 3: int_columns(3, n0, n1); break;
    }
}

// 8 dequantized weights of row n, elements [i, i + 8): format q's (1 int8 per row, 2 q4 groups,
// 3 q8 groups), as linear_job_t j holds them.
static inline __m256 dequant8(int q, const linear_job_t *j, int64_t n, int64_t i) {
    if (q == 1) return _mm256_mul_ps(load_q8((const int8_t *)j->w + n * j->k + i), _mm256_broadcast_ss(j->scale + n));
    const int64_t groups = j->k / GROUP, g = i / GROUP;
    const uint8_t *w = (const uint8_t *)j->w + n * (q == 2 ? j->k / 2 : j->k);
    const __m256 s = _mm256_broadcast_ss(j->scale + n * groups + g);
    const __m256 mn = q == 2 ? _mm256_broadcast_ss(j->mins + n * groups + g) : _mm256_setzero_ps();
    const int sub = (int)(i % GROUP) / 8;
    return q == 2 ? load_grouped(2, w + g * 16, sub, s, mn) : load_grouped(3, w + g * 32, sub, s, mn);
}

// v[r] (row r's elements i .. i + 7) -> v[e] (element i + e of rows 0 .. 7).
static inline void transpose8(__m256 v[8]) {
    __m256 t[8], u[8];
    for (int r = 0; r < 8; r += 2) t[r] = _mm256_unpacklo_ps(v[r], v[r + 1]), t[r + 1] = _mm256_unpackhi_ps(v[r], v[r + 1]);
    for (int r = 0; r < 8; r += 4)
        for (int h = 0; h < 2; h++) {
            u[r + h] = _mm256_shuffle_ps(t[r + h], t[r + 2 + h], 0x44);
            u[r + 2 + h] = _mm256_shuffle_ps(t[r + h], t[r + 2 + h], 0xee);
        }
    // u[0], u[2], u[1], u[3] hold elements 0, 1, 2, 3 of rows 0-3 in their low halves and elements
    // 4, 5, 6, 7 in their high halves; u[4..7] the same of rows 4-7. Each permute joins one
    // element's rows 0-3 and rows 4-7.
    v[0] = _mm256_permute2f128_ps(u[0], u[4], 0x20), v[4] = _mm256_permute2f128_ps(u[0], u[4], 0x31);
    v[1] = _mm256_permute2f128_ps(u[2], u[6], 0x20), v[5] = _mm256_permute2f128_ps(u[2], u[6], 0x31);
    v[2] = _mm256_permute2f128_ps(u[1], u[5], 0x20), v[6] = _mm256_permute2f128_ps(u[1], u[5], 0x31);
    v[3] = _mm256_permute2f128_ps(u[3], u[7], 0x20), v[7] = _mm256_permute2f128_ps(u[3], u[7], 0x31);
}

// Rows [n0, n1) of the weight in job (format q) as float32, what a prefill-sized product reads
// (engine/quantize.py says why): row-major in job.y at stride ldy, or, with job.ldx = nr > 0 and
// n0 a multiple of nr, in packed_gemm.c's float32 panel layout, the last panel's columns past n1
// written as zeros. Packed, a panel is written in order, 8 k-steps (8 x nr floats) at a time: each
// 8 rows' 8 x 8 block transposed in registers. (Single floats scattered at the panel's stride ran
// 2.9x slower than dequantizing and packing in two passes; rows of 8 at a time, each panel
// written in 8 passes, ran 10x slower in a prefill than alone, each pass's lines fetched again.)
static void run_dequantize(int q, int64_t n0, int64_t n1) {
    const linear_job_t j = job;
    const int64_t nr = j.ldx;
    int64_t n = n0;
    if (nr && j.k % 8 == 0) {
        for (; n < n1; n += nr) {
            float *out = j.y + (n / nr) * j.k * nr;
            for (int64_t i = 0; i < j.k; i += 8)
                for (int64_t c = 0; c < nr; c += 8) {
                    __m256 v[8];
                    for (int r = 0; r < 8; r++)
                        v[r] = n + c + r < n1 ? dequant8(q, &j, n + c + r, i) : _mm256_setzero_ps();
                    transpose8(v);
                    for (int e = 0; e < 8; e++) _mm256_storeu_ps(out + (i + e) * nr + c, v[e]);
                }
        }
        return;
    }
    for (; n < n1; n++) {
        float *out = nr ? j.y + (n / nr) * j.k * nr + n % nr : j.y + n * j.ldy;
        const int64_t step = nr ? nr : 1;
        int64_t i = 0;
        for (; i + 8 <= j.k; i += 8) {
            float tmp[8];
            _mm256_storeu_ps(nr ? tmp : out + i, dequant8(q, &j, n, i));
            if (nr)
                for (int e = 0; e < 8; e++) out[(i + e) * step] = tmp[e];
        }
        for (; i < j.k; i++) out[i * step] = ((const int8_t *)j.w)[n * j.k + i] * j.scale[n];  // int8 only
    }
    if (nr)  // the last panel's columns past the weight's rows (n1 ends a panel everywhere but there)
        for (; n % nr; n++)
            for (int64_t i = 0; i < j.k; i++) j.y[(n / nr) * j.k * nr + i * nr + n % nr] = 0.0f;
}

// ---- LoRA deltas of decode rows (engine/lora/lora_slots.py) ------------------------------------------
//
// BGMV: each row reads only its own slot's A and B. Phase 1 (units: one (row, sub, t) dot each):
// s[r, j, t] = x[r] . A[j, slot_r, t]. Phase 2 (units: output columns of all subs, in order):
// y[r, offset_j + n] += s[r, j, :] . Bt_j[n, slot_r * rank : slot_r * rank + rank]. One call per
// projection, in place of torch's mask-multiply, casts and adds around two to four products.

static inline __m256 lora_load8(int bf16, const void *p, int64_t i) {
    return bf16 ? load_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static inline float lora_load1(int bf16, const void *p, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void lora_shrink(int64_t u0, int64_t u1) {
    const lora_job_t *j = &ljob;
    const int64_t k = j->k, per_row = j->subs * j->rank;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t r = u / per_row, sub = u % per_row / j->rank, t = u % j->rank;
        const int slot = j->row_slot[r];
        if (slot < 0) {
            j->s[u] = 0.0f;
            continue;
        }
        const int64_t row = ((sub * j->slots + slot) * j->rank + t) * k, xr = r * j->ldx;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            acc0 = _mm256_fmadd_ps(lora_load8(j->bf16, j->x, xr + i), lora_load8(j->bf16, j->a, row + i), acc0);
            acc1 = _mm256_fmadd_ps(lora_load8(j->bf16, j->x, xr + i + 8), lora_load8(j->bf16, j->a, row + i + 8), acc1);
        }
        float sum = hsum(_mm256_add_ps(acc0, acc1));
        for (; i < k; i++) sum += lora_load1(j->bf16, j->x, xr + i) * lora_load1(j->bf16, j->a, row + i);
        j->s[u] = sum;
    }
}

static inline void lora_add(const lora_job_t *j, int64_t index, float d) {
    if (j->bf16) {
        uint16_t *y = (uint16_t *)j->y + index;
        *y = float_to_bf16(bf16_to_float(*y) + d);
    } else {
        ((float *)j->y)[index] += d;
    }
}

static void lora_expand(int64_t c0, int64_t c1) {
    const lora_job_t *j = &ljob;
    const int64_t width = j->slots * j->rank;
    int64_t first = 0;  // the first column of sub `sub` in the units' order
    for (int64_t sub = 0; sub < j->subs; first += j->outs[sub], sub++) {
        const int64_t n0 = c0 > first ? c0 - first : 0, n1 = c1 - first < j->outs[sub] ? c1 - first : j->outs[sub];
        if (!(j->enabled >> sub & 1) || n0 >= n1) continue;
        for (int64_t n = n0; n < n1; n++) {
            for (int64_t r = 0; r < j->m; r++) {
                const int slot = j->row_slot[r];
                if (slot < 0) continue;
                const float *s = j->s + (r * j->subs + sub) * j->rank;
                const int64_t w = n * width + slot * j->rank;
                __m256 acc = _mm256_setzero_ps();
                int64_t t = 0;
                for (; t + 8 <= j->rank; t += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(s + t), lora_load8(j->bf16, j->bt[sub], w + t), acc);
                float d = hsum(acc);
                for (; t < j->rank; t++) d += s[t] * lora_load1(j->bf16, j->bt[sub], w + t);
                lora_add(j, r * j->ldy + j->offsets[sub] + n, d);
            }
        }
    }
}

static void run_attention(int64_t first, int64_t stride);
static void start_workers(int n);
static int wanted;
static atomic_int forked;

// Thread t's part of the current job.
static void run_share(int t) {
    if (job_kind == 7) {
        const int64_t panels = (pjob.n + pjob.nr - 1) / pjob.nr;
        packed_panels(&pjob, panels * t / num_threads, panels * (t + 1) / num_threads);
    } else if (job_kind == 9) {
        const int64_t panels = (qjob.n + 31) / 32;
        qpacked_panels(&qjob, panels * t / num_threads, panels * (t + 1) / num_threads);
    } else if (job_kind == 8) {
        rjob.fn(rjob.args, rjob.rows * t / num_threads, rjob.rows * (t + 1) / num_threads);
    } else if (job_kind != 1) {
        // A packed dequantization (job.ldx = nr) shares whole panels, so each writes its own.
        const int64_t align = job_kind == 3 && job.ldx ? job.ldx : COL_ALIGN;
        int64_t units = (job.n + align - 1) / align;
        int64_t a = units * t / num_threads * align, b = units * (t + 1) / num_threads * align;
        a = a < job.n ? a : job.n, b = b < job.n ? b : job.n;
        if (job_kind == 3)
            run_dequantize(job_q, a, b);
        else if (job_kind == 5)
            lora_shrink(a, b);
        else if (job_kind == 6)
            lora_expand(a, b);
        else if (job_kind == 4)
            run_int_columns(job_q, a, b);
        else
            run_columns(job_kind == 0 ? 0 : job_q, a, b);
    } else {
        run_attention(t, num_threads);
    }
}

// Run the job already written into job/ajob on every thread; returns when all are done.
static void run_job(int kind) {
    if (atomic_exchange(&forked, 0)) start_workers(wanted);
    job_kind = kind;
    int helpers = num_threads - 1;
    if (helpers > 0) {
        atomic_store_explicit(&pending, helpers, memory_order_relaxed);
        atomic_fetch_add_explicit(&generation, 1, memory_order_release);
        syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, helpers, NULL, NULL, 0);
    }
    run_share(0);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) _mm_pause();
}

// fn over rows [0, rows), from SHARE_ROWS rows split over the threads (the caller holds call_lock).
static void rows_shared(void (*fn)(const void *, int64_t, int64_t), const void *args, int64_t rows) {
    if (rows < SHARE_ROWS) {
        fn(args, 0, rows);
        return;
    }
    rjob = (rows_job_t){fn, args, rows};
    run_job(8);
}

static int first_seen[MAX_THREADS];  // the generation when each worker was created

static void *worker_main(void *arg) {
    int t = (int)(intptr_t)arg;
    // NOTE: not the generation at the thread's first instruction: a job posted while the thread was
    // still starting would look already seen, and the caller would wait for it forever.
    int seen = first_seen[t];
    for (;;) {
        int spins = 0, now;
        while ((now = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            if (++spins < spin_rounds)
                _mm_pause();
            else
                syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        }
        seen = now;
        run_share(t);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return NULL;
}

static int wanted = 1;  // threads asked for; a forked child starts its own workers again

// NOTE: a child of fork() has none of its parent's workers: it would wait for them forever.
static void after_fork_in_child(void) {
    pthread_mutex_init(&call_lock, NULL);
    started = 0;
    num_threads = 1;
    atomic_store(&forked, 1);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

static void start_workers(int n) {
    for (int t = started + 1; t < n; t++) {
        first_seen[t] = atomic_load(&generation);
        if (pthread_create(&workers[t], NULL, worker_main, (void *)(intptr_t)t) != 0) break;
        pthread_detach(workers[t]);
        started = t;
    }
    num_threads = started + 1 < n ? started + 1 : n;
}

// Which integer dot this build compiled (dot_u8s8): 0 maddubs + madd, 1 AVX-VNNI, 2 AVX512-VNNI.
int kvharbor_int_dot(void) { return INT_DOT; }

// The float32 / bfloat16 linears' lanes: want 0 forces the 8-lane tiles, 1 takes 16 where the CPU
// has AVX-512F, -1 only asks. Returns the choice in use (1: 16 lanes). A process keeps one choice
// (a row's bits follow it); tests and benchmarks compare the two.
int kvharbor_linear_isa(int want) {
    pthread_mutex_lock(&call_lock);
    if (want >= 0) linear_isa = -1;
    pick_linear_isa();
    if (want == 0) linear_isa = 0;
    int got = linear_isa;
    pthread_mutex_unlock(&call_lock);
    return got;
}

// How many threads (the caller included) share each call. Returns the count in use.
// How long idle workers spin before they sleep (rounds of _mm_pause, ~10-40 ns each).
void kvharbor_set_spin(int rounds) { spin_rounds = rounds < 0 ? 0 : rounds; }

int kvharbor_set_threads(int n) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    pthread_mutex_lock(&call_lock);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    wanted = n;
    start_workers(n);
    pick_linear_isa();
    pthread_mutex_unlock(&call_lock);
    return num_threads;
}

// y = x @ w^T + bias: x [m, k] (row stride ldx), w [n, k] contiguous, bias [n] or NULL,
// y [m, n] (row stride ldy).
void kvharbor_linear(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy,
                     int64_t m, int64_t k, int64_t n) {
    pthread_mutex_lock(&call_lock);
    job = (linear_job_t){x, w, NULL, NULL, bias, y, m, k, n, ldx, ldy};
    run_job(0);
    pthread_mutex_unlock(&call_lock);
}

// The panel width weights are packed in for kvharbor_linear_packed on this process's ISA
// (linear_isa): 32 columns where the linears run on 16 lanes, else 16.
int kvharbor_packed_width(void) {
    pthread_mutex_lock(&call_lock);
    pick_linear_isa();
    const int nr = packed_width(linear_isa == 1);
    pthread_mutex_unlock(&call_lock);
    return nr;
}

// Whether kvharbor_linear_packed takes format 2 (PACKED_BF16_DOT) here: AVX512-BF16, and the linears
// on 16 lanes (its panels are 32 wide).
int kvharbor_bf16_dot(void) { return kvharbor_packed_width() == packed_width(1) && packed_has_bf16_dot(); }

static uint16_t *xh;  // PACKED_BF16_DOT's x in bfloat16 (under call_lock)
static int64_t xh_len;

// y = x @ W^T + bias over W packed as `fmt` says (packed_gemm.h: float32, bfloat16, or bfloat16
// k-pairs with x rounded to bfloat16) in panels of nr columns. The packing's width picks the
// microkernel, so a weight's rows keep their bits whatever the process chose later. Returns -1 for
// a format or width this CPU has no microkernel for, -2 when out of memory.
int kvharbor_linear_packed(int fmt, int nr, const float *x, int64_t ldx, const void *w, const float *bias, float *y,
                           int64_t ldy, int64_t m, int64_t k, int64_t n) {
    if (nr != packed_width(0) && !(nr == packed_width(1) && __builtin_cpu_supports("avx512f"))) return -1;
    if (fmt < PACKED_F32 || fmt > PACKED_BF16_DOT || (fmt == PACKED_BF16_DOT && !(nr == packed_width(1) &&
                                                                                 packed_has_bf16_dot())))
        return -1;
    pthread_mutex_lock(&call_lock);
    pjob = (packed_job_t){x, w, bias, y, m, k, n, ldx, ldy, fmt, nr, NULL, packed_xh_stride(k)};
    if (fmt == PACKED_BF16_DOT) {
        uint16_t *h = grown(xh, &xh_len, m * pjob.ldxh, sizeof(uint16_t));
        if (!h) {
            pthread_mutex_unlock(&call_lock);
            return -2;
        }
        xh = pjob.xh = h;
        rows_shared(packed_round_rows, &pjob, m);
    }
    run_job(7);
    pthread_mutex_unlock(&call_lock);
    return 0;
}

// Whether kvharbor_linear_qpacked runs here: AVX512-VNNI, with the linears on 16 lanes.
int kvharbor_qpacked_vnni(void) { return kvharbor_packed_width() == packed_width(1) && qpacked_has_vnni(); }

// The bytes of one 32-column panel of kvharbor_linear_qpacked's format fmt (packed_int.h) at k.
int64_t kvharbor_qpacked_panel_bytes(int fmt, int64_t k) { return qpacked_panel_bytes(fmt, k); }

// y = x @ W^T + bias over a quantized W packed in format fmt as packed_int.c lays it out (packed_int.h
// QPACKED_*), x made 16-bit codes per group of 32 (fill_xwide). Every
// row count takes the same arithmetic (packed_int.c). Returns -1 where this CPU has no microkernel
// for it or k is not a multiple of 32, -2 when out of memory.
int kvharbor_linear_qpacked(int fmt, const float *x, int64_t ldx, const void *w, const float *bias, float *y,
                            int64_t ldy, int64_t m, int64_t k, int64_t n) {
    if (!kvharbor_qpacked_vnni() || k % GROUP || k <= 0 || fmt < QPACKED_Q8 || fmt > QPACKED_INT8) return -1;
    if (m <= 0) return 0;
    pthread_mutex_lock(&call_lock);
    if (fill_xwide(x, ldx, m, k) != 0) {
        pthread_mutex_unlock(&call_lock);
        return -2;
    }
    qjob = (qpacked_job_t){w, xcodes, xcodes_lo, xscales, xsums, xcomp, xcomp_lo, bias, y, m, k, n, ldy, fmt};
    run_job(9);
    pthread_mutex_unlock(&call_lock);
    return 0;
}

// xsums for this call's x (under call_lock). Returns -1 when out of memory.
static int fill_xsums(const float *x, int64_t ldx, int64_t m, int64_t k) {
    const int64_t groups = k / GROUP;
    float *sums = grown(xsums, &xsums_len, m * groups, sizeof(float));
    if (!sums) return -1;
    xsums = sums;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *p = x + r * ldx + g * GROUP;
            __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
            xsums[r * groups + g] = hsum(v);
        }
    return 0;
}

// The same with a weight of format q (1-4, above): scale [n] (format 1) or [n, k / 32],
// mins [n, k / 32] (format 2) or NULL. Returns -1 for a format it does not know or a k that is
// not a multiple of 32 in a grouped one, -2 when out of memory.
int kvharbor_linear_quant(int q, const float *x, int64_t ldx, const void *w, const float *scale, const float *mins,
                          const float *bias, float *y, int64_t ldy, int64_t m, int64_t k, int64_t n) {
    if (q < 1 || q > 4 || (GROUPED(q) && k % GROUP)) return -1;
    pthread_mutex_lock(&call_lock);
    const int integer = q != 4 && m >= 1 && m <= INT_ROWS && k % GROUP == 0;
    if (integer ? fill_xcodes(x, ldx, m, k) != 0 : q == 2 && fill_xsums(x, ldx, m, k) != 0) {
        pthread_mutex_unlock(&call_lock);
        return -2;
    }
    job = (linear_job_t){x, w, scale, mins, bias, y, m, k, n, ldx, ldy};
    job_q = q;
    run_job(integer ? 4 : 2);
    pthread_mutex_unlock(&call_lock);
    return 0;
}

int kvharbor_dequantize_packed(int q, const void *w, const float *scale, const float *mins, float *y, int64_t ldy,
                               int64_t k, int64_t n, int64_t nr);

// Rows of a quantized weight of format q as float32: y [n, k] (row stride ldy) = dequantized w.
int kvharbor_dequantize(int q, const void *w, const float *scale, const float *mins, float *y, int64_t ldy,
                        int64_t k, int64_t n) {
    return kvharbor_dequantize_packed(q, w, scale, mins, y, ldy, k, n, 0);
}

// The same, with nr > 0 into packed_gemm.c's float32 panels of nr columns ([ceil(n / nr)][k][nr],
// ldy unused), so that a prefill product dequantizes straight into what kvharbor_linear_packed
// reads, the last panel's columns past n zeros. Returns -1 for a format it does not take.
int kvharbor_dequantize_packed(int q, const void *w, const float *scale, const float *mins, float *y, int64_t ldy,
                               int64_t k, int64_t n, int64_t nr) {
    if (q < 1 || q > 3 || (q >= 2 && k % GROUP) || nr < 0) return -1;
    pthread_mutex_lock(&call_lock);
    job = (linear_job_t){NULL, w, scale, mins, NULL, y, 0, k, n, nr, ldy};
    job_q = q;
    run_job(3);
    pthread_mutex_unlock(&call_lock);
    return 0;
}

// y[r, offsets[j] + n] += (x[r] A[j, slot_r]^T) Bt_j[n, slot_r]^T for the decode rows r < m and
// each sub-projection j < subs whose bit is set in `enabled` (see lora_job_t). a [subs, slots, rank, k];
// bt[j] [outs[j], slots * rank]; x and y rows at strides ldx and ldy. Returns -1 for more than
// LORA_MAX_SUBS subs, -2 when out of memory, -3 for a row slot outside [-1, slots).
int kvharbor_lora_decode(int bf16, const void *x, int64_t ldx, const int32_t *row_slot, int64_t m, int64_t k,
                         const void *a, int64_t subs, int64_t slots, int64_t rank, const void *const *bt,
                         const int64_t *outs, const int64_t *offsets, int enabled, void *y, int64_t ldy) {
    if (subs < 1 || subs > LORA_MAX_SUBS) return -1;
    if (m <= 0) return 0;  // no rows: nothing to add (and no scratch to grow)
    for (int64_t r = 0; r < m; r++)
        if (row_slot[r] < -1 || row_slot[r] >= slots) return -3;
    pthread_mutex_lock(&call_lock);
    static float *scratch;
    static int64_t scratch_len;
    float *sbuf = grown(scratch, &scratch_len, m * subs * rank, sizeof(float));
    if (!sbuf) {
        pthread_mutex_unlock(&call_lock);
        return -2;
    }
    scratch = sbuf;
    lora_job_t lj = {bf16, enabled, x, a, {NULL}, y, row_slot, sbuf, ldx, ldy, m, k, subs, slots, rank, {0}, {0}};
    int64_t columns = 0;
    for (int64_t j = 0; j < subs; j++) {
        lj.bt[j] = bt[j], lj.outs[j] = outs[j], lj.offsets[j] = offsets[j];
        columns += outs[j];
    }
    ljob = lj;
    job.n = m * subs * rank;
    run_job(5);
    job.n = columns;
    run_job(6);
    pthread_mutex_unlock(&call_lock);
    return 0;
}

// ---- int8 KV rows (engine/kv/kv_quant.py) -----------------------------------------------------------




// Each of the n rows (token t, head h) of src, at src + t * tok_stride + h * head_stride floats,
// quantized to dim int8 codes + a bf16 scale and written at its slot: cache [heads][slots][dim + 2]
// bytes. The same arithmetic as kv_quant.quantize_rows, so both give the same bytes: the scale is
// max|row| * ((1 + 2^-8) / 127) rounded to bf16, each code round-half-even(x / scale).
void kvharbor_kv_write_int8(const float *src, int64_t tok_stride, int64_t head_stride, const int64_t *slots,
                            int64_t tokens, int64_t heads, int64_t dim, uint8_t *cache, int64_t slots_total) {
    const int64_t row = dim + 2;
    const float up = (float)((1.0 + 1.0 / 256.0) / 127.0);
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const float *x = src + t * tok_stride + h * head_stride;
            uint8_t *out = cache + (h * slots_total + slots[t]) * row;
            float amax = 0.0f;
            for (int64_t i = 0; i < dim; i++) amax = fmaxf(amax, fabsf(x[i]));
            const uint16_t bits = amax > 0 ? float_to_bf16(amax * up) : float_to_bf16(1.0f);
            const float scale = bf16_to_float(bits);
            for (int64_t i = 0; i < dim; i++) {
                float q = nearbyintf(x[i] / scale);  // the default rounding mode: half to even
                q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                out[i] = (uint8_t)(int8_t)q;
            }
            __builtin_memcpy(out + dim, &bits, 2);
        }
}

// ---- decode attention ---------------------------------------------------------------------------

#define MAX_GROUP 16    // query heads per KV head
#define MAX_DIM 256     // head_dim, a multiple of 8
#define ATT_BLOCK 16    // positions scored at a time

// e^x for 8 floats (Cephes' expf: range reduction to [-ln2/2, ln2/2], degree-5 polynomial;
// about 1e-7 relative error), 0 for x below -87.
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.37626f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// 8 elements of a key or value row as floats: float32 rows (KV 0), int8 codes, unscaled (KV 1),
// or bfloat16 rows (KV 2).
static inline __attribute__((always_inline)) __m256 load_row(const int KV, const char *row, int64_t i) {
    if (KV == 1) return load_q8((const int8_t *)row + i);
    if (KV == 2) return load_bf16((const uint16_t *)row + i);
    return _mm256_loadu_ps((const float *)row + i);
}

// The 8 scores of each of HB query heads (q, q + d, ...; HB <= 3, a constant in each inlined copy)
// against 8 rows (as load_row reads them) over d elements: for each head and row one 8-lane sum
// in d order, then the head's 8 sums reduced together in one fixed tree (hadd pairs within
// 128-bit halves, then the halves added), 9 instructions for 8 scores where one hsum each took
// ~5. A score's bits depend only on its query and its own row, never on the other rows or heads.
// Each K chunk is loaded once for the heads that share it (GQA): 4 rows x 3 heads of sums, 3
// query vectors and one K vector fill AVX2's 16 registers, 7 loads per 12 FMAs where one head at
// a time took 9 per 8 (the same sums: bit for bit what one head at a time gave).
static inline __attribute__((always_inline)) void scores8_heads(const int KV, const int HB, const float *q, int64_t d,
                                                                const char *const *rows, __m256 *out) {
    __m256 v[3][8];
    for (int half = 0; half < 8; half += 4) {
        __m256 a[3][4];
        for (int h = 0; h < HB; h++)
            for (int i = 0; i < 4; i++) a[h][i] = _mm256_setzero_ps();
        for (int64_t e = 0; e < d; e += 8) {
            __m256 qv[3];
            for (int h = 0; h < HB; h++) qv[h] = _mm256_loadu_ps(q + h * d + e);
            for (int i = 0; i < 4; i++) {
                const __m256 kv = load_row(KV, rows[half + i], e);
                for (int h = 0; h < HB; h++) a[h][i] = _mm256_fmadd_ps(qv[h], kv, a[h][i]);
            }
        }
        for (int h = 0; h < HB; h++)
            for (int i = 0; i < 4; i++) v[h][half + i] = a[h][i];
    }
    for (int h = 0; h < HB; h++) {
        const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(v[h][0], v[h][1]), _mm256_hadd_ps(v[h][2], v[h][3]));
        const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(v[h][4], v[h][5]), _mm256_hadd_ps(v[h][6], v[h][7]));
        out[h] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    }
}

// Scores of heads [h0, h0 + hb) (hb <= 3) of one row against a block's 16 rows (the second 8
// only where n > 8) into s0 / s1.
static inline __attribute__((always_inline)) void block_scores(const int KV, const float *q, int64_t d, int64_t hb,
                                                               const char *const *krow, int64_t n, __m256 *s0,
                                                               __m256 *s1) {
    switch (hb) {
        case 1: scores8_heads(KV, 1, q, d, krow, s0); break;
        case 2: scores8_heads(KV, 2, q, d, krow, s0); break;
        default: scores8_heads(KV, 3, q, d, krow, s0); break;
    }
    if (n <= 8) {
        for (int64_t h = 0; h < hb; h++) s1[h] = _mm256_setzero_ps();
        return;
    }
    switch (hb) {
        case 1: scores8_heads(KV, 1, q, d, krow + 8, s1); break;
        case 2: scores8_heads(KV, 2, q, d, krow + 8, s1); break;
        default: scores8_heads(KV, 3, q, d, krow + 8, s1); break;
    }
}

// acc_h = acc_h * corr_h + sum_i p_h[i] v_i for HB heads (<= 3, a constant in each inlined copy)
// over a block's n value rows: each 8-float chunk of each head a chain over i in order, as one head
// at a time gives it (int8 rows: p_h[i] x the row's scale), but each V chunk loaded once for the
// heads that share it: 3 heads x 4 chunks of sums, 3 weights and one V vector in 16 registers.
static inline __attribute__((always_inline)) void pv_heads(const int KV, const int HB, float *const *acc,
                                                           float p[][ATT_BLOCK], const float *corr,
                                                           const char *const *vrow, const float *vscale, int64_t n,
                                                           int64_t D) {
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        __m256 a[3][4];
        for (int h = 0; h < HB; h++)
            for (int c = 0; c < 4; c++) a[h][c] = _mm256_mul_ps(_mm256_load_ps(acc[h] + d + 8 * c), _mm256_set1_ps(corr[h]));
        for (int64_t i = 0; i < n; i++) {
            __m256 w[3];
            for (int h = 0; h < HB; h++) w[h] = _mm256_set1_ps(KV == 1 ? p[h][i] * vscale[i] : p[h][i]);
            for (int c = 0; c < 4; c++) {
                const __m256 v = load_row(KV, vrow[i], d + 8 * c);
                for (int h = 0; h < HB; h++) a[h][c] = _mm256_fmadd_ps(w[h], v, a[h][c]);
            }
        }
        for (int h = 0; h < HB; h++)
            for (int c = 0; c < 4; c++) _mm256_store_ps(acc[h] + d + 8 * c, a[h][c]);
    }
    for (; d < D; d += 8) {
        __m256 a[3];
        for (int h = 0; h < HB; h++) a[h] = _mm256_mul_ps(_mm256_load_ps(acc[h] + d), _mm256_set1_ps(corr[h]));
        for (int64_t i = 0; i < n; i++) {
            const __m256 v = load_row(KV, vrow[i], d);
            for (int h = 0; h < HB; h++) a[h] = _mm256_fmadd_ps(_mm256_set1_ps(KV == 1 ? p[h][i] * vscale[i] : p[h][i]), v, a[h]);
        }
        for (int h = 0; h < HB; h++) _mm256_store_ps(acc[h] + d, a[h]);
    }
}

// One unit: a tile of query rows (consecutive rows of one sequence, so one block table; a decode
// row is a tile of its own) x one KV head, its G query heads per row, against the positions of
// their contexts in blocks of ATT_BLOCK, each block's K and V rows loaded once for the whole tile:
//   | block 0 | block 1 | ... |   scores -> running max m, sum l, and acc = sum p v, rescaled.
// int8 rows: a score is (q . codes) x the K row's scale; a value row adds p x its scale x codes.
// NOTE: a query's result depends only on it and its context: its blocks are the same (aligned to
// ATT_BLOCK in absolute positions, those before its window or past its context masked), visited
// in the same order with the same arithmetic, whatever tile it is in and whatever else the call
// holds. Batch-invariant mode runs prefill rows through here, so a token's attention is the same
// bits in any batch or chunk, and a long prompt's rows share their K/V reads (a 2,048-token
// prompt's queries each read 1.3 MB of K/V per head, one row at a time; in tiles of 16, 1/16 of it).
#define TILE_ROWS 16
#define TILE_HEADS 48  // query heads (rows x G) a tile holds sums for: 48 x 256 floats, 48 KB of stack
// Prefetching K/V (measured on the 2-core family-26 EPYC, 2026-12-07: 8 decode rows at 160
// positions, bfloat16 KV, 30 layers' caches in turn so that they come from memory as in a step,
// where the weights have just streamed through the L3): 153 us a layer without, 41 with the
// cache hot. A unit's blocks lie scattered, 2-4 KB each, too short for the hardware prefetchers.
// Rolling ATT_PREFETCH blocks ahead: ~100 us. Also the unit's first ATT_L1_BYTES of K/V at its
// start, into L1: ~88. Also the next unit's first ATT_L2_BYTES into L2 while this one runs: 72-77.
// At 1,000-2,000 positions the kernel is bound by its instructions, and prefetching moves little.
#define ATT_PREFETCH 2
#define ATT_L1_BYTES (32 * 1024)
#define ATT_L2_BYTES (128 * 1024)

// Prefetch (into L1) the K and V rows of positions [t0, t0 + ATT_BLOCK) below `last`: a decode
// step's blocks lie scattered in a cache the weights have just streamed past, so each block's
// first reads waited on memory. Rows are `row` bytes; a cache block's rows are contiguous.
static inline __attribute__((always_inline)) void prefetch_block(const attention_job_t *j, const int32_t *table,
                                                                 const char *kc, const char *vc, int64_t row,
                                                                 int64_t t0, int64_t last, const int l2) {
    for (int64_t t = t0; t < last && t < t0 + ATT_BLOCK;) {
        const int64_t off = t % j->block_size, n = j->block_size - off < t0 + ATT_BLOCK - t ? j->block_size - off
                                                                                         : t0 + ATT_BLOCK - t;
        const int64_t slot = (int64_t)table[t / j->block_size] * j->block_size + off;
        const int64_t bytes = (last - t < n ? last - t : n) * row;
        for (int64_t b = 0; b < bytes; b += 64) {
            if (l2) {
                _mm_prefetch(kc + slot * row + b, _MM_HINT_T1);
                _mm_prefetch(vc + slot * row + b, _MM_HINT_T1);
            } else {
                _mm_prefetch(kc + slot * row + b, _MM_HINT_T0);
                _mm_prefetch(vc + slot * row + b, _MM_HINT_T0);
            }
        }
        t += n;
    }
}
static inline __attribute__((always_inline)) void attention_tile(const int KV, const attention_job_t *j, int64_t r0,
                                                                 int64_t r1, int64_t g) {
    const int Q8 = KV == 1;
    const int64_t G = j->heads / j->kv_heads, D = j->dim, T = r1 - r0;
    const int64_t row = Q8 ? D + 2 : KV == 2 ? D * 2 : D * 4;  // bytes per (slot, head) row
    const int32_t *table = j->tables + r0 * j->table_stride;
    const char *kc = (const char *)j->k_cache + g * j->head_stride, *vc = (const char *)j->v_cache + g * j->head_stride;
    float acc[TILE_HEADS][MAX_DIM] __attribute__((aligned(32)));
    float m[TILE_HEADS], l[TILE_HEADS];
    int64_t ctx[TILE_ROWS], begin[TILE_ROWS], first = INT64_MAX, last = 0;
    for (int64_t r = 0; r < T; r++) {
        ctx[r] = j->ctx_lens[r0 + r];
        begin[r] = j->window > 0 && ctx[r] > j->window ? ctx[r] - j->window : 0;
        first = begin[r] < first ? begin[r] : first;
        last = ctx[r] > last ? ctx[r] : last;
    }
    for (int64_t hh = 0; hh < T * G; hh++) {
        m[hh] = -INFINITY;
        l[hh] = 0.0f;
        for (int64_t d = 0; d < D; d++) acc[hh][d] = 0.0f;
    }
    const int64_t start = first - first % ATT_BLOCK;
    const int64_t head_blocks = ATT_L1_BYTES / (2 * ATT_BLOCK * row);
    for (int64_t p = 0; p < (head_blocks > ATT_PREFETCH ? head_blocks : ATT_PREFETCH); p++)
        prefetch_block(j, table, kc, vc, row, start + p * ATT_BLOCK, last, 0);
    for (int64_t t0 = start; t0 < last; t0 += ATT_BLOCK) {
        prefetch_block(j, table, kc, vc, row, t0 + ATT_PREFETCH * ATT_BLOCK, last, 0);
        const int64_t nb = last - t0 < ATT_BLOCK ? last - t0 : ATT_BLOCK;
        const char *krow[ATT_BLOCK], *vrow[ATT_BLOCK];
        float kscale[ATT_BLOCK], vscale[ATT_BLOCK];
        // The block's slots: one division, then the offset steps through the cache blocks.
        int64_t blk = t0 / j->block_size, off = t0 % j->block_size;
        for (int64_t i = 0; i < ATT_BLOCK; i++) {
            // Positions past every context read the block's first row; their scores are dropped.
            const int64_t slot = i < nb ? (int64_t)table[blk] * j->block_size + off : -1;
            krow[i] = slot < 0 ? krow[0] : kc + slot * row;
            vrow[i] = slot < 0 ? vrow[0] : vc + slot * row;
            if (++off == j->block_size) off = 0, blk++;
            if (Q8) {
                uint16_t hk, hv;
                __builtin_memcpy(&hk, krow[i] + D, 2);
                __builtin_memcpy(&hv, vrow[i] + D, 2);
                kscale[i] = bf16_to_float(hk) * j->scale, vscale[i] = bf16_to_float(hv);
            }
        }
        for (int64_t r = 0; r < T; r++) {
            if (t0 >= ctx[r] || t0 + ATT_BLOCK <= begin[r]) continue;  // none of r's positions
            const int64_t n = ctx[r] - t0 < ATT_BLOCK ? ctx[r] - t0 : ATT_BLOCK;  // r's positions here
            const int64_t skip = begin[r] > t0 ? begin[r] - t0 : 0;              // before r's window
            const float *q = j->q + (r0 + r) * j->q_row + g * G * D;
            __m256 hs0[3], hs1[3];
            float p[3][ATT_BLOCK] __attribute__((aligned(32)));
            float corr[3];
            float *a_g[3];
            for (int64_t h = 0; h < G; h++) {
                const int64_t hb = G - h / 3 * 3 < 3 ? G - h / 3 * 3 : 3;  // heads in h's group of 3
                if (h % 3 == 0) block_scores(KV, q + h * D, D, hb, krow, n, hs0, hs1);
                float *m_h = m + r * G + h, *l_h = l + r * G + h;
                float *s = p[h % 3];
                __m256 s0 = hs0[h % 3];
                __m256 s1 = hs1[h % 3];
                s0 = _mm256_mul_ps(s0, Q8 ? _mm256_loadu_ps(kscale) : _mm256_set1_ps(j->scale));
                s1 = _mm256_mul_ps(s1, Q8 ? _mm256_loadu_ps(kscale + 8) : _mm256_set1_ps(j->scale));
                if (j->softcap > 0.0f) {  // Gemma 2: scalar tanhf, as the reference's
                    _mm256_store_ps(s, s0);
                    _mm256_store_ps(s + 8, s1);
                    for (int64_t i = 0; i < n; i++) s[i] = j->softcap * tanhf(s[i] / j->softcap);
                    s0 = _mm256_load_ps(s), s1 = _mm256_load_ps(s + 8);
                }
                // Positions before r's window or past its context: -inf (no weight).
                const __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
                const __m256i lo = _mm256_set1_epi32((int)skip - 1), hi = _mm256_set1_epi32((int)n);
                const __m256 none = _mm256_set1_ps(-INFINITY);
                s0 = _mm256_blendv_ps(none, s0, _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(i0, lo), _mm256_cmpgt_epi32(hi, i0))));
                s1 = _mm256_blendv_ps(none, s1, _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(i1, lo), _mm256_cmpgt_epi32(hi, i1))));
                __m256 mx = _mm256_max_ps(s0, s1);
                mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
                mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4e));
                mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xb1));
                const float top = _mm256_cvtss_f32(mx) > *m_h ? _mm256_cvtss_f32(mx) : *m_h;
                const __m256 mv = _mm256_set1_ps(top);
                __m256 p0 = exp256(_mm256_sub_ps(s0, mv));
                __m256 p1 = exp256(_mm256_sub_ps(s1, mv));
                _mm256_store_ps(s, p0);
                _mm256_store_ps(s + 8, p1);
                // expf(0) is exactly 1: where the running max stands (most blocks after a prompt's
                // first few), the libm call is skipped with the same bits.
                corr[h % 3] = *m_h == -INFINITY ? 0.0f : *m_h == top ? 1.0f : expf(*m_h - top);
                *l_h = *l_h * corr[h % 3] + hsum(_mm256_add_ps(p0, p1));
                *m_h = top;
                a_g[h % 3] = acc[r * G + h];
                // acc = acc * corr + sum_i p_i v_i for the group's heads together, once its last
                // head's weights are known (pv_heads). Measured on the family-26 EPYC (2026-12-07,
                // bfloat16 KV, the same bits): a 2,048-row prompt's attention 51 -> 43 ms with the
                // scores alone shared (block_scores), 33 ms with the value sums shared too.
                if (h % 3 == hb - 1) {
                    switch (hb) {
                        case 1: pv_heads(KV, 1, a_g, p, corr, vrow, vscale, n, D); break;
                        case 2: pv_heads(KV, 2, a_g, p, corr, vrow, vscale, n, D); break;
                        default: pv_heads(KV, 3, a_g, p, corr, vrow, vscale, n, D); break;
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < T; r++) {
        float *out = j->out + (r0 + r) * j->out_row + g * G * D;
        for (int64_t h = 0; h < G; h++) {
            const __m256 inv = _mm256_set1_ps(1.0f / l[r * G + h]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(out + h * D + d, _mm256_mul_ps(_mm256_load_ps(acc[r * G + h] + d), inv));
        }
    }
}

// Units first, first + stride, ... of (tile, KV head): interleaved over the threads, so that a
// long prompt's later tiles (longer contexts) do not all fall to one thread.
// The first ATT_L2_BYTES of unit u's K/V into L2, while the unit before it runs.
static inline __attribute__((always_inline)) void prefetch_unit(const int KV, const attention_job_t *j, int64_t u) {
    const int64_t tile = u / j->kv_heads, g = u % j->kv_heads, r0 = j->tile_starts[tile], r1 = j->tile_starts[tile + 1];
    const int64_t row = KV == 1 ? j->dim + 2 : KV == 2 ? j->dim * 2 : j->dim * 4;
    int64_t first = INT64_MAX, last = 0;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t ctx = j->ctx_lens[r], begin = j->window > 0 && ctx > j->window ? ctx - j->window : 0;
        first = begin < first ? begin : first;
        last = ctx > last ? ctx : last;
    }
    const char *kc = (const char *)j->k_cache + g * j->head_stride, *vc = (const char *)j->v_cache + g * j->head_stride;
    const int64_t blocks = ATT_L2_BYTES / (2 * ATT_BLOCK * row);
    for (int64_t t0 = first - first % ATT_BLOCK, p = 0; t0 < last && p < blocks; t0 += ATT_BLOCK, p++)
        prefetch_block(j, j->tables + r0 * j->table_stride, kc, vc, row, t0, last, 1);
}

static inline __attribute__((always_inline)) void attention_units(const int KV, int64_t first, int64_t stride) {
    const attention_job_t j = ajob;
    const int64_t units = j.tiles * j.kv_heads;
    for (int64_t u = first; u < units; u += stride) {
        if (u + stride < units) prefetch_unit(KV, &j, u + stride);
        const int64_t tile = u / j.kv_heads, g = u % j.kv_heads;
        attention_tile(KV, &j, j.tile_starts[tile], j.tile_starts[tile + 1], g);
    }
}

static void run_attention(int64_t first, int64_t stride) {
    switch (ajob.kv_fmt) {
        case 1: attention_units(1, first, stride); break;
        case 2: attention_units(2, first, stride); break;
        default: attention_units(0, first, stride); break;
    }
}

// Row offsets of this call's tiles (under call_lock): each run of rows cut into tiles of up to
// TILE_ROWS rows and TILE_HEADS query heads.
static int64_t *tile_starts;
static int64_t tile_starts_len;

// out[b, h, :] = softmax(q[b, h] . K_b^T * scale) V_b for each decode sequence b, with K_b/V_b the
// first ctx_lens[b] positions of its blocks in the paged cache. q rows: [heads * dim] floats every
// q_row; caches: [kv_heads][slots][row] with row dim floats (kv_fmt 0), dim int8 codes and a bf16
// scale (1), or dim bfloat16 (2); head_stride in bytes; tables: int32 block ids, table_stride per sequence. Needs
// heads / kv_heads <= 16, dim a multiple of 8, at most 256. window > 0: only the last `window` positions
// of each context (a sliding-window layer); softcap > 0: scores soft-capped (Gemma 2). runs: NULL
// (every row a sequence of its own), or num_runs + 1 row offsets whose runs are rows of one
// sequence each (its table in every row), consecutive positions: they are attended in tiles.
// Returns -1 for a shape it does not take, -2 when out of memory, -3 for runs that do not rise
// from 0 to seqs.
int kvharbor_decode_attention(const float *q, int64_t q_row, const void *k_cache, const void *v_cache,
                              int64_t head_stride, const int32_t *tables, int64_t table_stride,
                              const int32_t *ctx_lens, float *out, int64_t out_row, int64_t seqs, int64_t heads,
                              int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int kv_fmt,
                              int64_t window, float softcap, const int64_t *runs, int64_t num_runs) {
    if (heads % kv_heads || heads / kv_heads > MAX_GROUP || dim % 8 || dim > MAX_DIM || kv_fmt < 0 || kv_fmt > 2)
        return -1;
    const int64_t per_tile = TILE_HEADS / (heads / kv_heads) < TILE_ROWS ? TILE_HEADS / (heads / kv_heads) : TILE_ROWS;
    int64_t tiles = 0;
    if (runs && (runs[0] != 0 || runs[num_runs] != seqs)) return -3;
    for (int64_t i = 0; i < num_runs; i++) {
        if (runs[i + 1] < runs[i]) return -3;
        tiles += (runs[i + 1] - runs[i] + per_tile - 1) / per_tile;
    }
    if (!runs) tiles = seqs;
    pthread_mutex_lock(&call_lock);
    int64_t *starts = grown(tile_starts, &tile_starts_len, tiles + 1, sizeof(int64_t));
    if (!starts) {
        pthread_mutex_unlock(&call_lock);
        return -2;
    }
    tile_starts = starts;
    int64_t t = 0;
    for (int64_t i = 0; runs && i < num_runs; i++)
        for (int64_t r = runs[i]; r < runs[i + 1]; r += per_tile) starts[t++] = r;
    for (; t < tiles; t++) starts[t] = t;  // no runs: a tile per row
    starts[tiles] = runs ? runs[num_runs] : seqs;
    ajob = (attention_job_t){q, k_cache, v_cache, tables, ctx_lens, out, q_row, head_stride, table_stride,
                             out_row, seqs, heads, kv_heads, dim, block_size, scale, softcap, kv_fmt, window,
                             starts, tiles};
    run_job(1);
    pthread_mutex_unlock(&call_lock);
    return 0;
}

// ---- the layer's pointwise ops (engine/cpu/layer_ops.py) ----------------------------------------------
//
// Why: a decode step's norms, RoPE, SiLU and K/V writes are a few thousand floats each, where torch
// pays microseconds of dispatch per op: F.rms_norm alone ran 9 ops and 72 us a call here (AMD EPYC,
// float32), 4.3 ms of a 31 ms SmolLM2 token at batch 1. Each is one call: a decode step's few rows
// on the calling thread (too little work to share), SHARE_ROWS rows or more (a prefill chunk in
// batch-invariant mode, where every row comes here) split by rows over the pool's threads. On
// 2,048 rows on the 2-core family-26 EPYC: RMS norm 245 -> 127 us, SiLU-and-multiply 2.1 -> 0.7 ms,
// RoPE 130 -> 76 us.

static void share_rows(void (*fn)(const void *, int64_t, int64_t), const void *args, int64_t rows) {
    if (rows < SHARE_ROWS) {
        fn(args, 0, rows);
        return;
    }
    pthread_mutex_lock(&call_lock);
    rows_shared(fn, args, rows);
    pthread_mutex_unlock(&call_lock);
}

typedef struct {
    const float *x;
    int64_t ldx;
    float *residual;
    const float *w;
    float *out;
    int64_t hidden;
    float eps;
} norm_args_t;

static void add_rms_norm_rows(const void *args, int64_t r0, int64_t r1) {
    const norm_args_t *a = args;
    const float *x = a->x, *w = a->w;
    const int64_t hidden = a->hidden, ldx = a->ldx, vec = hidden & ~(int64_t)7;
    for (int64_t r = r0; r < r1; r++) {
        float *res = a->residual + r * hidden, *o = a->out + r * hidden;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < vec; i += 8) {
            __m256 v = _mm256_loadu_ps(res + i);
            if (x) v = _mm256_add_ps(v, _mm256_loadu_ps(x + r * ldx + i)), _mm256_storeu_ps(res + i, v);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sq = hsum(acc);
        for (int64_t i = vec; i < hidden; i++) {
            if (x) res[i] += x[r * ldx + i];
            sq += res[i] * res[i];
        }
        const float inv = 1.0f / sqrtf(sq / (float)hidden + a->eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int64_t i = 0; i < vec; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(res + i), vinv)));
        for (int64_t i = vec; i < hidden; i++) o[i] = w[i] * (res[i] * inv);
    }
}

// residual [rows, hidden] (contiguous) += x (row stride ldx; NULL: no add), then
// out [rows, hidden] = w * (residual * rsqrt(mean(residual^2) + eps)), the order of the reference.
void kvharbor_add_rms_norm(const float *x, int64_t ldx, float *residual, const float *w, float *out,
                           int64_t rows, int64_t hidden, float eps) {
    const norm_args_t args = {x, ldx, residual, w, out, hidden, eps};
    share_rows(add_rms_norm_rows, &args, rows);
}

typedef struct {
    float *x;
    int64_t ldx, heads, dim;
    const float *cos, *sin;
} rope_args_t;

static void rope_rows(const void *args, int64_t r0, int64_t r1) {
    const rope_args_t *p = args;
    const int64_t half = p->dim / 2, vec = half & ~(int64_t)7;
    for (int64_t r = r0; r < r1; r++) {
        const float *c = p->cos + r * half, *s = p->sin + r * half;
        for (int64_t h = 0; h < p->heads; h++) {
            float *a = p->x + r * p->ldx + h * p->dim, *b = a + half;
            for (int64_t i = 0; i < vec; i += 8) {
                __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
                __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
                _mm256_storeu_ps(a + i, _mm256_sub_ps(_mm256_mul_ps(va, vc), _mm256_mul_ps(vb, vs)));
                _mm256_storeu_ps(b + i, _mm256_add_ps(_mm256_mul_ps(vb, vc), _mm256_mul_ps(va, vs)));
            }
            for (int64_t i = vec; i < half; i++) {
                const float ai = a[i], bi = b[i];
                a[i] = ai * c[i] - bi * s[i];
                b[i] = bi * c[i] + ai * s[i];
            }
        }
    }
}

// RoPE in place, rotate-half convention: the first `heads` heads of dim floats of each row of x
// (row stride ldx), with cos/sin [rows, dim / 2]: (a, b) -> (a cos - b sin, b cos + a sin).
void kvharbor_rope(float *x, int64_t ldx, int64_t rows, int64_t heads, int64_t dim, const float *cos,
                   const float *sin) {
    const rope_args_t args = {x, ldx, heads, dim, cos, sin};
    share_rows(rope_rows, &args, rows);
}

typedef struct {
    const float *gu;
    int64_t ldgu;
    float *out;
    int64_t inter;
} gated_args_t;

static void silu_mul_rows(const void *args, int64_t r0, int64_t r1) {
    const gated_args_t *a = args;
    const int64_t inter = a->inter, vec = inter & ~(int64_t)7;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = r0; r < r1; r++) {
        const float *g = a->gu + r * a->ldgu, *u = g + inter;
        float *o = a->out + r * inter;
        for (int64_t i = 0; i < vec; i += 8) {
            __m256 vg = _mm256_loadu_ps(g + i);
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), vg));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
        for (int64_t i = vec; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

// out [rows, inter] (contiguous) = silu(gate) * up, where each row of gu (row stride ldgu) holds
// gate then up, inter floats each; silu(g) = g / (1 + e^-g).
void kvharbor_silu_mul(const float *gu, int64_t ldgu, float *out, int64_t rows, int64_t inter) {
    const gated_args_t args = {gu, ldgu, out, inter};
    share_rows(silu_mul_rows, &args, rows);
}

static void gelu_tanh_mul_rows(const void *args, int64_t r0, int64_t r1) {
    const gated_args_t *a = args;
    const int64_t inter = a->inter, vec = inter & ~(int64_t)7;
    const float c = 0.7978845608028654f, c3 = 0.7978845608028654f * 0.044715f;
    const __m256 one = _mm256_set1_ps(1.0f), vc = _mm256_set1_ps(-2.0f * c), vc3 = _mm256_set1_ps(-2.0f * c3);
    for (int64_t r = r0; r < r1; r++) {
        const float *g = a->gu + r * a->ldgu, *u = g + inter;
        float *o = a->out + r * inter;
        for (int64_t i = 0; i < vec; i += 8) {
            __m256 vg = _mm256_loadu_ps(g + i);
            __m256 arg = _mm256_mul_ps(vg, _mm256_fmadd_ps(_mm256_mul_ps(vg, vg), vc3, vc));  // -2u
            __m256 e = exp256(arg);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
        for (int64_t i = vec; i < inter; i++) {
            const float x = g[i];
            o[i] = x / (1.0f + expf(x * (x * x * (-2.0f * c3) + (-2.0f * c)))) * u[i];
        }
    }
}

// out [rows, inter] = gelu_tanh(gate) * up (Gemma's MLP), rows of gu laid out as for silu_mul.
// gelu_tanh(g) = g/2 (1 + tanh(u)) = g / (1 + e^(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3).
void kvharbor_gelu_tanh_mul(const float *gu, int64_t ldgu, float *out, int64_t rows, int64_t inter) {
    const gated_args_t args = {gu, ldgu, out, inter};
    share_rows(gelu_tanh_mul_rows, &args, rows);
}

// Each of the rows (token t, head h) of src, at src + t * tok_stride + h * head_stride floats,
// copied to its slot of cache [heads][slots_total][dim] floats.
void kvharbor_kv_write(const float *src, int64_t tok_stride, int64_t head_stride, const int64_t *slots,
                       int64_t tokens, int64_t heads, int64_t dim, float *cache, int64_t slots_total) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            __builtin_memcpy(cache + (h * slots_total + slots[t]) * dim, src + t * tok_stride + h * head_stride,
                             (size_t)dim * sizeof(float));
}

// The same rows rounded to bfloat16 (to nearest even, as torch's .to(torch.bfloat16)) into a
// bfloat16 cache: a batch-invariant bfloat16 engine's float32 K/V. One call, where torch's
// transpose, conversion and index_copy_ took ~24 us a layer of a decode step here.
void kvharbor_kv_write_bf16(const float *src, int64_t tok_stride, int64_t head_stride, const int64_t *slots,
                            int64_t tokens, int64_t heads, int64_t dim, uint16_t *cache, int64_t slots_total) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const float *x = src + t * tok_stride + h * head_stride;
            uint16_t *out = cache + (h * slots_total + slots[t]) * dim;
            for (int64_t i = 0; i < dim; i++) out[i] = float_to_bf16(x[i]);
        }
}
