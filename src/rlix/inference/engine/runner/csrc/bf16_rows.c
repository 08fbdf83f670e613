/* bf16 matmuls for the decoder's few rows, on AVX2 + FMA, accumulating in fp32.
 *
 * Why: a decode step reads every weight once for a handful of rows, so its matmuls are bound by
 * memory reads. On CPUs without AVX-512, torch's bf16 matmul has no fast path (it ran at a third
 * of the read rate at 8 rows on an AVX2 host) and oneDNN refuses to reorder bf16 weights. Here a
 * 256-bit load of 16 bf16 weights becomes two fp32 vectors with one shift and one and (the even
 * and the odd elements); the rows of x are split the same way once per call, so the dot products
 * need no shuffles. Weight rows are split over the calling thread's OpenMP team (torch's, whose
 * libgomp this library shares). Results are rounded to bf16 where torch would round them (after
 * the matmul, after a bias or residual add, after SiLU), so they match torch within a bf16 ulp
 * of the fp32 sums' order.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_BLOCK 4   /* weight rows per block: their loads are shared by the rows of x */
#define STACK_FLOATS 32768
#define MAX_ROWS 32   /* rows of x per pass over the weights */

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

static inline float bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* x rows as fp32, each 16-element chunk as its 8 even elements then its 8 odd ones */
static void split_rows(const uint16_t *x, int rows, int k, float *out) {
  for (int m = 0; m < rows; m++) {
    const uint16_t *src = x + (size_t)m * k;
    float *dst = out + (size_t)m * k;
    for (int c = 0; c < k; c += 16)
      for (int i = 0; i < 8; i++) {
        dst[c + i] = bf16_to_float(src[c + 2 * i]);
        dst[c + 8 + i] = bf16_to_float(src[c + 2 * i + 1]);
      }
  }
}

/* The even and the odd elements of 16 bf16 weights as fp32 */
#define EVEN(v) _mm256_castsi256_ps(_mm256_slli_epi32((v), 16))
#define ODD(v) _mm256_castsi256_ps(_mm256_and_si256((v), high))

/* out[m * stride + r] = dot(x row m, weight row r) for MR rows of x and NR weight rows. Each
 * weight vector is converted and used at once, so that the accumulators, x and one weight
 * vector fit the 16 AVX2 registers (MR * NR <= 8). */
#define DOTS(MR, NR)                                                                              \
  static void dots_##MR##x##NR(const float *xs, int k, const uint16_t *const *w, float *out,    \
                               int stride) {                                                     \
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);                                   \
    __m256 acc[MR][NR];                                                                          \
    for (int m = 0; m < MR; m++)                                                                 \
      for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();                              \
    for (int c = 0; c < k; c += 16) {                                                            \
      for (int r = 0; r < NR; r++) {                                                             \
        __m256i v = _mm256_loadu_si256((const __m256i *)(w[r] + c));                           \
        __m256 even = EVEN(v);                                                                   \
        for (int m = 0; m < MR; m++)                                                             \
          acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + (size_t)m * k + c), even, acc[m][r]); \
        __m256 odd = ODD(v);                                                                     \
        for (int m = 0; m < MR; m++)                                                             \
          acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + (size_t)m * k + c + 8), odd, acc[m][r]); \
      }                                                                                          \
    }                                                                                            \
    for (int m = 0; m < MR; m++)                                                                 \
      for (int r = 0; r < NR; r++) out[m * stride + r] = hsum(acc[m][r]);                        \
  }
DOTS(1, 4)
DOTS(2, 4)
DOTS(4, 2)
DOTS(1, 1)

/* out[m * nr + r] for every row m of x against nr (<= ROW_BLOCK) weight rows */
static void block_dots(const float *xs, int rows, int k, const uint16_t *const *w, int nr,
                       float *out) {
  int m = 0;
  if (nr == ROW_BLOCK) {
    for (; m + 4 <= rows; m += 4) {
      dots_4x2(xs + (size_t)m * k, k, w, out + m * nr, nr);
      dots_4x2(xs + (size_t)m * k, k, w + 2, out + m * nr + 2, nr);
    }
    for (; m + 2 <= rows; m += 2) dots_2x4(xs + (size_t)m * k, k, w, out + m * nr, nr);
    for (; m < rows; m++) dots_1x4(xs + (size_t)m * k, k, w, out + m * nr, nr);
    return;
  }
  for (; m < rows; m++)
    for (int r = 0; r < nr; r++) dots_1x1(xs + (size_t)m * k, k, w + r, out + m * nr + r, nr);
}

