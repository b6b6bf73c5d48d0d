/* Paired A/B of linear.c builds: one step's linears of SmolLM2-135M (30 layers + the LM head, every layer's
   weights its own copy, ~540 MB of float32, so they stream from memory as in the model), timed with
   each build in turn, round after round, in one process. On a host whose cores other work shares, a
   figure from one run and one from another minutes later differ by more than most changes do; builds
   alternating within each round meet the same moments, and the medians compare.

   Build it, and two or more builds of the linear layers to compare (a git revision's, or one with -D
   overrides), each from linear.c and the files beside it (native_linear.SOURCES: linear*.c):

     cc -O2 benchmarks/linear_ab.c -o /tmp/linear_ab -ldl
     F="-O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math -ffp-contract=fast -shared -fPIC"
     cc $F -Iworker/kernels worker/kernels/linear*.c -o /tmp/new.so -lm
     git worktree add /tmp/old HEAD~1 && cc $F -I/tmp/old/worker/kernels /tmp/old/worker/kernels/linear*.c \
       -o /tmp/old.so -lm
     /tmp/linear_ab 15 16 /tmp/old.so /tmp/new.so                 # 15 rounds, 16 rows (a decode step)
     /tmp/linear_ab 5 2048 /tmp/old.so /tmp/new.so                 # a prompt step: the LM head takes 64
     /tmp/linear_ab 15 16 /tmp/new.so:1:0:0:0 /tmp/new.so:1:1:0:0  # a build under two tunings: t0:far:wide:pace

   A build's tuning (default 1:0:0:0) is linear.h's LinearTuning: the prefetch hint (1: prefetcht0), far
   prefetch, whole-panel rows and paced rows, passed to every call (a build from before the LinearTuning
   takes them through its batchq_linear_set_* setters, one set per library: copy its .so to compare
   settings of one such build).
   Float32 weights, or with BATCHQ_AB_WEIGHT=q4 the default engine's: 4-bit in groups of 32 rows with float16
   scales and offsets (~150 MB, Q4_1's layout as gguf_weights.py keeps it); BATCHQ_AB_COPIES=c reuses c
   layers' weights (1: they stay in cache); 2 threads; prints the min and median ms of each build. Anything
   else in an argument or a setting is refused by name. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../worker/kernels/linear.h"

typedef int (*linear_fn)(const float *, const LinearWeight *, float *, int, int, int, int, const LinearTuning *);
typedef int (*setter_fn)(int);

#define LAYERS 30
#define LINEARS (4 * LAYERS + 1)
#define MAX_BUILDS 8
#define HEAD_ROWS 64

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* s as a whole decimal number in lo..hi into *out; 0 (nothing written) otherwise, trailing text included. */
static int whole_number(const char *s, long lo, long hi, long *out) {
    char *end;
    const long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

/* A build from before the LinearTuning: its settings through its setters (it ignores the tuning passed). */
static void set(void *lib, const char *name, int value) {
    const setter_fn f = (setter_fn)dlsym(lib, name);
    if (f) f(value);
}

int main(int argc, char **argv) {
    if (argc < 4 || argc - 3 > MAX_BUILDS) {
        fprintf(stderr, "usage: %s rounds rows lib.so[:t0:far:wide:pace] ... (at most %d builds)\n", argv[0],
                MAX_BUILDS);
        return 2;
    }
    long rounds_l, rows_l;
    if (!whole_number(argv[1], 1, 1000000, &rounds_l) || !whole_number(argv[2], 1, 8192, &rows_l)) {
        fprintf(stderr, "rounds %s, rows %s: expected rounds >= 1 and rows 1..8192\n", argv[1], argv[2]);
        return 2;
    }
    const int rounds = (int)rounds_l, rows = (int)rows_l, builds = argc - 3;
    /* SmolLM2-135M: qkv, o, gate_up, down (K x N) per layer, and the tied LM head */
    static const int shapes[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};
    const char *weight = getenv("BATCHQ_AB_WEIGHT");
    if (weight && strcmp(weight, "q4") && strcmp(weight, "float32")) {
        fprintf(stderr, "BATCHQ_AB_WEIGHT=%s: expected float32 (the default) or q4\n", weight);
        return 2;
    }
    const int q4 = weight && !strcmp(weight, "q4");
    /* BATCHQ_AB_COPIES=c: only c distinct layers' weights (layer i uses copy i % c), the LM head too is a
       qkv-sized copy: with c = 1 the step's weights stay in the caches and the FMA side is timed alone */
    const char *copies_env = getenv("BATCHQ_AB_COPIES");
    long copies_l = 0;
    if (copies_env && !whole_number(copies_env, 1, LAYERS - 1, &copies_l)) {
        fprintf(stderr, "BATCHQ_AB_COPIES=%s: expected a number of layer copies from 1 to %d\n", copies_env,
                LAYERS - 1);
        return 2;
    }
    const int copies = (int)copies_l;
    int ks[LINEARS], ns[LINEARS];
    LinearWeight ws[LINEARS];
    for (int i = 0; i < LINEARS; i++) {
        ks[i] = i < 4 * LAYERS ? shapes[i % 4][0] : 576;
        ns[i] = i < 4 * LAYERS ? shapes[i % 4][1] : copies ? 960 : 49152;
        if (copies && i >= 4 * copies) {
            ws[i] = ws[i < 4 * LAYERS ? i % (4 * copies) : 0];
            continue;
        }
        const size_t n = (size_t)((ns[i] + 31) / 32) * 32 * (size_t)ks[i]; /* packed panels of 32 */
        memset(&ws[i], 0, sizeof ws[i]);
        if (q4) {
            uint8_t *w = aligned_alloc(64, n / 2);
            _Float16 *g = aligned_alloc(64, n / 32 * 2 * sizeof(_Float16)); /* s and o per 32 rows and column */
            if (!w || !g) return 1;
            for (size_t j = 0; j < n / 2; j++) w[j] = (uint8_t)((j * 2654435761u) >> 13);
            for (size_t j = 0; j < n / 32 * 2; j++) g[j] = (_Float16)((float)((j * 40503u) % 1000) / 8e4f);
            ws[i] = (LinearWeight){w, NULL, g, NULL, Q4, 32, F16};
        } else {
            float *w = aligned_alloc(64, n * sizeof(float));
            if (!w) return 1;
            for (size_t j = 0; j < n; j++) w[j] = (float)((j * 2654435761u) % 1000) / 1000.0f - 0.5f;
            ws[i] = (LinearWeight){w, NULL, NULL, NULL, F32, 0, F32};
        }
    }
    float *x = aligned_alloc(64, (size_t)rows * 1536 * sizeof(float));
    /* a prompt-sized step's LM head takes a few rows (each sequence's last): at most HEAD_ROWS here */
    const int head_rows = rows < HEAD_ROWS ? rows : HEAD_ROWS;
    float *y = aligned_alloc(64, (size_t)(rows * 3072 > head_rows * 49152 ? rows * 3072 : head_rows * 49152) *
                                     sizeof(float));
    if (!x || !y) return 1;
    for (int i = 0; i < rows * 1536; i++) x[i] = (float)(i % 97) / 97.0f;

    linear_fn fns[MAX_BUILDS];
    LinearTuning tunings[MAX_BUILDS];
    for (int b = 0; b < builds; b++) {
        char *spec = argv[3 + b], *colon = strchr(spec, ':');
        int t0 = 1, far = 0, wide = 0, pace = 0;
        if (colon) {
            *colon = '\0';
            int used = -1;
            if (sscanf(colon + 1, "%d:%d:%d:%d%n", &t0, &far, &wide, &pace, &used) != 4 ||
                colon[1 + used] != '\0') {
                fprintf(stderr, "%s:%s: expected lib.so:t0:far:wide:pace, four whole numbers\n", spec, colon + 1);
                return 2;
            }
        }
        void *lib = dlopen(spec, RTLD_NOW | RTLD_LOCAL);
        if (!lib || !(fns[b] = (linear_fn)dlsym(lib, "batchq_linear_w"))) {
            fprintf(stderr, "%s: %s\n", spec, dlerror());
            return 1;
        }
        set(lib, "batchq_linear_set_prefetch_t0", t0);
        set(lib, "batchq_linear_set_far_prefetch", far);
        set(lib, "batchq_linear_set_wide_rows", wide);
        set(lib, "batchq_linear_set_pace_rows", pace);
        tunings[b] = (LinearTuning){t0, far, wide, pace};
        printf("build %d: %s (t0 %d, far %d, wide %d, pace %d)\n", b, spec, t0, far, wide, pace);
    }
    double *ms = malloc(sizeof(double) * (size_t)rounds * (size_t)builds);
    if (!ms) return 1;
    for (int b = 0; b < builds; b++) /* a round untimed: page faults, the thread pool's start */
        for (int i = 0; i < LINEARS; i++)
            fns[b](x, &ws[i], y, i < 4 * LAYERS ? rows : head_rows, ks[i], ns[i], 2, &tunings[b]);
    for (int r = 0; r < rounds; r++)
        for (int b = 0; b < builds; b++) {
            const double t = now();
            for (int i = 0; i < LINEARS; i++)
                fns[b](x, &ws[i], y, i < 4 * LAYERS ? rows : head_rows, ks[i], ns[i], 2, &tunings[b]);
            ms[(size_t)b * rounds + r] = (now() - t) * 1e3;
        }
    double flops = 0;
    for (int i = 0; i < LINEARS; i++) flops += 2.0 * (i < 4 * LAYERS ? rows : head_rows) * ks[i] * ns[i];
    printf("%d rows (the LM head %d), %d rounds: one step's %s linears, ms\n", rows, head_rows, rounds,
           q4 ? "Q4" : "float32");
    for (int b = 0; b < builds; b++) {
        double *v = ms + (size_t)b * rounds;
        qsort(v, (size_t)rounds, sizeof(double), by_value);
        printf("build %d: median %.1f  min %.1f  (%.0f GFLOP/s at the median)\n", b, v[rounds / 2], v[0],
               flops / v[rounds / 2] * 1e-6);
    }
    return 0;
}
