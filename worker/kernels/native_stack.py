"""The whole CPU decode step in C (decode_stack.c, linked with linear.c and paged_decode.c): every layer's
norms, QKV, rotary, cache write, attention, o, MLP and residuals in one call and one OpenMP region.

At decode sizes the layer-by-layer path spends more time between its kernels (torch ops, ctypes calls,
OpenMP fork/joins) than in them; the stack runs the same kernels without the ops between them. The
backend (worker/kernels/backend.py) decides per step whether it applies.
"""

from __future__ import annotations

import ctypes
from ctypes import c_int, c_long, c_void_p
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from worker.kernels import native_attention, native_linear
from worker.kernels.linear_methods import Groups
from worker.kernels.native_attention import ELEMENT_TYPES, MAX_D, MAX_G
from worker.kernels.native_build import KERNELS, Signature, cached, load
from worker.kernels.native_linear import (
    DEFAULT_TUNING,
    FP8,
    GROUP_TYPES,
    PANEL,
    Q4,
    Q8,
    WEIGHT_TYPES,
    LinearTuning,
    LinearWeightStruct,
    is_packed,
)

# decode_stack.c calls into the other two: the three are linked into one library
SOURCES = (KERNELS / "decode_stack.c", *native_linear.SOURCES, *native_attention.SOURCES)
SIGNATURES = {
    "batchq_decode_stack": Signature(
        c_int, [c_void_p] * 4 + [c_int] + [c_void_p] * 7 + [c_int] * 2 + [c_void_p, c_int, c_void_p]
    ),
    "batchq_decode_stack_workspace": Signature(c_long, [c_void_p] + [c_int] * 3),
    "batchq_to_fp8": Signature(None, [c_void_p, c_void_p, c_long]),  # its FP8 rounding, for the tests
}


@cached
def library() -> SimpleNamespace | None:
    """The loaded decode stack, or None (with one warning) where it cannot be built."""
    return load(SOURCES, "the decode stack", SIGNATURES)


# decode_stack.c's structs, field for field (a layer's linears are linear.h's LinearWeight)
class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", LinearWeightStruct),
        ("o", LinearWeightStruct),
        ("gate_up", LinearWeightStruct),
        ("down", LinearWeightStruct),
        *((name, ctypes.c_void_p) for name in ("ln1", "ln2", "q_norm", "k_norm", "k_cache", "v_cache")),
        *((name, ctypes.c_float) for name in ("q_scale", "k_scale", "v_scale")),
        ("window", ctypes.c_int),
        ("softcap", ctypes.c_float),
        ("post_attn", ctypes.c_void_p),
        ("post_ff", ctypes.c_void_p),
        ("act", ctypes.c_int),
        ("local_rope", ctypes.c_int),
    ]


ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}  # decode_stack.c's ACT_*


class _Spec(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_int)
            for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter")
        ),
        ("eps", ctypes.c_float),
        *((name, ctypes.c_int) for name in ("kv_elem", "num_blocks", "block_size")),
        ("final_norm", ctypes.c_void_p),
    ]


STRUCTS = {
    "LinearWeight": LinearWeightStruct,
    "LinearTuning": LinearTuning,
    "Layer": _Layer,
    "Spec": _Spec,
}  # by their C names (the signature test reads them)

STACK_CACHE_TYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)  # decode_stack.c writes these