/* y = x @ w^T (+ bias) (+ residual) for rows <= MAX_ROWS rows of x, already split into xs */
static void linear_rows(const float *xs, const uint16_t *w, const uint16_t *bias,
                        const uint16_t *residual, uint16_t *y, int rows, int N, int K, int threads) {
  int blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int b = 0; b < blocks; b++) {
    int n0 = b * ROW_BLOCK, nr = N - n0 < ROW_BLOCK ? N - n0 : ROW_BLOCK;
    const uint16_t *w_rows[ROW_BLOCK];
    float out[MAX_ROWS * ROW_BLOCK];
    for (int r = 0; r < nr; r++) w_rows[r] = w + (size_t)(n0 + r) * K;
    block_dots(xs, rows, K, w_rows, nr, out);
    for (int m = 0; m < rows; m++)
      for (int r = 0; r < nr; r++) {
        float v = out[m * nr + r];
        if (bias) v = round_bf16(v) + bf16_to_float(bias[n0 + r]);
        if (residual) v = round_bf16(v) + bf16_to_float(residual[(size_t)m * N + n0 + r]);
        y[(size_t)m * N + n0 + r] = float_to_bf16(v);
      }
  }
}

/* act = silu(x @ gate^T) * (x @ up^T) for rows <= MAX_ROWS rows, already split into xs */
static void silu_gate_up_rows(const float *xs, const uint16_t *w, uint16_t *y, int rows, int I,
                              int K, int threads) {
  const int pairs = ROW_BLOCK / 2;
  int blocks = (I + pairs - 1) / pairs;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int b = 0; b < blocks; b++) {
    int j0 = b * pairs, nj = I - j0 < pairs ? I - j0 : pairs;
    const uint16_t *w_rows[ROW_BLOCK];
    float out[MAX_ROWS * ROW_BLOCK];
    for (int r = 0; r < nj; r++) {
      w_rows[2 * r] = w + (size_t)(j0 + r) * K;
      w_rows[2 * r + 1] = w + (size_t)(I + j0 + r) * K;
    }
    block_dots(xs, rows, K, w_rows, 2 * nj, out);
    for (int m = 0; m < rows; m++)
      for (int r = 0; r < nj; r++) {
        float gate = round_bf16(out[m * 2 * nj + 2 * r]);
        float up = round_bf16(out[m * 2 * nj + 2 * r + 1]);
        y[(size_t)m * I + j0 + r] = float_to_bf16(round_bf16(gate / (1.0f + expf(-gate))) * up);
      }
  }
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) (+ residual[M, N]); bf16, contiguous, K % 16 == 0.
 * Rows go MAX_ROWS at a time (each chunk one pass over the weights). Returns 0, or -1 when the
 * buffer for x could not be allocated. */
int rlix_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                     const uint16_t *residual, uint16_t *y, int M, int N, int K, int threads) {
  float stack[STACK_FLOATS];
  int chunk = M < MAX_ROWS ? M : MAX_ROWS;
  float *xs = (size_t)chunk * K <= STACK_FLOATS ? stack : malloc(sizeof(float) * (size_t)chunk * K);
  if (!xs) return -1;
  for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
    int rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
    split_rows(x + (size_t)m0 * K, rows, K, xs);
    linear_rows(xs, w, bias, residual ? residual + (size_t)m0 * N : NULL, y + (size_t)m0 * N, rows,
                N, K, threads);
  }
  if (xs != stack) free(xs);
  return 0;
}

/* y[M, I] = silu(x @ w[0:I]^T) * (x @ w[I:2I]^T): the MLP's gate and up halves of one fused
 * weight [2I, K], each gate row read beside its up row. Same conditions as rlix_linear_bf16. */
int rlix_silu_gate_up_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int I, int K,
                           int threads) {
  float stack[STACK_FLOATS];
  int chunk = M < MAX_ROWS ? M : MAX_ROWS;
  float *xs = (size_t)chunk * K <= STACK_FLOATS ? stack : malloc(sizeof(float) * (size_t)chunk * K);
  if (!xs) return -1;
  for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
    int rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
    split_rows(x + (size_t)m0 * K, rows, K, xs);
    silu_gate_up_rows(xs, w, y + (size_t)m0 * I, rows, I, K, threads);
  }
  if (xs != stack) free(xs);
  return 0;
}
