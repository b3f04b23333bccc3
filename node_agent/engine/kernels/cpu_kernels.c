/* The CPU decode step's compiled kernels: a few rows times a weight (lf_gemm), and the LoRA
 * delta of a few rows, each with its own slot (lf_lora_rows), each over fp32, bf16 or fp16
 * weights (the _bf16 and _f16 entry points), in fp32 arithmetic. Built at first use by
 * cpu_kernels.py with the system's C compiler; AVX-512F only (lf_supported says).
 *
 * lf_gemm: y[r, :n] = x[r, :k] · wᵀ (+ bias) for 1 to 8 rows r, where w [n, k] is packed as
 * [ceil(n / 32), k, 32] (32 output columns per block, k-major, zero columns past n). Each block
 * keeps 2 × rows accumulators of 16 columns in registers and walks its k in two halves side by
 * side, each prefetched a kilobyte ahead: two streams in flight are what let one core read the
 * weight at the speed of a matrix-vector product (docs/kernels.md, "The CPU path").
 *
 * lf_gemm_bf16, lf_gemm_f16: the same for a bf16 or fp16 weight packed the same way (x, bias and
 * y stay fp32): each 64-byte row of a block widens to fp32 exactly, so the arithmetic is
 * lf_gemm's on the same values, over half the bytes.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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

/* Row k of a block as two vectors of 16 fp32 columns, prefetching `AHEAD` rows ahead. */
static inline __attribute__((always_inline)) void load_f32(const void *w, int64_t k, __m512 *w0, __m512 *w1) {
    const float *wk = (const float *)w + k * BLOCK;
    _mm_prefetch((const char *)(wk + AHEAD * BLOCK), _MM_HINT_T0);
    _mm_prefetch((const char *)(wk + AHEAD * BLOCK + 16), _MM_HINT_T0);
    *w0 = _mm512_loadu_ps(wk);
    *w1 = _mm512_loadu_ps(wk + 16);
}

/* The same for fp16: one 64-byte line a row, widened exactly (F16C's conversion, AVX-512F). */
static inline __attribute__((always_inline)) void load_f16(const void *w, int64_t k, __m512 *w0, __m512 *w1) {
    const uint16_t *wk = (const uint16_t *)w + k * BLOCK;
    _mm_prefetch((const char *)(wk + 2 * AHEAD * BLOCK), _MM_HINT_T0);
    const __m512i raw = _mm512_loadu_si512(wk);
    *w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(raw));
    *w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1));
}

/* The same for bf16: one 64-byte line a row, widened (shifted into the top half of an fp32). */
static inline __attribute__((always_inline)) void load_bf16(const void *w, int64_t k, __m512 *w0, __m512 *w1) {
    const uint16_t *wk = (const uint16_t *)w + k * BLOCK;
    _mm_prefetch((const char *)(wk + 2 * AHEAD * BLOCK), _MM_HINT_T0);
    const __m512i raw = _mm512_loadu_si512(wk);
    *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    *w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
}

static inline __attribute__((always_inline)) void fma_rows(const float *x, int64_t ldx, int64_t k, int rows, __m512 w0,
                                                           __m512 w1, __m512 *lo, __m512 *hi) {
    for (int r = 0; r < rows; ++r) {
        const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
        lo[r] = _mm512_fmadd_ps(b, w0, lo[r]);
        hi[r] = _mm512_fmadd_ps(b, w1, hi[r]);
    }
}

/* One block of 32 output columns; `LOAD` reads a row of the block's weight (load_f32, load_bf16). */
#define BLOCK_FN(NAME, LOAD, WTYPE)                                                                                  \
    static inline __attribute__((always_inline)) void NAME(const float *x, int64_t ldx, const WTYPE *packed,          \
                                                           const float *bias, float *y, int64_t ldy, int64_t n,      \
                                                           int64_t k, int64_t nb, int rows) {                        \
        __m512 lo[8], hi[8], w0, w1;                                                                                 \
        const int64_t col = nb * BLOCK;                                                                              \
        const int64_t left = n - col;                                                                                \
        const __mmask16 mlo = tail_mask(left);                                                                       \
        const __mmask16 mhi = left <= 16 ? (__mmask16)0 : tail_mask(left - 16);                                      \
        const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mlo, bias + col) : _mm512_setzero_ps();                       \
        const __m512 b1 = bias ? _mm512_maskz_loadu_ps(mhi, bias + col + 16) : _mm512_setzero_ps();                  \
        for (int r = 0; r < rows; ++r) {                                                                             \
            lo[r] = _mm512_setzero_ps();                                                                             \
            hi[r] = _mm512_setzero_ps();                                                                             \
        }                                                                                                            \
        const WTYPE *w = packed + nb * k * BLOCK;                                                                    \
        const int64_t half = k / 2;                                                                                  \
        for (int64_t i = 0; i < half; ++i) {                                                                         \
            LOAD(w, i, &w0, &w1);                                                                                    \
            fma_rows(x, ldx, i, rows, w0, w1, lo, hi);                                                               \
            LOAD(w, half + i, &w0, &w1);                                                                             \
            fma_rows(x, ldx, half + i, rows, w0, w1, lo, hi);                                                        \
        }                                                                                                            \
        if (k % 2) {                                                                                                 \
            LOAD(w, k - 1, &w0, &w1);                                                                                \
            fma_rows(x, ldx, k - 1, rows, w0, w1, lo, hi);                                                           \
        }                                                                                                            \
        for (int r = 0; r < rows; ++r) {                                                                             \
            _mm512_mask_storeu_ps(y + r * ldy + col, mlo, _mm512_add_ps(lo[r], b0));                                 \
            _mm512_mask_storeu_ps(y + r * ldy + col + 16, mhi, _mm512_add_ps(hi[r], b1));                            \
        }                                                                                                            \
    }
