/* The weights the tiles cannot read as they multiply (FP8, Q4, Q8) made float32, a block of a panel at a
   time, and the store every path ends with: a panel's sums times the scale per output, plus the bias,
   into y.

   Built into every library with the linear layers (native_linear.SOURCES); linear_panel.h has the layout. */
#include <stdlib.h>

#include "linear_panel.h"

/* Rows k0 .. k0 + kn - 1 of panel `panel` of a weight the tiles do not read as they multiply (FP8, Q4, Q8),
   as float32 [kn, PANEL] in dq: w = q * scale (FP8, per output) or w = s * q - o (Q4, Q8: s, o per output and
   group of lw->group rows), each weight rounded once, as the reference dequantises it. */
void linear_dequantize(const LinearWeight *lw, const int K, const int panel, const int k0, const int kn,
                       float *dq) {
    const size_t rb = row_bytes(lw->elem);
    const uint8_t *w = (const uint8_t *)lw->w + ((size_t)panel * K + k0) * rb;
    if (lw->elem == FP8) {
        for (int k = 0; k < kn; k++)
            for (int j = 0; j < PANEL_VECS; j++)
                *(vf *)(dq + (size_t)k * PANEL + j * VL) = load_fp8(w + (size_t)k * rb + j * VL);
        return;
    }
    for (int k = 0; k < kn;) {
        /* the rows of this block in one group share its s and o: loaded once */
        const int end = group_end(lw, k0, k, kn);
        const char *gp = group_at(lw, K, panel, (k0 + k) / lw->group);
        vf s[PANEL_VECS], o[PANEL_VECS];
        for (int j = 0; j < PANEL_VECS; j++) {
            s[j] = group_vec(lw, gp, j);
            o[j] = group_vec(lw, gp, PANEL_VECS + j);
        }
        for (; k < end; k++) {
            const uint8_t *row = w + (size_t)k * rb;
            float *out = dq + (size_t)k * PANEL;
            if (lw->elem == Q4) {
                /* one widened load gives a vector of the low half's columns and one of the high half's */
                for (int j = 0; j < PANEL_VECS / 2; j++) {
                    const vu32 b = widen_u8(row + j * VL);
                    const int hi = j + PANEL_VECS / 2;
                    *(vf *)(out + j * VL) = s[j] * u32_to_f32(b & 0xF) - o[j];
                    *(vf *)(out + hi * VL) = s[hi] * u32_to_f32(b >> 4) - o[hi];
                }
            } else {
                for (int j = 0; j < PANEL_VECS; j++)
                    *(vf *)(out + j * VL) = s[j] * load_w((const char *)row + j * VL, I8) - o[j];
            }
        }
    }
}

/* The output of one panel's totals (M rows of PANEL floats): times the column scale, plus the bias, into y
   (or added to it). */
void linear_store_panel(const float *tot, const LinearWeight *lw, float *y, const int M, const int N,
                        const int n0, const int accumulate) {
    const int cols = N - n0 < PANEL ? N - n0 : PANEL;
    const float *scale = lw->scale ? lw->scale + n0 : NULL, *bias = lw->bias ? lw->bias + n0 : NULL;
    for (int m = 0; m < M; m++) {
        float *out = y + (size_t)m * N + n0;
        const float *t = tot + (size_t)m * PANEL;
        if (cols == PANEL) {
            for (int j = 0; j < PANEL_VECS; j++) {
                vf v = *(const vf *)(t + j * VL);
                if (scale) v *= *(const vf *)(scale + j * VL);
                if (bias) v += *(const vf *)(bias + j * VL);
                if (accumulate) v += *(const vf *)(out + j * VL); /* a residual, added as torch's `h + y` */
                *(vf *)(out + j * VL) = v;
            }
        } else {
            for (int c = 0; c < cols; c++) {
                float s = t[c];
                if (scale) s *= scale[c];
                if (bias) s += bias[c];
                out[c] = accumulate ? out[c] + s : s;
            }
        }
    }
}

void batchq_linear_store_panel(const float *tot, const LinearWeight *lw, float *y, int M, int N, int n0,
                               int accumulate) {
    linear_store_panel(tot, lw, y, M, N, n0, accumulate);
}
