/* Multi-LoRA on a CPU: every row's adapter delta added to a linear layer's output in one call over the step's
 * rows (BGMV, as Punica's GPU kernels): y[t] += Bt[slot_t]^T (A[slot_t] x[t]) for each row t whose slot is
 * not -1.
 *
 * A row is one iteration of the parallel loop and its sums run in an order fixed by the shapes alone: the
 * shrink's dot products over `in` accumulate LANES partial sums (element k into lane k % LANES), folded in
 * one fixed order; the expand adds each rank's term to the row's outputs in rank order. So a row's result
 * never depends on the step's other rows (how many, which adapters), nor on the thread that ran it.
 *
 * float32 throughout: x [t, in], a [slots, r, in] (each adapter's A, its ranks zero-padded to r), bt
 * [slots, r, out] (each adapter's B transposed, its scaling folded in), slots [t] int32, y [t, out]. The
 * row's delta is summed in float32 and added to y once, as PEFT's unmerged layer adds it.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_RANK 4096

static float dot(const float *restrict a, const float *restrict x, int n)
{
    float lane[LANES] = {0};
    int k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; l++)
            lane[l] += a[k + l] * x[k + l];
    for (int l = 0; k + l < n; l++)
        lane[l] += a[k + l] * x[k + l];
    /* a fixed tree: 16 -> 8 -> 4 -> 2 -> 1 */
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            lane[l] += lane[l + w];
    return lane[0];
}

/* -> 0; -1 where a slot lies outside [-1, n_slots) or r is out of range, -2 where memory runs out (nothing
 * is written then). */
int batchq_lora(const float *x, int t, int in, int out, int r, const float *a, const float *bt,
                const int32_t *slots, int n_slots, float *y, int threads)
{
    if (r < 1 || r > MAX_RANK || threads < 1)
        return -1;
    for (int i = 0; i < t; i++)
        if (slots[i] < -1 || slots[i] >= n_slots)
            return -1;
    float *deltas = malloc(sizeof(float) * (size_t)out * (size_t)threads); /* one row's delta per thread */
    if (deltas == NULL)
        return -2;
#pragma omp parallel num_threads(threads)
    {
        float *delta = deltas + (size_t)out * (size_t)omp_get_thread_num();
        float shrunk[MAX_RANK];
#pragma omp for schedule(static)
        for (int i = 0; i < t; i++) {
            int s = slots[i];
            if (s < 0)
                continue;
            const float *xi = x + (size_t)i * in;
            const float *as = a + (size_t)s * r * in;
            const float *bs = bt + (size_t)s * r * out;
            for (int j = 0; j < r; j++)
                shrunk[j] = dot(as + (size_t)j * in, xi, in);
            memset(delta, 0, sizeof(float) * (size_t)out);
            for (int j = 0; j < r; j++) {
                const float sj = shrunk[j];
                const float *row = bs + (size_t)j * out;
                if (sj != 0.0f)
                    for (int o = 0; o < out; o++)
                        delta[o] += sj * row[o];
            }
            float *yi = y + (size_t)i * out;
            for (int o = 0; o < out; o++)
                yi[o] += delta[o];
        }
    }
    free(deltas);
    return 0;
}