BLOCK_FN(block_f32, load_f32, float)
BLOCK_FN(block_bf16, load_bf16, uint16_t)
BLOCK_FN(block_f16, load_f16, uint16_t)

/* One function per row count, so that each one's accumulators are registers. */
#define ROWS(R, SUFFIX, WTYPE)                                                                                       \
    static void gemm_##SUFFIX##_##R(const float *x, int64_t ldx, const WTYPE *packed, const float *bias, float *y,   \
                                    int64_t ldy, int64_t n, int64_t k, int threads) {                               \
        const int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")                           \
        for (int64_t nb = 0; nb < blocks; ++nb)                                                                      \
            block_##SUFFIX(x, ldx, packed, bias, y, ldy, n, k, nb, R);                                               \
    }
#define ALL_ROWS(SUFFIX, WTYPE)                                                                                      \
    ROWS(1, SUFFIX, WTYPE) ROWS(2, SUFFIX, WTYPE) ROWS(3, SUFFIX, WTYPE) ROWS(4, SUFFIX, WTYPE)                      \
    ROWS(5, SUFFIX, WTYPE) ROWS(6, SUFFIX, WTYPE) ROWS(7, SUFFIX, WTYPE) ROWS(8, SUFFIX, WTYPE)
ALL_ROWS(f32, float)
ALL_ROWS(bf16, uint16_t)
ALL_ROWS(f16, uint16_t)

/* The entry points: 0, or -1 for a row count outside 1..8. */
#define GEMM_ENTRY(NAME, SUFFIX, WTYPE)                                                                              \
    int NAME(const float *x, int64_t ldx, const WTYPE *packed, const float *bias, float *y, int64_t ldy,             \
             int64_t rows, int64_t n, int64_t k, int threads) {                                                      \
        switch (rows) {                                                                                              \
        case 1: gemm_##SUFFIX##_1(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;                           \
        case 2: gemm_##SUFFIX##_2(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;                           \
        case 3: gemm_##SUFFIX##_3(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;                           \
        case 4: gemm_##SUFFIX##_4(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;                           \
        case 5: gemm_##SUFFIX##_5(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;                           \
        case 6: gemm_##SUFFIX##_6(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;                           \
        case 7: gemm_##SUFFIX##_7(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;                           \
        case 8: gemm_##SUFFIX##_8(x, ldx, packed, bias, y, ldy, n, k, threads); return 0;                           \
        default: return -1;                                                                                          \
        }                                                                                                            \
    }
GEMM_ENTRY(lf_gemm, f32, float)
GEMM_ENTRY(lf_gemm_bf16, bf16, uint16_t)
GEMM_ENTRY(lf_gemm_f16, f16, uint16_t)

/* 16 values from `p` as fp32, of which the first `left` are read (none for left <= 0, all 16
 * for left >= 16), the rest zero: one per buffer dtype of the LoRA pass. */
static inline __attribute__((always_inline)) __m512 ld_f32(const float *p, int64_t left) {
    return left <= 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(tail_mask(left), p);
}

static inline __attribute__((always_inline)) __m256i ld_half_bits(const uint16_t *p, int64_t left) {
    if (left >= 16)
        return _mm256_loadu_si256((const __m256i *)p);
    uint16_t tail[16] = {0}; /* a masked 16-bit load needs AVX-512BW: copy the tail instead */
    memcpy(tail, p, (size_t)(left > 0 ? left : 0) * sizeof(uint16_t));
    return _mm256_loadu_si256((const __m256i *)tail);
}

static inline __attribute__((always_inline)) __m512 ld_bf16(const uint16_t *p, int64_t left) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ld_half_bits(p, left)), 16));
}

static inline __attribute__((always_inline)) __m512 ld_f16(const uint16_t *p, int64_t left) {
    return _mm512_cvtph_ps(ld_half_bits(p, left));
}

/* The LoRA pass over buffers (A, B) of one dtype, x, out and the shrink's y in fp32:
 * shrink_row_SUFFIX: y[j] = a[j, :in] · x for j < rank, four rows of A side by side;
 * expand_row_SUFFIX: out[:w] += Σ_j (scale · y[j]) · bt[j, :w], bt one slot's B stored
 * column-major ([rank, w]), so 64 output columns at a time stay in registers while the rank's
 * rows stream through;
 * lf_lora_rows(_bf16, _f16): for each row t whose slot s = slots[t] is not -1, add its LoRA
 * delta into out[t]: y = A[s] · x[t] over every slice's rank block at once (a: [slots,
 * total_rank, in]), then per slice i, out[t, its columns] += scales[i, s] · B_i[s] · y[its
 * block] (bt[i]: [slots, ranks[i], widths[i]], each slot's B column-major). One pass over each
 * row's A and B; rows split over threads. Returns 0, or -1 for a total rank over 4096 (the
 * shrink's result lives on the stack). */
