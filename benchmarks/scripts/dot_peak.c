/* The machine's integer dot-product peak, measured: each thread runs 12 independent chains of
 * the instruction the kernels' inner loops use, on register operands only (no memory), and the
 * multiply-adds per second over all threads are reported.
 *   avx512_vnni: vpdpbusd zmm (64 u8×s8 multiply-adds into 16 int32 lanes per instruction)
 *   avx2:        vpmaddubsw ymm + vpaddw (32 u8×s8 multiply-adds per pair: the 4-bit path's)
 *
 *   gcc -O2 -march=native -fopenmp benchmarks/scripts/dot_peak.c -o /tmp/dot_peak
 *   OMP_NUM_THREADS=2 /tmp/dot_peak
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define CHAINS 12
#define ITERS 100000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* 12 independent accumulators (zmm/ymm 4..15), operands in 0 and 1; written in assembly so
 * that nothing but the measured instructions runs in the loop. */
#define R12(op) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11) op(12) op(13) op(14) op(15)

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define VNNI(r) "vpdpbusd %%zmm1, %%zmm0, %%zmm" #r "\n\t"
static double vnni(void) {
    double t0 = now();
#pragma omp parallel
    {
        for (long i = 0; i < ITERS / 10; i++)
            __asm__ volatile(R12(VNNI) ::: "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                             "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
    }
    double dt = now() - t0;
    return (double)omp_get_max_threads() * (ITERS / 10) * CHAINS * 64 / dt;
}
#endif

#define MADD(r) "vpmaddubsw %%ymm1, %%ymm0, %%ymm2\n\tvpaddw %%ymm2, %%ymm" #r ", %%ymm" #r "\n\t"
static double avx2(void) {
    double t0 = now();
#pragma omp parallel
    {
        for (long i = 0; i < ITERS / 10; i++)
            __asm__ volatile(R12(MADD) ::: "xmm2", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
                             "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
    }
    double dt = now() - t0;
    return (double)omp_get_max_threads() * (ITERS / 10) * CHAINS * 32 / dt;
}

int main(void) {
    printf("{\"threads\": %d", omp_get_max_threads());
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    vnni();
    printf(", \"avx512_vnni_macs_per_s\": %.4g", vnni());
#endif
    avx2();
    printf(", \"avx2_macs_per_s\": %.4g}\n", avx2());
    return 0;
}
