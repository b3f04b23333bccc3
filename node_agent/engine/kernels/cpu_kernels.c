/* The CPU decode step's compiled kernels: a few rows times a weight (lf_gemm), and the LoRA
 * delta of a few rows, each with its own slot (lf_lora_rows). Built at first use by
 * cpu_kernels.py with the system's C compiler; AVX-512F only (lf_supported says).
 *
 * lf_gemm: y[r, :n] = x[r, :k] · wᵀ (+ bias) for 1 to 8 rows r, where w [n, k] is packed as
 * [ceil(n / 32), k, 32] (32 output columns per block, k-major, zero columns past n). Each block
 * keeps 2 × rows accumulators of 16 columns in registers and walks its k in two halves side by
 * side, each prefetched a kilobyte ahead: two streams in flight are what let one core read the
 * weight at the speed of a matrix-vector product (docs/kernels.md, "The CPU path").
 */
#include <immintrin.h>
#include <stdint.h>

#define BLOCK 32
#define AHEAD 8 /* k rows of a block: 8 × 128 bytes */

/* The first `left` of 16 lanes (all for 16 or more). */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

int lf_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
}

static inline __attribute__((always_inline)) void step(const float *x, int64_t ldx, const float *wk, int64_t k,
                                                       int rows, __m512 *lo, __m512 *hi) {
    _mm_prefetch((const char *)(wk + AHEAD * BLOCK), _MM_HINT_T0);
    _mm_prefetch((const char *)(wk + AHEAD * BLOCK + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    for (int r = 0; r < rows; ++r) {
        const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
        lo[r] = _mm512_fmadd_ps(b, w0, lo[r]);
        hi[r] = _mm512_fmadd_ps(b, w1, hi[r]);
    }
}

static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, const float *packed,
                                                        const float *bias, float *y, int64_t ldy, int64_t n,
                                                        int64_t k, int64_t nb, int rows) {
    __m512 lo[8], hi[8];
    const int64_t col = nb * BLOCK;
    const int64_t left = n - col;
    const __mmask16 mlo = tail_mask(left);
    const __mmask16 mhi = left <= 16 ? (__mmask16)0 : tail_mask(left - 16);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mlo, bias + col) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(mhi, bias + col + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
        lo[r] = _mm512_setzero_ps();
        hi[r] = _mm512_setzero_ps();
    }
    const float *w = packed + nb * k * BLOCK;
    const int64_t half = k / 2;
    for (int64_t i = 0; i < half; ++i) {
        step(x, ldx, w + i * BLOCK, i, rows, lo, hi);
        step(x, ldx, w + (half + i) * BLOCK, half + i, rows, lo, hi);
    }
    if (k % 2)
        step(x, ldx, w + (k - 1) * BLOCK, k - 1, rows, lo, hi);
    for (int r = 0; r < rows; ++r) {
        _mm512_mask_storeu_ps(y + r * ldy + col, mlo, _mm512_add_ps(lo[r], b0));
        _mm512_mask_storeu_ps(y + r * ldy + col + 16, mhi, _mm512_add_ps(hi[r], b1));
    }
}