#define LORA_FNS(SUFFIX, NAME, WTYPE, LD)                                                                            \
    static void shrink_row_##SUFFIX(const WTYPE *a, const float *x, int64_t rank, int64_t in, float *y) {           \
        int64_t j = 0;                                                                                               \
        for (; j + 4 <= rank; j += 4) {                                                                              \
            const WTYPE *a0 = a + j * in, *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;                               \
            __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(),                     \
                   s3 = _mm512_setzero_ps();                                                                         \
            for (int64_t k = 0; k < in; k += 16) {                                                                   \
                const __m512 xv = ld_f32(x + k, in - k);                                                             \
                s0 = _mm512_fmadd_ps(LD(a0 + k, in - k), xv, s0);                                                    \
                s1 = _mm512_fmadd_ps(LD(a1 + k, in - k), xv, s1);                                                    \
                s2 = _mm512_fmadd_ps(LD(a2 + k, in - k), xv, s2);                                                    \
                s3 = _mm512_fmadd_ps(LD(a3 + k, in - k), xv, s3);                                                    \
            }                                                                                                        \
            y[j] = _mm512_reduce_add_ps(s0);                                                                         \
            y[j + 1] = _mm512_reduce_add_ps(s1);                                                                     \
            y[j + 2] = _mm512_reduce_add_ps(s2);                                                                     \
            y[j + 3] = _mm512_reduce_add_ps(s3);                                                                     \
        }                                                                                                            \
        for (; j < rank; ++j) {                                                                                      \
            const WTYPE *a0 = a + j * in;                                                                            \
            __m512 s0 = _mm512_setzero_ps();                                                                         \
            for (int64_t k = 0; k < in; k += 16)                                                                     \
                s0 = _mm512_fmadd_ps(LD(a0 + k, in - k), ld_f32(x + k, in - k), s0);                                 \
            y[j] = _mm512_reduce_add_ps(s0);                                                                         \
        }                                                                                                            \
    }                                                                                                                \
    static void expand_row_##SUFFIX(const WTYPE *bt, const float *y, int64_t rank, int64_t w, float scale,          \
                                    float *out) {                                                                    \
        for (int64_t n = 0; n < w; n += 64) {                                                                        \
            __m512 acc[4];                                                                                           \
            for (int q = 0; q < 4; ++q)                                                                              \
                acc[q] = ld_f32(out + n + 16 * q, w - n - 16 * q);                                                   \
            for (int64_t j = 0; j < rank; ++j) {                                                                     \
                const __m512 f = _mm512_set1_ps(scale * y[j]);                                                       \
                const WTYPE *row = bt + j * w + n;                                                                   \
                for (int q = 0; q < 4; ++q)                                                                          \
                    acc[q] = _mm512_fmadd_ps(f, LD(row + 16 * q, w - n - 16 * q), acc[q]);                           \
            }                                                                                                        \
            for (int q = 0; q < 4; ++q) {                                                                            \
                const int64_t left = w - n - 16 * q;                                                                 \
                if (left > 0)                                                                                        \
                    _mm512_mask_storeu_ps(out + n + 16 * q, tail_mask(left), acc[q]);                                \
            }                                                                                                        \
        }                                                                                                            \
    }                                                                                                                \
    int NAME(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, const int32_t *slots,              \
             const WTYPE *a, int64_t total_rank, int64_t in, int64_t n_slices, const WTYPE *const *bt,               \
             const int64_t *widths, const int64_t *ranks, const float *scales, int64_t n_slots, int threads) {       \
        if (total_rank > 4096)                                                                                       \
            return -1;                                                                                               \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)")              \
        for (int64_t t = 0; t < rows; ++t) {                                                                         \
            const int64_t s = slots[t];                                                                              \
            if (s < 0)                                                                                               \
                continue;                                                                                            \
            float y[total_rank];                                                                                     \
            shrink_row_##SUFFIX(a + s * total_rank * in, x + t * ldx, total_rank, in, y);                            \
            int64_t col = 0, block = 0;                                                                              \
            for (int64_t i = 0; i < n_slices; ++i) {                                                                 \
                expand_row_##SUFFIX(bt[i] + s * ranks[i] * widths[i], y + block, ranks[i], widths[i],                \
                                    scales[i * n_slots + s], out + t * ldo + col);                                   \
                col += widths[i];                                                                                    \
                block += ranks[i];                                                                                   \
            }                                                                                                        \
        }                                                                                                            \
        return 0;                                                                                                    \
    }
LORA_FNS(f32, lf_lora_rows, float, ld_f32)
LORA_FNS(bf16, lf_lora_rows_bf16, uint16_t, ld_bf16)
LORA_FNS(f16, lf_lora_rows_f16, uint16_t, ld_f16)
