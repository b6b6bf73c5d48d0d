"""The platform: every kernel choice of one engine, made once at load (vLLM's platform and attention-backend
classes). `select_backend` builds a Backend from the engine's settings; the model is prepared for it once
(`LlamaFamilyModel.use_backend`) and receives it with every forward pass. Model code asks the Backend;
it reads no flag or environment variable of its own.

What a Backend decides:
- attention (`AttentionBackend`): the Triton kernels on CUDA where they import, else torch ops
  (torch_attention.TorchAttention), whose decode runs paged_decode.c on the CPU where the C kernels are on;
- each linear layer's method, and with it its weight's layout (linear_methods): linear.c over packed
  panels on a CPU under float32 compute with the C kernels on, F.linear on [out, in] elsewhere; linear.c's
  tuning for this machine (measured at load, platform.probes.kept_linear_tuning), which its linear and MoE methods
  and the decode stack pass to every call;
- RMSNorm and rotary rows in C (linear.c's) or in torch ops;
- a mixture-of-experts layer's experts (moe_methods): moe.c where linear.c runs, Triton's grouped GEMMs
  where Triton's attention does, else the torch reference;
- the bf16-GEMM row threshold: bfloat16 weights on a CPU whose bf16 GEMMs are fast take oneDNN's GEMM for
  steps of BF16_GEMM_ROWS rows or more (prompt chunks), linear.c for smaller ones (decode); never under
  batch_invariant (the default), where no kernel is chosen by a step's row count;
- per decode step, whether decode_stack.c runs it whole (`stack_applies`, `build_decode_stack`); a model
  whose structure decode_stack.c does not compute (OLMo 2's norms, a partial rotary factor) says so, and
  `for_model` keeps its decode steps layer by layer. A model that runs layers of its own (the transformers
  fallback) says so too, and `for_model` leaves it the attention kernels only.

Every attention backend takes reference.py's three functions' arguments, plus the cache layout it wants
(`kv_cache_shape`): a layer's sliding window, soft-capping and attention sinks among them (keywords `window`,
`softcap`, `sinks`; sinks only where a model has them),
which every backend computes and within which no kernel reads the blocks before a window. Prefill also
receives this step's new k/v; a backend may attend to them directly instead of reading them back from the
cache (torch does, the Triton kernel reads the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from worker.kernels import lora_ops, native_attention, native_linear, native_lora, native_stack
from worker.kernels.experts import ExpertActivation, Experts
from worker.kernels.linear_methods import (
    TORCH_LINEAR,
    Groups,
    LinearMethod,
    PackedLinear,
    TritonLinear,
    dequantized,
    dequantized_groups,
)
from worker.kernels.moe_methods import TORCH_MOE, MoEMethod, PackedMoE, TritonMoE
from worker.kernels.native_linear import DEFAULT_TUNING, LinearTuning
from worker.kernels.native_stack import DecodeStack, StackLayer, StackLinear
from worker.kernels.torch_attention import TorchAttention

# What model code uses of the kernels: it imports them from here, the one door (tests/test_architecture.py).
__all__ = [
    "TORCH_LINEAR",
    "TORCH_MOE",
    "Backend",
    "DecodeStack",
    "ExpertActivation",
    "Experts",
    "Groups",
    "LinearMethod",
    "MoEMethod",
    "StackLayer",
    "StackLinear",
    "dequantized",
    "dequantized_groups",
]

log = logging.getLogger(__name__)

# bfloat16 weights on a CPU whose bf16 GEMMs are fast: steps of at least this many rows (prompt chunks) take
# oneDNN's bf16 GEMM, smaller ones (decode) linear.c, which streams the weight once whatever the rows.
BF16_GEMM_ROWS = 64


def reference_kv_cache_shape(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (num_blocks, block_size, kv_heads, head_dim)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    kv_cache_shape: Callable[[int, int, int, int], tuple[int, ...]]  # (blocks, block_size, kv_heads, dim)
    write_kv: Callable[..., None]
    # (q, k_cache, v_cache, block_tables, context_lens, scale, window=, softcap=)
    paged_decode_attention: Callable[..., Tensor]
    # (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k=new_k, v=new_v, window=,
    # softcap=)
    paged_prefill_attention: Callable[..., Tensor]
    # (k_cache, block_tables, context_lens, widest window) -> whether this decode step's attention would be
    # the plain C kernel of paged_decode.c in every layer (the kernel decode_stack.c runs); None: never
    plain_native_decode: Callable[[Tensor, Tensor, Tensor, int | None], bool] | None = None


def torch_attention(c_decode: bool, invariant: bool = False) -> AttentionBackend:
    """Attention in torch ops (any device); c_decode: decode through paged_decode.c where it applies;
    invariant: no kernel choice follows the sequences beside one (TorchAttention's)."""
    attn = TorchAttention(native=c_decode, invariant=invariant)
    return AttentionBackend(
        "torch",
        attn.kv_cache_shape,
        attn.write_kv,
        attn.paged_decode_attention,
        attn.paged_prefill_attention,
        attn.plain_native_decode if c_decode else None,
    )


def _prefill_from_cache(mod: object) -> Callable[..., Tensor]:
    def prefill(
        *args: object,
        k: Tensor | None = None,
        v: Tensor | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        out: Tensor = mod.paged_prefill_attention(*args, window=window, softcap=softcap, sinks=sinks)  # type: ignore[attr-defined]
        return out

    return prefill


def triton_attention(invariant: bool = False) -> AttentionBackend:
    """Raises ImportError / AttributeError when the Triton kernels are missing or incomplete. invariant:
    decode splits a context into splits of a fixed size, by its own length only (never by the batch's)."""
    mod = importlib.import_module("worker.kernels.triton_attention")
    decode = mod.paged_decode_attention
    if invariant:
        decode = functools.partial(decode, split_tokens=mod.INVARIANT_SPLIT_TOKENS)
    return AttentionBackend(
        "triton", reference_kv_cache_shape, mod.write_kv, decode, _prefill_from_cache(mod)
    )


def select_attention(
    device: torch.device, requested: str, c_decode: bool, invariant: bool = False
) -> AttentionBackend:
    """requested: auto | torch | triton. auto = triton on CUDA when importable, else torch."""
    if requested == "torch":
        return torch_attention(c_decode, invariant)
    if requested == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend 'triton' needs a CUDA device")
        return triton_attention(invariant)
    if requested != "auto":
        raise ValueError(f"unknown attention backend {requested!r} (auto, torch or triton)")
    if device.type == "cuda":
        try:
            return triton_attention(invariant)
        except (ImportError, AttributeError) as exc:
            log.warning("Triton attention unavailable (%s); using the torch path", exc)
    return torch_attention(c_decode, invariant)


@dataclass(frozen=True)
class LoraGrouped:
    """LoRA adapters' rows in one pass: `run(x, y, a_stack, b_stack, slots)` adds each row's B(A x) to y
    [T, out] in place, a_stack [S, R, in], slots [T] int32 (-1: none), one row at a time in an order fixed
    by the shapes (a row's delta never depends on the step's other rows). b_stack is [S, out, R], or
    [S, R, out] where `b_transposed` (lora.c streams B's rows along the outputs)."""

    name: str
    run: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
    b_transposed: bool
    # whether its sums' order follows R (Triton's tiles over the ranks): the stacks then keep one width
    fixed_width: bool
    library: Callable[[], object] | None = None  # a C kernel's loader: built on first use

    def available(self) -> bool:
        return self.library is None or self.library() is not None


# torch's ops: where a backend has neither lora.c nor Triton (their sums may follow the rows: such
# backends hold no batch invariance anyway)
TORCH_LORA = LoraGrouped("torch", lora_ops.lora_grouped_torch, False, False)


@dataclass(frozen=True)
class Backend:
    """One engine's kernels (see the module docstring). Frozen: chosen once, at load."""

    attention: AttentionBackend
    linear: LinearMethod  # for every linear layer whose weight it takes (TORCH_LINEAR for the others)
    rmsnorm: Callable[[Tensor, Tensor, float], Tensor] | None = None  # float32 rows [T, D] in C; None: torch
    rotary_: Callable[[Tensor, Tensor, Tensor], None] | None = None  # float32 [T, H, D] in place in C
    decode_stack: bool = False  # decode steps may run in decode_stack.c (`stack_applies` says which)
    stack_refused: str | None = None  # why the model's decode steps stay layer by layer (for_model)
    moe: MoEMethod = TORCH_MOE  # a mixture-of-experts layer's experts (moe_methods.py)
    # the gated MLP's act(gate) * up from float32 gate_up rows [T, 2I] and the activation's name, in C (the
    # decode stack's); None: torch
    act_mul: Callable[[Tensor, int, str], Tensor] | None = None
    # RMSNorm of rows in any dtype, one row per program: (x [..., D], weight, eps, offset=) (Triton's,
    # batch-invariant); None: torch (or rmsnorm above)
    norm_rows: Callable[..., Tensor] | None = None
    # how linear.c streams the weights on this machine (platform.probes.kept_linear_tuning), in every C kernel call of
    # the linear and MoE methods and the decode stack; only the speed depends on it
    linear_tuning: LinearTuning = DEFAULT_TUNING
    # LoRA adapters, every row's delta in one grouped pass (LoraGrouped)
    lora_grouped: LoraGrouped = TORCH_LORA

    @property
    def name(self) -> str:
        """The attention backend's name: what the logs, the fingerprint and CUDA graphs go by."""
        return self.attention.name

    @property
    def bf16_gemm_rows(self) -> int:
        """Steps of this many rows or more take oneDNN's bf16 GEMM (0: never): the linear method's."""
        return self.linear.bf16_gemm_rows

    @property
    def c_decode(self) -> bool:
        """Whether decode attention runs paged_decode.c where it applies."""
        return self.attention.plain_native_decode is not None

    @property
    def summary(self) -> str:
        """What runs where, for the load log: e.g. "torch attention with C decode, linear.c, decode stack"."""
        parts = [f"{self.name} attention" + (" with C decode" if self.c_decode else "")]
        if self.linear.name == "c":
            rows = self.bf16_gemm_rows
            parts.append("linear.c" + (f" (bf16 GEMM from {rows} rows)" if rows else "")
                         + (" (bf16 products)" if self.linear.bf16_dot else ""))  # fmt: skip
        if self.decode_stack:
            parts.append("decode stack")
        elif self.stack_refused is not None:
            parts.append(f"decode layer by layer (decode_stack.c lacks {self.stack_refused})")
        return ", ".join(parts)

    def for_model(self, model: StackModel) -> Backend:
        """This backend for `model`: without the decode stack where the model says decode_stack.c cannot
        compute it (its decode steps then run layer by layer, on the same linear, norm and attention
        kernels); with torch's linear, norm and rotary ops too where the model says it runs layers of its own
        (the transformers fallback's Hugging Face layers), attention alone on this backend's kernels."""
        native = getattr(model, "native_layers_unsupported", None)
        if native is not None:
            return Backend(self.attention, TORCH_LINEAR, stack_refused=native)
        why = model.decode_stack_unsupported
        if not self.decode_stack or why is None:
            return self
        return dataclasses.replace(self, decode_stack=False, stack_refused=why)

    def linear_method(self, weight: Tensor) -> LinearMethod:
        """The method a linear layer with this weight (its dtype and device) runs."""
        return self.linear if self.linear.takes(weight) else TORCH_LINEAR

    def moe_method(self, x_dtype: torch.dtype, weight: Tensor) -> MoEMethod:
        """The method a mixture-of-experts layer with these experts runs under activations of x_dtype."""
        return self.moe if self.moe.takes(x_dtype, weight) else TORCH_MOE

    def stack_applies(
        self, k_cache: Tensor, block_tables: Tensor, context_lens: Tensor, widest: int | None = None
    ) -> bool:
        """Whether decode_stack.c runs this decode step (its metadata; one layer's K cache; the model's
        largest sliding window, None where a layer has none): the stack is on, the step has fewer rows than
        the bf16 GEMM threshold, and the layer-by-layer step's attention would be paged_decode.c alone
        (cascade attention over a shared prefix is faster where it applies, and keeps the step layer by
        layer)."""
        if not self.decode_stack:
            return False
        if self.bf16_gemm_rows and context_lens.shape[0] >= self.bf16_gemm_rows:
            return False
        plain = self.attention.plain_native_decode
        return plain is not None and plain(k_cache, block_tables, context_lens, widest)

    def build_decode_stack(
        self,
        layers: list[StackLayer],
        final_norm: Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> DecodeStack | None:
        """The decode stack over these layers (built once per set of caches), or None where decode_stack.c
        does not take them (native_stack.stack_supported)."""
        if not self.decode_stack or not native_stack.stack_supported(layers, heads, kv_heads, head_dim):
            return None
        if final_norm.dtype != torch.float32:
            return None
        return DecodeStack(
            layers, final_norm, heads, kv_heads, head_dim, eps, self.linear.bf16_dot, self.linear_tuning
        )


def torch_backend() -> Backend:
    """torch ops everywhere, nothing in C: the scratch passes at load (pool sizing, FP8 calibration) run
    their attention here, over caches of their own."""
    return Backend(torch_attention(c_decode=False), TORCH_LINEAR)


class StackModel(Protocol):
    """What the backend asks a model (llama.py's LlamaFamilyModel)."""

    @property
    def decode_stack_unsupported(self) -> str | None: ...

    # optional: native_layers_unsupported (str | None), why no C layer kernel but attention runs the model


class KernelSettings(Protocol):
    """The engine settings the backend is chosen from (EngineConfig's, where they are described)."""

    @property
    def attention_backend(self) -> str: ...
    @property
    def cpu_kernels(self) -> str: ...
    @property
    def decode_stack(self) -> bool: ...
    @property
    def batch_invariant(self) -> bool: ...


def select_backend(
    settings: KernelSettings,
    device: torch.device,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    fast_bf16_gemm: bool = False,
    bf16_dot: bool = False,
    linear_tuning: LinearTuning = DEFAULT_TUNING,
) -> Backend:
    """The backend for a model computing in `dtype` on `device`, its linear weights stored as weight_dtype
    (None: dtype). The C kernels it uses are built (or found cached) now, not in the first step; one that
    cannot be built leaves its torch path, with one warning. fast_bf16_gemm: whether this CPU's bf16 GEMMs
    are fast enough for prompt-sized steps of bfloat16 weights (the platform's measurement). float32 weights stay on
    linear.c at every row count, however fast torch's float32 GEMM is here: MKL sums a row differently at
    different row counts, so a request's answer would depend on the rows that share its step. Under
    settings.batch_invariant nothing is chosen by a step's rows: no bf16 GEMM threshold, and decode
    attention per sequence (TorchAttention's invariant mode). bf16_dot: bfloat16 weights multiplied in
    bfloat16 by linear_bf16dot.c at every row count (a batch-invariant bfloat16 engine; where this CPU has
    AVX-512 BF16). linear_tuning: how linear.c streams the weights here (platform.probes.kept_linear_tuning's), handed
    to the linear and MoE methods and the decode stack."""
    c = device.type == "cpu" and settings.cpu_kernels == "auto"
    invariant = settings.batch_invariant
    attention = select_attention(
        device, settings.attention_backend, c and native_attention.library() is not None, invariant
    )
    if attention.name == "triton":  # quantised weights through Triton's GEMM, the rest through F.linear
        triton_lora = importlib.import_module("worker.kernels.triton_lora")
        lora = LoraGrouped("triton", triton_lora.lora_grouped, False, True)
        if not invariant:
            return Backend(attention, TritonLinear(), moe=TritonMoE(), lora_grouped=lora)
        # batch-invariant: unquantised weights through triton_invariant's fixed-tile GEMM, RMSNorm one row
        # per program (torch's reductions split a row across blocks when a step has few rows)
        tri = importlib.import_module("worker.kernels.triton_invariant")
        return Backend(attention, TritonLinear(invariant=True), moe=TritonMoE(), norm_rows=tri.rmsnorm,
                       lora_grouped=lora)  # fmt: skip
    if not (c and dtype == torch.float32 and native_linear.library() is not None):
        return Backend(attention, TORCH_LINEAR)
    rows = 0
    if not invariant and weight_dtype == torch.bfloat16 and fast_bf16_gemm:
        rows = BF16_GEMM_ROWS
    stack = (
        settings.decode_stack
        and attention.plain_native_decode is not None
        and native_stack.library() is not None
    )
    # moe.c is built where a model has experts (moe_method), not for every model
    return Backend(
        attention,
        PackedLinear(rows, bf16_dot and native_linear.has_bf16dot(), linear_tuning),
        native_linear.rmsnorm,
        native_linear.rotary_,
        stack,
        moe=PackedMoE(linear_tuning),
        act_mul=native_linear.act_mul,
        linear_tuning=linear_tuning,
        # lora.c, built where adapters are served (LoraGrouped.available), not for every model
        lora_grouped=LoraGrouped("c", native_lora.lora_grouped, True, False, native_lora.library),
    )