@dataclass
class StackLinear:
    weight: Tensor  # packed [out, in] (pack); q of a group-quantised weight (pack_q4, pack)
    scale: Tensor | None  # [out] float32, int8 and FP8 weights only
    bias: Tensor | None  # [out] float32
    groups: Groups | None = None  # a group-quantised weight's (s, o) table (pack_groups) and shape

    def struct(self, bf16_dot: bool = False) -> LinearWeightStruct:
        """linear.h's LinearWeight of this weight (its tensors must outlive the struct). bf16_dot: a
        weight multiplied in bfloat16 (linear_bf16dot.c)."""

        def opt(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        if self.groups is not None:
            elem, table = (Q4 if self.groups.bits == 4 else Q8), self.groups.table
            return LinearWeightStruct(self.weight.data_ptr(), None, table.data_ptr(), opt(self.bias), elem,
                                      self.groups.group, GROUP_TYPES[table.dtype], int(bf16_dot))  # fmt: skip
        elem = FP8 if self.weight.dtype == torch.float8_e4m3fn else WEIGHT_TYPES[self.weight.dtype]
        # float32 weights keep float32 products (a bfloat16 engine's weights are bfloat16 or quantised)
        dot = bf16_dot and self.weight.dtype != torch.float32
        return LinearWeightStruct(
            self.weight.data_ptr(), opt(self.scale), None, opt(self.bias), elem, 0, 0, int(dot)
        )

    def packed_as(self, n: int, k: int) -> bool:
        """Whether this is an [n, k] weight in linear.c's layout, with what its element type needs."""
        w, g = self.weight, self.groups
        panels = -(-n // PANEL)
        if g is not None:
            q_shape = (panels, k, PANEL // 2 if g.bits == 4 else PANEL)
            table_ok = g.table.shape == (panels, k // g.group, 2, PANEL) and g.table.dtype in GROUP_TYPES
            return (w.shape == q_shape and w.is_contiguous() and self.scale is None and table_ok
                    and g.table.is_contiguous() and k % g.group == 0)  # fmt: skip
        if w.dtype == torch.float8_e4m3fn:
            return w.shape == (panels, k, PANEL) and w.is_contiguous() and self.scale is not None
        return is_packed(w, n, k) and (self.scale is not None) == (w.dtype == torch.int8)


@dataclass
class StackLayer:
    qkv: StackLinear  # q, k, v stacked as rows
    o: StackLinear
    gate_up: StackLinear  # gate rows, then up rows
    down: StackLinear
    input_norm: Tensor  # [hidden] float32: what the rows are multiplied by (Gemma's 1 + w)
    post_attention_norm: Tensor  # before the MLP (Gemma's pre_feedforward_layernorm)
    q_norm: Tensor | None  # [head_dim] (Qwen3)
    k_norm: Tensor | None
    k_cache: Tensor  # [kv_heads, num_blocks, block_size, head_dim]: float32, bfloat16 or FP8 E4M3
    v_cache: Tensor
    q_scale: float  # what q is multiplied by: the softmax scale times k_scale (llama.py's Attention's)
    k_scale: float = 1.0  # the cache holds K / k_scale, V / v_scale (FP8's calibrated scales)
    v_scale: float = 1.0
    window: int | None = None  # the layer's sliding window (reference.py's)
    softcap: float | None = None  # its attention-logit soft-capping
    attention_out_norm: Tensor | None = None  # Gemma: attention's output normed before the residual add
    mlp_out_norm: Tensor | None = None  # and the MLP's
    activation: str = "silu"  # ACTIVATIONS
    local_rope: bool = False  # rotated by the local table (Gemma 3's sliding layers)


class DecodeStack:
    """Every layer of a decode step in one call of decode_stack.c: pointers to the weights, norms and caches
    are gathered once; the call passes the step's rows and metadata, and linear.c's tuning (the backend's).
    Check `stack_supported` first."""

    def __init__(
        self,
        layers: list[StackLayer],
        final_norm: Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        bf16_dot: bool = False,
        tuning: LinearTuning = DEFAULT_TUNING,
    ) -> None:
        lib = library()
        assert lib is not None
        self._lib = lib
        self._tuning = tuning
        self._keep = (layers, final_norm)  # the pointers below stay valid while these live
        self.needs_local = any(x.local_rope for x in layers)
        first = layers[0]
        _, nb, bs, _ = first.k_cache.shape
        self.hidden = first.input_norm.shape[0]
        self.spec = _Spec(
            len(layers), self.hidden, heads, kv_heads, head_dim, first.down.weight.shape[1], eps,
            ELEMENT_TYPES[first.k_cache.dtype], nb, bs, final_norm.data_ptr(),
        )  # fmt: skip

        def opt(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        def lin(x: StackLinear) -> LinearWeightStruct:
            return x.struct(bf16_dot)

        self.layers = (_Layer * len(layers))(
            *(
                _Layer(
                    lin(x.qkv),
                    lin(x.o),
                    lin(x.gate_up),
                    lin(x.down),
                    x.input_norm.data_ptr(),
                    x.post_attention_norm.data_ptr(),
                    opt(x.q_norm),
                    opt(x.k_norm),
                    x.k_cache.data_ptr(),
                    x.v_cache.data_ptr(),
                    x.q_scale,
                    x.k_scale,
                    x.v_scale,
                    x.window or 0,
                    x.softcap or 0.0,
                    opt(x.attention_out_norm),
                    opt(x.mlp_out_norm),
                    ACTIVATIONS[x.activation],
                    int(x.local_rope),
                )
                for x in layers
            )
        )
        self._workspace = torch.empty(0, dtype=torch.float32)

    def __call__(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        slots: Tensor,
        block_tables: Tensor,
        context_lens: Tensor,
        local: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """h: [M, hidden] float32, the embedded tokens (updated in place: the residual stream); cos, sin:
        [M, head_dim]; slots: [M] int64; block_tables: [M, W] int32; context_lens: [M] int32; local: the
        local table's cos, sin rows (layers with local_rope). -> [M, hidden]: the final norm of the last
        layer's output."""
        assert local is not None or not self.needs_local, "layers with local_rope need the local table's rows"
        m = h.shape[0]
        threads = torch.get_num_threads()
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        slots = slots.to(torch.int64).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        cos_l, sin_l = (None, None) if local is None else (local[0].contiguous(), local[1].contiguous())
        max_len = max(int(lens.max()), 1) if m else 1
        need = self._lib.batchq_decode_stack_workspace(ctypes.byref(self.spec), m, max_len, threads)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(max(need, 2 * self._workspace.numel()), dtype=torch.float32)
        out = torch.empty(m, self.hidden, dtype=torch.float32)
        rc = self._lib.batchq_decode_stack(
            ctypes.byref(self.spec), self.layers, h.data_ptr(), out.data_ptr(), m, cos.data_ptr(),
            sin.data_ptr(), None if cos_l is None else cos_l.data_ptr(),
            None if sin_l is None else sin_l.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            tables.shape[1], max_len, self._workspace.data_ptr(), threads, ctypes.byref(self._tuning),
        )  # fmt: skip
        assert rc == 0
        return out


def stack_supported(layers: list[StackLayer], heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether decode_stack.c takes these layers: every linear packed for linear.c in the shape the heads
    imply, float32 norms, scales and biases, one float32, bfloat16 or FP8 cache layout in the
    kv-head-major order, and paged_decode.c's head limits."""
    if library() is None or not layers:
        return False
    cache = layers[0].k_cache
    hidden, q_size = layers[0].input_norm.shape[0], heads * head_dim
    nqkv, inter = q_size + 2 * kv_heads * head_dim, layers[0].down.weight.shape[1]
    shapes = ((nqkv, hidden), (hidden, q_size), (2 * inter, hidden), (hidden, inter))

    def vector(t: Tensor | None, n: int) -> bool:  # absent, or n contiguous float32 values
        return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.shape == (n,))

    for x in layers:
        for lin, (n, k) in zip((x.qkv, x.o, x.gate_up, x.down), shapes, strict=True):
            if lin.weight.device.type != "cpu" or not lin.packed_as(n, k):
                return False
            if not (vector(lin.scale, n) and vector(lin.bias, n)):
                return False
        norms = (
            (x.input_norm, hidden),
            (x.post_attention_norm, hidden),
            (x.q_norm, head_dim),
            (x.k_norm, head_dim),
            (x.attention_out_norm, hidden),
            (x.mlp_out_norm, hidden),
        )
        if x.activation not in ACTIVATIONS:
            return False
        if not all(vector(t, n) for t, n in norms):
            return False
        caches = (x.k_cache, x.v_cache)
        if any(
            c.dtype not in STACK_CACHE_TYPES or not c.is_contiguous() or c.device.type != "cpu"
            for c in caches
        ):
            return False
        if any(c.shape != cache.shape or c.dtype != cache.dtype for c in caches):
            return False
    if cache.shape[0] != kv_heads or cache.shape[3] != head_dim:
        return False
    return head_dim % 16 == 0 and head_dim <= MAX_D and heads % kv_heads == 0 and heads // kv_heads <= MAX_G