/* One function per row count, so that each one's accumulators are registers. */
#define ROWS(R)                                                                                     \
    static void gemm_##R(const float *x, int64_t ldx, const float *packed, const float *bias,       \
                         float *y, int64_t ldy, int64_t n, int64_t k, int threads) {              \
        const int64_t blocks = (n + BLOCK - 1) / BLOCK;                                           \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")        \
        for (int64_t nb = 0; nb < blocks; ++nb)                                                   \
            block(x, ldx, packed, bias, y, ldy, n, k, nb, R);                                     \
    }
ROWS(1)
ROWS(2)
ROWS(3)
ROWS(4)
ROWS(5)
ROWS(6)
ROWS(7)
ROWS(8)

/* Returns 0, or -1 for a row count outside 1..8. */
int lf_gemm(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
            int64_t rows, int64_t n, int64_t k, int threads) {
    switch (rows) {
    case 1: gemm_1(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;
    case 2: gemm_2(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;
    case 3: gemm_3(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;
    case 4: gemm_4(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;
    case 5: gemm_5(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;
    case 6: gemm_6(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;
    case 7: gemm_7(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;
    case 8: gemm_8(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;
    default: return -1;
    }
}

/* y[j] = a[j, :in] · x for j < rank: four rows of A side by side. */
static void shrink_row(const float *a, const float *x, int64_t rank, int64_t in, float *y) {
    int64_t j = 0;
    for (; j + 4 <= rank; j += 4) {
        const float *a0 = a + j * in, *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
        for (int64_t k = 0; k < in; k += 16) {
            const __mmask16 m = tail_mask(in - k);
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
            s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a0 + k), xv, s0);
            s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a1 + k), xv, s1);
            s2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a2 + k), xv, s2);
            s3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a3 + k), xv, s3);
        }
        y[j] = _mm512_reduce_add_ps(s0);
        y[j + 1] = _mm512_reduce_add_ps(s1);
        y[j + 2] = _mm512_reduce_add_ps(s2);
        y[j + 3] = _mm512_reduce_add_ps(s3);
    }
    for (; j < rank; ++j) {
        const float *a0 = a + j * in;
        __m512 s0 = _mm512_setzero_ps();
        for (int64_t k = 0; k < in; k += 16) {
            const __mmask16 m = tail_mask(in - k);
            s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a0 + k), _mm512_maskz_loadu_ps(m, x + k), s0);
        }
        y[j] = _mm512_reduce_add_ps(s0);
    }
}

/* out[:w] += Σ_j (scale · y[j]) · bt[j, :w]: bt is one slot's B stored column-major ([rank, w]),
 * so 64 output columns at a time stay in registers while the rank's rows stream through. */
static void expand_row(const float *bt, const float *y, int64_t rank, int64_t w, float scale, float *out) {
    for (int64_t n = 0; n < w; n += 64) {
        __mmask16 m[4];
        __m512 acc[4];
        for (int q = 0; q < 4; ++q) {
            const int64_t left = w - n - 16 * q;
            m[q] = left <= 0 ? (__mmask16)0 : tail_mask(left);
            acc[q] = _mm512_maskz_loadu_ps(m[q], out + n + 16 * q);
        }
        for (int64_t j = 0; j < rank; ++j) {
            const __m512 f = _mm512_set1_ps(scale * y[j]);
            const float *row = bt + j * w + n;
            for (int q = 0; q < 4; ++q)
                acc[q] = _mm512_fmadd_ps(f, _mm512_maskz_loadu_ps(m[q], row + 16 * q), acc[q]);
        }
        for (int q = 0; q < 4; ++q)
            _mm512_mask_storeu_ps(out + n + 16 * q, m[q], acc[q]);
    }
}

/* lf_lora_rows: for each row t whose slot s = slots[t] is not -1, add its LoRA delta into out[t]:
 * y = A[s] · x[t] over every slice's rank block at once (a: [slots, total_rank, in]), then per
 * slice i, out[t, its columns] += scales[i, s] · B_i[s] · y[its block] (bt[i]: [slots, ranks[i],
 * widths[i]], each slot's B column-major). One pass over each row's A and B; rows split over
 * threads. Returns 0, or -1 for a total rank over 4096 (the shrink's result lives on the stack). */
int lf_lora_rows(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, const int32_t *slots,
                 const float *a, int64_t total_rank, int64_t in, int64_t n_slices, const float *const *bt,
                 const int64_t *widths, const int64_t *ranks, const float *scales, int64_t n_slots, int threads) {
    if (total_rank > 4096)
        return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t s = slots[t];
        if (s < 0)
            continue;
        float y[total_rank];
        shrink_row(a + s * total_rank * in, x + t * ldx, total_rank, in, y);
        int64_t col = 0, block = 0;
        for (int64_t i = 0; i < n_slices; ++i) {
            expand_row(bt[i] + s * ranks[i] * widths[i], y + block, ranks[i], widths[i], scales[i * n_slots + s],
                       out + t * ldo + col);
            col += widths[i];
            block += ranks[i];
        }
    }
    return 0;
}
