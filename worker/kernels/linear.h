/* linear.c's weight description, shared with decode_stack.c. */
#ifndef BATCHQ_LINEAR_H
#define BATCHQ_LINEAR_H

/* The weight's element type (native_linear.WEIGHT_TYPES). F32, BF16, I8 and FP8 are w itself (I8 and FP8
   times a float32 scale per output); Q4 (unsigned 4-bit) and Q8 (signed 8-bit) are quantised in groups of
   `group` rows of K, each output's weight w = s * q - o with s, o per group and output. */
enum { F32 = 0, BF16 = 1, I8 = 2, FP8 = 3, Q4 = 4, Q8 = 5 };
enum { F16 = 1 }; /* group_elem: the groups' float type, F32 or F16 */

typedef struct {
    const void *w;       /* packed panels [ceil(N / PANEL), K, PANEL] of elem (Q4: PANEL / 2 bytes a row) */
    const float *scale;  /* [N]: I8 and FP8 weights, else NULL */
    const void *groups;  /* Q4, Q8: [ceil(N / PANEL), K / group, 2, PANEL] of group_elem, s then o; else NULL */
    const float *bias;   /* [N] or NULL */
    int elem;
    int group;           /* K rows per group (Q4, Q8) */
    int group_elem;
} LinearWeight;

#endif
