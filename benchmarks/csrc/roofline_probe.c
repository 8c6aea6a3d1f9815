// The machine's two limits, for benchmarks/roofline.py: how many floating-point operations per
// second its cores can issue, and how many bytes per second they can read from memory.
//
// FMA PEAK: each thread runs CHAINS independent accumulators of one FMA instruction, `rounds`
// times. An FMA's result is ready about 4 cycles after it issues and two can issue per cycle,
// so at least 8 independent chains are needed to keep both pipes busy; 12 leave room for a core
// whose latency is longer (the AVX-512 forms on Zen 4 split each 512-bit op in two halves).
// Counted as 2 operations per lane (a multiply and an add). vdpbf16ps counts 4 per float lane:
// two bfloat16 products and their two additions; vpdpbusd 8 per int32 lane: four u8 x s8 products
// and their four additions (integer operations, the packed integer GEMM's).
//
// READ BANDWIDTH: each thread sums its own slice of a buffer far larger than the caches, with
// 8 independent 256-bit accumulators and software prefetch 2 KiB ahead, as the linears read their
// weights (without the prefetch it measured ~48 GB/s here, and the kernels streamed faster).
//
// The chains are unrolled (the pragma), so the accumulators live in registers: a loop over an
// array of them kept them on the stack and measured half the rate.
//
// Threads start together on a barrier and each reads the clock itself, after the barrier and
// after its work; the figure is all threads' work over the span from the first start to the last
// end. (The caller's clock, read after its own barrier wait, raced the workers: on 2 cores the
// third thread was often scheduled after short probes had finished, which read 4e15 FLOP/s.) Compiled for AVX2 + FMA; the AVX-512 probes carry their own target attribute and are
// only called where the CPU reports the flags (the Python side checks /proc/cpuinfo).

#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 12
#define MAX_THREADS 64

typedef struct {
    int kind;
    int64_t rounds;  // FMA probes: rounds of CHAINS instructions; read: bytes of this thread's slice
    const float *buf;
    double sink;  // the accumulators' sum: the compiler may not drop the work
    double start, end;
} probe_t;

static pthread_barrier_t barrier;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double fma_avx2(int64_t rounds) {
    __m256 acc[CHAINS];
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
    for (int64_t r = 0; r < rounds; r++)
#pragma GCC unroll 16
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    __m256 s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm256_add_ps(s, acc[c]);
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0];
}

__attribute__((target("avx512f"))) static double fma_avx512(int64_t rounds) {
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (int64_t r = 0; r < rounds; r++)
#pragma GCC unroll 16
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    __m512 s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
    return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f,avx512bf16"))) static double dot_bf16(int64_t rounds) {
    __m512 acc[CHAINS];
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);  // 1.0, ~6e-8
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (int64_t r = 0; r < rounds; r++)
#pragma GCC unroll 16
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
    __m512 s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
    return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f,avx512vnni"))) static double dot_u8s8(int64_t rounds) {
    __m512i acc[CHAINS];
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
    for (int64_t r = 0; r < rounds; r++)
#pragma GCC unroll 16
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
    __m512i s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm512_add_epi32(s, acc[c]);
    return (double)_mm512_reduce_add_epi32(s);
}

static double read_sum(const float *p, int64_t bytes) {
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
    const int64_t n = bytes / sizeof(float);
    for (int64_t i = 0; i + 64 <= n; i += 64) {
        _mm_prefetch((const char *)(p + i) + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)(p + i) + 2048 + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)(p + i) + 2048 + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)(p + i) + 2048 + 192, _MM_HINT_T0);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) acc[c] = _mm256_add_ps(acc[c], _mm256_loadu_ps(p + i + 8 * c));
    }
    for (int c = 1; c < 8; c++) acc[0] = _mm256_add_ps(acc[0], acc[c]);
    float out[8];
    _mm256_storeu_ps(out, acc[0]);
    return out[0];
}

static void *run(void *arg) {
    probe_t *p = arg;
    pthread_barrier_wait(&barrier);
    p->start = now();
    switch (p->kind) {
        case 0: p->sink = fma_avx2(p->rounds); break;
        case 1: p->sink = fma_avx512(p->rounds); break;
        case 2: p->sink = dot_bf16(p->rounds); break;
        case 3: p->sink = read_sum(p->buf, p->rounds); break;
        case 4: p->sink = dot_u8s8(p->rounds); break;
    }
    p->end = now();
    return NULL;
}

// kind 0: AVX2 FMA, 1: AVX-512 FMA, 2: AVX512-BF16 dot (float operations per second), 4: AVX512-VNNI
// dot (integer operations per second); 3: read
// bandwidth over `buf` of `bytes` (bytes per second). `work`: FMA rounds per thread, or the
// buffer's bytes (split across threads). Returns the rate, or -1 for a bad argument.
double kvh_probe(int kind, int threads, int64_t work, const float *buf) {
    if (threads < 1 || threads > MAX_THREADS || kind < 0 || kind > 4 || work <= 0) return -1;
    probe_t probes[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    const int64_t slice = (work / threads) & ~(int64_t)255;  // whole 256-byte steps per thread
    pthread_barrier_init(&barrier, NULL, threads + 1);
    for (int t = 0; t < threads; t++) {
        probes[t] = (probe_t){kind, kind == 3 ? slice : work, kind == 3 ? buf + t * slice / sizeof(float) : NULL, 0, 0, 0};
        pthread_create(&ids[t], NULL, run, &probes[t]);
    }
    pthread_barrier_wait(&barrier);
    double first = 0, last = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(ids[t], NULL);
        first = t == 0 || probes[t].start < first ? probes[t].start : first;
        last = probes[t].end > last ? probes[t].end : last;
    }
    const double seconds = last - first;
    pthread_barrier_destroy(&barrier);
    static const double per_round[5] = {CHAINS * 8 * 2, CHAINS * 16 * 2, CHAINS * 16 * 4, 0, CHAINS * 16 * 8};
    const double done = kind == 3 ? (double)slice * threads : per_round[kind] * (double)work * threads;
    return done / seconds;
}
