// Does this CPU overlap streaming from memory with arithmetic on what it streams?
//
// Each thread reads its share of a 1 GiB buffer in 64-byte lines and runs K vpdpbusd per line (K = 0..8),
// once from memory (cold) and many times over a 384 KB share that stays in L2 (hot). Where the two overlap,
// the cold rate stays at the plain read (K = 0) until the hot rate falls below it; where they add up, it
// follows 1 / (1 / read + 1 / hot). Our one-token kernels are held to the first (benchmarks/results/).
//
//   gcc -O2 -march=native -pthread -o /tmp/overlap benchmarks/overlap.c && /tmp/overlap THREADS [PREFETCH_BYTES]
//
// AVX-512 VNNI only (vpdpbusd on 512-bit registers).
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    const char *p;
    size_t n;
    int reps, ahead;
    long long sink;
} share_t;

// Four lines a step: each added into its own accumulator, then K vpdpbusd each into four more.
#define KERNEL(K)                                                                                            \
    static void *run##K(void *v) {                                                                           \
        share_t *a = v;                                                                                      \
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
        const __m512i x = _mm512_set1_epi32(0x01020304);                                                     \
        for (int r = 0; r < a->reps; r++)                                                                    \
            for (size_t i = 0; i < a->n; i += 256) {                                                         \
                if (a->ahead)                                                                                \
                    for (int l = 0; l < 256; l += 64) _mm_prefetch(a->p + i + l + a->ahead, _MM_HINT_T1);    \
                __m512i v0 = _mm512_load_si512(a->p + i), v1 = _mm512_load_si512(a->p + i + 64);             \
                __m512i v2 = _mm512_load_si512(a->p + i + 128), v3 = _mm512_load_si512(a->p + i + 192);      \
                a0 = _mm512_add_epi32(a0, v0), a1 = _mm512_add_epi32(a1, v1);                                \
                a2 = _mm512_add_epi32(a2, v2), a3 = _mm512_add_epi32(a3, v3);                                \
                for (int k = 0; k < K; k++) {                                                                \
                    a4 = _mm512_dpbusd_epi32(a4, v0, x), a5 = _mm512_dpbusd_epi32(a5, v1, x);                \
                    a6 = _mm512_dpbusd_epi32(a6, v2, x), a7 = _mm512_dpbusd_epi32(a7, v3, x);                \
                }                                                                                            \
            }                                                                                                \
        a0 = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));                           \
        a4 = _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7));                           \
        a->sink = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a4));                                         \
        return 0;                                                                                            \
    }
KERNEL(0) KERNEL(1) KERNEL(2) KERNEL(4) KERNEL(6) KERNEL(8)

typedef void *(*kernel_t)(void *);

// GB/s of `threads` threads each running kernel f over its share of buf (n bytes), reps times.
static double rate(kernel_t f, const char *buf, size_t n, int reps, int threads, int ahead) {
    pthread_t th[64];
    share_t s[64];
    double t = now();
    for (int i = 0; i < threads; i++) {
        s[i] = (share_t){buf + i * (n / threads), n / threads, reps, ahead, 0};
        pthread_create(&th[i], 0, f, &s[i]);
    }
    for (int i = 0; i < threads; i++) pthread_join(th[i], 0);
    return (double)n * reps / (now() - t) / 1e9;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1, ahead = argc > 2 ? atoi(argv[2]) : 0;
    if (threads < 1 || threads > 64) return fprintf(stderr, "threads: 1 to 64\n"), 2;
    size_t n = (size_t)1 << 30, hot_n = (size_t)threads * (384 << 10);
    char *buf = aligned_alloc(64, n + 65536), *hot = aligned_alloc(64, hot_n + 65536);
    memset(buf, 1, n + 65536);
    memset(hot, 3, hot_n + 65536);
    kernel_t kernels[] = {run0, run1, run2, run4, run6, run8};
    int ks[] = {0, 1, 2, 4, 6, 8};
    double read = 0;
    printf("%d thread(s), prefetch %d bytes ahead; best of 5, GB/s\n", threads, ahead);
    for (int i = 0; i < 6; i++) {
        double cold = 0, warm = 0;
        for (int r = 0; r < 5; r++) {
            double c = rate(kernels[i], buf, n, 1, threads, ahead), h = rate(kernels[i], hot, hot_n, 2000, threads, ahead);
            cold = c > cold ? c : cold, warm = h > warm ? h : warm;
        }
        if (i == 0) read = cold;
        double added = 1 / (1 / read + 1 / warm), overlapped = warm < read ? warm : read;
        printf("K=%d: from memory %6.1f, from L2 %6.1f; if they add up %6.1f, if they overlap %6.1f\n", ks[i], cold,
               warm, added, overlapped);
    }
    return 0;
}
