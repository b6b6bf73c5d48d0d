"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral, Granite, OLMo 2, Phi-3, Gemma 2 / 3)
over packed tokens with paged KV.

Fused QKV and gate/up projections; optional QKV bias (Qwen2), per-head QK RMSNorm (Qwen3), QK RMSNorm over
the whole projections and norms after each sublayer instead of before (OLMo 2), Granite's multipliers;
Gemma's (1 + w) norms before and after each sublayer, GELU (tanh) MLP, embedding normalizer, soft-capped
attention and logits, and Gemma 3's own rotary table for its sliding layers.
Configs and rope variants come from transformers; the weights stream from the checkpoint into the
parameters (load_weights, under Hugging Face's names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from worker.kernels.backend import TORCH_LINEAR, Backend, DecodeStack
from worker.models.errors import CheckpointError
from worker.models.layers import (
    AttentionMetadata,
    KVCache,
    Linear,
    RMSNorm,
    RotaryTable,
    apply_rotary,
    paged_attention,
)
from worker.models.lora import LoraState
from worker.models.mlp import MLP
from worker.models.moe import MoE, gpt_oss_layout
from worker.models.quant_loading import QuantizedModule
from worker.models.sharding import (
    ROW_PARALLEL,
    ShardingError,
    act_order_share,
    decoder_shards,
    row_parallel_groups,
    shard_spec,
    vocab_rows,
)
from worker.models.spec import DecoderSpec
from worker.models.stack_layers import build_stack
from worker.models.weights import Slot, WeightSource, fill

if TYPE_CHECKING:
    from worker.parallel.group import TPGroup

# DecoderSpec, KVCache: where callers have always found them
__all__ = ["DecoderSpec", "KVCache", "LlamaFamilyModel"]

# Tensors a checkpoint may hold that are not weights: older Llama checkpoints saved the rotary inv_freq
# buffer, which the rotary table computes from the config (Hugging Face drops them too).
IGNORED = ("rotary_emb.inv_freq",)
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _read(w: Tensor | WeightSource) -> Tensor:
    """A checkpoint tensor in memory (for a conversion before it reaches its slot)."""
    if isinstance(w, Tensor):
        return w
    t = torch.empty(w.shape, dtype=w.dtype if w.dtype.is_floating_point else torch.float32)
    w.read_into(t)
    return t


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.qk_norm_over_projection = spec.qk_norm_over_projection
        q_dim, k_dim = (self.q_size, self.kv_size) if spec.qk_norm_over_projection else (spec.head_dim,) * 2
        qk_norm = spec.qk_norm or spec.qk_norm_over_projection
        self.q_norm = RMSNorm(q_dim, spec.rms_norm_eps, spec.norm_plus_one) if qk_norm else None
        self.k_norm = RMSNorm(k_dim, spec.rms_norm_eps, spec.norm_plus_one) if qk_norm else None
        self.scale = spec.head_dim**-0.5 if spec.attention_multiplier is None else spec.attention_multiplier
        self.window = spec.window(layer)  # its sliding window (None: full attention)
        self.local_rope = spec.local_rope and self.window is not None  # Gemma 3's sliding layers' table
        self.softcap = spec.attention_softcap
        # K and V are stored divided by these (per-tensor scales of an FP8 cache, calibrated at load by
        # kv_pool.calibrate_kv_scales; 1 otherwise): q.k/s_k scores with the softmax scale times s_k, and
        # the output is multiplied by s_v, so the kernels never see a scale.
        self.k_scale = self.v_scale = 1.0
        self.c_rotary: Callable[[Tensor, Tensor, Tensor], None] | None = None  # the backend's, at load
        # gpt-oss: a logit per head in every softmax's denominator
        self.sinks = nn.Parameter(torch.empty(spec.num_heads)) if spec.attention_sinks else None
        self.tp: TPGroup | None = None  # tensor parallelism: o_proj's partial outputs summed over the ranks

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
        backend: Backend,
        kv_absmax: list[tuple[float, float]] | None = None,
    ) -> Tensor:
        # x: [T, hidden] -> [T, hidden]. kv_absmax: where given, receives this call's largest |K| and |V|
        # (before the cache's scales; FP8 calibration).
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        per_head = not self.qk_norm_over_projection
        if self.q_norm is not None and self.k_norm is not None and not per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin, self.c_rotary), apply_rotary(k, cos, sin, self.c_rotary)
        if kv_absmax is not None:
            kv_absmax.append((float(k.abs().max()), float(v.abs().max())))
        o = paged_attention(
            q, k, v, kv, meta, backend, self.scale, self.k_scale, self.v_scale, self.window, self.softcap,
            self.sinks,
        )  # fmt: skip
        out = self.o_proj(o.reshape(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm: input_layernorm before attention, post_attention_layernorm before the MLP (Hugging Face's
    names). Post-norm (OLMo 2): post_attention_layernorm on attention's output, post_feedforward_layernorm
    on the MLP's, and no input_layernorm. Sandwich (Gemma 2 / 3): input_layernorm before attention and
    post_attention_layernorm on its output, pre_feedforward_layernorm before the MLP and
    post_feedforward_layernorm on its output."""

    def __init__(self, spec: DecoderSpec, layer: int) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_plus_one)

        self.input_layernorm = None if spec.post_norms else norm()
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if spec.sandwich_norms else None
        self.mlp: MLP | MoE
        if spec.moe is not None and spec.moe.sparse_layers[layer]:
            self.mlp = MoE(spec)
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, spec.activation)
        self.post_feedforward_layernorm = norm() if spec.post_norms or spec.sandwich_norms else None


class LlamaFamilyModel(nn.Module):
    """rotary: every layer's table; rotary_local: Gemma 3's sliding layers' (rope_local_base_freq), or None."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary: RotaryTable,
        rotary_local: RotaryTable | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        # tensor parallelism: this rank's share of the decoder (sharding.py); spec is then the rank's own
        # (its heads, KV heads and intermediate rows), full_spec the checkpoint's
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.full_spec = spec
        if self.tp is not None:
            spec = shard_spec(spec, self.tp.size)
        self.spec = spec
        self.vocab_rows = spec.vocab_size if self.tp is None else vocab_rows(spec.vocab_size, self.tp.size)
        # Tied embeddings keep one table, lm_head's [vocab, hidden], whose rows are the embeddings, rather
        # than a second copy of the largest matrix (113 MB in float32 for SmolLM2-135M).
        self.embed_tokens = None if spec.tie_embeddings else nn.Embedding(self.vocab_rows, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_plus_one)
        self.lm_head = Linear(spec.hidden_size, self.vocab_rows, bias=False)
        for m in self.modules():  # (a MoE's shared expert is summed with its experts, once)
            if isinstance(m, (Attention, MoE)):
                m.tp = self.tp
            if isinstance(m, MoE):
                m.full_moe = self.full_spec.moe or m.moe
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            if isinstance(layer.mlp, MLP):
                layer.mlp.tp = self.tp
        self.rotary = rotary
        self.rotary_local = rotary_local if spec.local_rope else None
        # Granite's embedding multiplier and logits scaling, applied as scalars rather than folded into the
        # weights: a tied table serves both ends with different factors, and both ops run outside the
        # decode stack, on [T, hidden] and [B, vocab] rows, exactly as Hugging Face computes them.
        self.embedding_multiplier = spec.embedding_multiplier
        self.logits_scaling = spec.logits_scaling
        self._stack: tuple[list[KVCache], DecodeStack | None] | None = None  # (its caches, the stack)
        self.lora: LoraState | None = None  # where LoRA adapters are served (enable_lora)
        self.injected: tuple[Tensor, Tensor] | None = None  # this step's (rows, embeddings) of images' tokens

    @property
    def decode_stack_unsupported(self) -> str | None:
        """Why decode_stack.c cannot run this model's decode step exactly, or None: the backend then keeps
        its decode steps layer by layer (Backend.for_model)."""
        if self.tp is not None:
            return "tensor parallelism (the stack sums no partial outputs over the ranks between its layers)"
        if self.spec.moe is not None:
            return "mixture-of-experts layers"
        if self.spec.post_norms or self.spec.qk_norm_over_projection:
            return "OLMo 2's norms: after each sublayer, and over whole q / k projections"
        if self.rotary.dim != self.spec.head_dim:
            return "a partial rotary factor"
        if self.spec.mrope_section is not None:
            return "M-RoPE (three positions per token)"
        if any(lin.in_perm is not None for lin in self.linears()):
            return "an input permutation (GPTQ act-order)"
        return None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for full attention (what the engine's block manager reads)."""
        return tuple(a.window for a in self.attentions())

    @property
    def uses_c_linear(self) -> bool:
        """Whether the linear layers run linear.c (the backend's choice, use_backend)."""
        return self.lm_head.method.name == "c"

    @property
    def max_positions(self) -> int:
        """The positions the rotary table covers: the longest sequence the model runs."""
        return int(self.rotary.cos.shape[0])

    def expert_tokens(self) -> dict[int, list[int]]:
        """Per layer with experts: the (token, pick) routings each expert received since the last reset (one
        read of the counts every MoE layer keeps on its device)."""
        layers = [(i, layer.mlp) for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoE)]
        counted = [(i, m.counts) for i, m in layers if m.counts is not None]
        if not counted:
            return {i: [0] * m.moe.num_experts for i, m in layers}
        rows = torch.stack([c for _, c in counted]).tolist()
        out = {i: [0] * m.moe.num_experts for i, m in layers}
        out.update({i: row for (i, _), row in zip(counted, rows, strict=True)})
        return out

    def reset_expert_tokens(self) -> None:
        for m in self.modules():
            if isinstance(m, MoE):
                m.counts = None

    def attentions(self) -> list[Attention]:
        """Every layer's attention module, in order."""
        out = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            out.append(layer.self_attn)
        return out

    def linears(self) -> list[Linear]:
        """Every linear layer, the LM head last."""
        return [m for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head] + [self.lm_head]

    def use_backend(self, backend: Backend) -> None:
        """Run every layer on the backend's kernels: each linear layer the method the backend has for its
        weight (which moves it into that method's layout), RMSNorm and rotary rows in C where the backend
        has them, and a SiLU MLP's activation. Once, at load, after quantize_weights."""
        for lin in self.linears():
            lin.use_method(backend.linear_method(lin.weight))
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.c_rows = backend.rmsnorm
                m.norm_rows = backend.norm_rows
            elif isinstance(m, Attention):
                m.c_rotary = backend.rotary_
            elif isinstance(m, MoE):
                m.use_method(backend.moe_method(self.dtype, m.gate_up))
            elif isinstance(m, MLP):
                m.c_act_mul = backend.act_mul
        self._stack = None

    def quantize_weights(self, dtype: torch.dtype) -> None:
        """Store every linear weight (the LM head and a tied embedding included) as `dtype`. A checkpoint's
        own quantisation is not quantised again: ValueError."""
        if self.quantised_linears():
            raise ValueError(
                f"weight_dtype {str(dtype).removeprefix('torch.')}: the checkpoint's weights are quantised already "
                "and are kept as it ships them; use weight_dtype = 'auto'"
            )
        for lin in self.linears():
            lin.quantize(dtype)
        for m in self.modules():  # experts: bfloat16 as the linears (moe.c widens it); int8 only for linears
            if isinstance(m, MoE) and dtype == torch.bfloat16:
                m.store_experts(torch.bfloat16)
        self._stack = None

    def quantised_linears(self) -> list[Linear]:
        """The linears holding a checkpoint's own quantisation (FP8, or 4/8-bit groups)."""
        return [lin for lin in self.linears() if lin.bits or lin.weight.dtype == torch.float8_e4m3fn]

    def dequantize_weights(self, dtype: torch.dtype) -> None:
        """Every quantised linear stored dense in `dtype`: where no kernel of the backend runs them as they
        are (torch's ops would dequantise them at every call)."""
        for lin in self.quantised_linears():
            lin.dequantize(dtype)
        self._stack = None

    def set_kv_scales(self, scales: list[tuple[float, float]]) -> None:
        """Each layer's (k_scale, v_scale): its cache holds K / k_scale and V / v_scale (an FP8 cache's
        calibrated scales, kv_pool.calibrate_kv_scales)."""
        for a, (k_scale, v_scale) in zip(self.attentions(), scales, strict=True):
            a.k_scale, a.v_scale = k_scale, v_scale
        self._stack = None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations, norms, KV cache by default), whatever the weights are stored in."""
        return self.norm.weight.dtype

    def embed(self, input_ids: Tensor) -> Tensor:
        # input_ids: [T] -> [T, hidden]
        ids, outside = input_ids, None
        if self.tp is not None:  # this rank's rows of the table; the others' tokens are zeros, summed over
            ids = input_ids - self.tp.rank * self.vocab_rows
            outside = (ids < 0) | (ids >= self.vocab_rows)
            ids = ids.masked_fill(outside, 0)
        if self.embed_tokens is None:
            h = self.lm_head.rows(ids, self.dtype)
        else:
            h = self.embed_tokens(ids)
        if outside is not None and self.tp is not None:
            h = self.tp.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))
        if self.spec.embedding_normalizer is not None:
            # Hugging Face multiplies by a tensor of it cast to the model dtype (sqrt(3072) is 55.5 in
            # bfloat16): the same value as a Python scalar, which creates no device tensor (CUDA graphs)
            h = h * float(torch.tensor(self.spec.embedding_normalizer).to(h.dtype))
        return h if self.embedding_multiplier == 1.0 else h * self.embedding_multiplier

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        backend: Backend,
    ) -> Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        h = self.embed(input_ids)
        if self.injected is not None:  # images' embeddings at their tokens (this step's, set by the runner)
            h = h.index_copy(0, self.injected[0], self.injected[1].to(h.dtype))
        adapted = self.lora is not None and self.lora.step is not None  # the stack runs base weights only
        if (
            meta.phase == "decode"
            and not adapted
            and backend.stack_applies(
                kv_caches[0][0], meta.block_tables, meta.context_lens, self.spec.widest_window
            )
        ):
            stack = self.decode_stack(kv_caches, backend)
            if stack is not None:  # every layer in one C call (same kernels, without the ops between them)
                cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]
                local = self.rotary_local
                rows = None if local is None else (local.cos[positions], local.sin[positions])
                return stack(h, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens, rows)
        return self._layers(h, positions, meta, kv_caches, backend, None)

    @torch.inference_mode()
    def kv_absmax(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        backend: Backend,
    ) -> list[tuple[float, float]]:
        """A forward pass, layer by layer, that returns each layer's largest |K| and |V| before the cache's
        scales (FP8 calibration, kv_pool.calibrate_kv_scales). It writes K/V into `kv_caches` as any pass."""
        absmax: list[tuple[float, float]] = []
        self._layers(self.embed(input_ids), positions, meta, kv_caches, backend, absmax)
        return absmax

    def _layers(
        self,
        h: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        backend: Backend,
        kv_absmax: list[tuple[float, float]] | None,
    ) -> Tensor:
        # h: [T, hidden] embedded -> [T, hidden] after the final norm
        cos, sin = self.rotary(positions, h.dtype)
        local = None if self.rotary_local is None else self.rotary_local(positions, h.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            if layer.pre_feedforward_layernorm is not None:  # sandwich norms (Gemma 2 / 3)
                assert layer.input_layernorm is not None and layer.post_feedforward_layernorm is not None
                c, s = local if local is not None and layer.self_attn.local_rope else (cos, sin)
                attn = layer.self_attn(layer.input_layernorm(h), c, s, kv, meta, backend, kv_absmax)
                h = h + layer.post_attention_layernorm(attn)
                h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
                continue
            if layer.input_layernorm is None:  # post-norm (OLMo 2)
                assert layer.post_feedforward_layernorm is not None
                attn = layer.self_attn(h, cos, sin, kv, meta, backend, kv_absmax)
                h = h + layer.post_attention_layernorm(attn)
                h = h + layer.post_feedforward_layernorm(layer.mlp(h))
                continue
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, kv, meta, backend, kv_absmax)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def decode_stack(self, kv_caches: list[KVCache], backend: Backend) -> DecodeStack | None:
        """The C decode stack over these caches (built on first use, kept while the runner keeps the same
        list of caches), or None where decode_stack.c does not take these weights or caches."""
        if self._stack is None or self._stack[0] is not kv_caches:
            self._stack = (kv_caches, build_stack(self, kv_caches, backend))
        return self._stack[1]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        # hidden: [B, hidden] -> logits: [B, vocab] float32
        logits = self.lm_head(hidden)
        if self.tp is not None:  # every rank's share of the vocabulary, its padding rows cut off
            logits = self.tp.all_gather(logits)[:, : self.spec.vocab_size]
        cap = self.spec.final_softcap
        if cap is not None:  # Gemma 2: in the logits' dtype, as Hugging Face caps them
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    @classmethod
    def empty(
        cls,
        spec: DecoderSpec,
        rotary: RotaryTable,
        dtype: torch.dtype,
        device: torch.device,
        rotary_local: RotaryTable | None = None,
        tp: TPGroup | None = None,
    ) -> LlamaFamilyModel:
        """The decoder on `device` with its parameters allocated in `dtype` and not initialised (no random
        init, no second copy: load_weights fills them), and its rotary tables, which keep their own dtype.
        tp: the rank's group under tensor parallelism (its share of the decoder is built)."""
        with torch.device("meta"):
            model = cls(spec, RotaryTable(torch.ones(1), 1.0, 1), tp=tp)
        model = model.to(dtype).to_empty(device=device)
        model.rotary = rotary
        model.rotary_local = rotary_local if spec.local_rope else None
        return model

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, Tensor | WeightSource]], where: str = "the state dict"
    ) -> None:
        """Fill every parameter from tensors under Hugging Face's names, in any order, each exactly once:
        q/k/v and gate/up into their rows of the fused projections (or whole, where the checkpoint has them
        fused, as Phi-3's), a tied table under either of its names. Granite's residual multiplier is folded
        into o_proj and down_proj (weights and biases), the last ops of the two sublayers, so that the decode
        stack runs Granite as it runs Llama. A missing, unexpected, misshapen or doubled tensor raises
        CheckpointError naming it and its file (`where`: what should have held a missing one)."""
        perms: dict[str, tuple[str, Tensor]] = {}  # our linear -> (its first part's name, act-order's order)
        moe = self.full_spec.moe  # gpt-oss's fused experts are converted whole, then sharded

        def kept(
            pairs: Iterable[tuple[str, Tensor | WeightSource]],
        ) -> Iterator[tuple[str, Tensor | WeightSource]]:
            for n, w in pairs:
                if n.endswith(IGNORED):
                    continue
                if n.endswith(".in_perm") and isinstance(w, Tensor):
                    self._take_perm(n, w, perms)
                    continue
                if moe is not None and moe.kind == "gpt_oss" and ".mlp.experts." in n:
                    yield n, gpt_oss_layout(n, _read(w), moe)
                    continue
                yield n, w

        fill(self._weight_slots(), kept(weights), where)
        for name, lin in self._linears_by_name().items():
            if lin.in_perm is not None and name not in perms:
                raise CheckpointError(
                    f"quantised module {name!r}: its act-order g_idx is not in the checkpoint ({where})"
                )

    def prepare_quantized(self, modules: dict[str, QuantizedModule]) -> None:
        """Room in each linear for the weights a quantised checkpoint keeps quantised (`modules`: Hugging
        Face's module name -> how it is stored, quant_loading.quantised_linears). A fused projection's
        parts must be stored alike."""
        for name, lin in self._linears_by_name().items():
            names = self._hf_parts(name)
            parts = [m for m in names if m in modules]
            if not parts:
                continue
            kinds = {modules[m] for m in parts}
            alike = parts == names[:-1] or parts == names[-1:]  # every part, or the checkpoint's fused one
            if len(kinds) > 1 or not alike:
                raise CheckpointError(
                    f"quantised modules {parts}: the parts of batchq's fused {name} must be quantised alike"
                )
            q = kinds.pop()
            if self.tp is not None and q.kind == "groups" and name.endswith(ROW_PARALLEL):
                row_parallel_groups(parts[0], q.fmt, q.group, lin.in_features, self.tp.size)
            try:
                if q.kind == "groups":
                    table = torch.float16 if q.table == "f16" else torch.float32
                    lin.empty_groups(q.group, q.bits, q.act_order, table)
                else:
                    lin.empty_fp8()
            except ValueError as e:
                raise CheckpointError(f"quantised module {parts[0]!r}: {e}") from None

    def hf_linear_modules(self) -> set[str]:
        """Hugging Face's module names that the decoder's linears take (fused projections' parts too)."""
        return {m for name in self._linears_by_name() for m in self._hf_parts(name)}

    def _linears_by_name(self) -> dict[str, Linear]:
        return {n: m for n, m in self.named_modules() if isinstance(m, Linear)}

    def _hf_parts(self, name: str) -> list[str]:
        """Hugging Face's module names for our linear `name` (its parts, then itself where fused)."""
        hf = name if name.startswith("lm_head") else "model." + name
        module = name.rsplit(".", 1)[-1]
        return [hf.replace(module, part) for part in FUSED_PARTS.get(module, ())] + [hf]

    def _take_perm(self, name: str, perm: Tensor, perms: dict[str, tuple[str, Tensor]]) -> None:
        """Act-order's input order of a quantised module: a fused projection's parts must share one."""
        module = name.removesuffix(".in_perm")
        for ours, lin in self._linears_by_name().items():
            if module in self._hf_parts(ours) and lin.in_perm is not None:
                if ours in perms and not torch.equal(perms[ours][1], perm):
                    raise CheckpointError(
                        f"quantised modules {perms[ours][0]!r} and {module!r} order their inputs differently "
                        f"(act-order), but batchq runs them as one fused {ours}"
                    )
                perms.setdefault(ours, (module, perm))
                if self.tp is not None and ours.endswith(ROW_PARALLEL):  # the rank's inputs only
                    try:
                        perm = act_order_share(module, perm, self.tp.rank, self.tp.size)
                    except ShardingError as e:
                        raise CheckpointError(str(e)) from None
                lin.in_perm.copy_(perm)
                return
        raise CheckpointError(f"tensor {name!r}: the model has no act-order linear of that name")

    def _weight_slots(self) -> dict[str, Slot]:
        """Hugging Face's name of every tensor the decoder takes -> where it goes. Our parameters carry
        Hugging Face's names less its "model." prefix; a fused projection also takes its parts' rows, and a
        tied table its embed_tokens name."""
        assert self.lm_head.method is TORCH_LINEAR, "weights load before use_backend packs them"
        s, r = self.spec, self.spec.residual_multiplier
        kv = s.num_kv_heads * s.head_dim
        qkv = [("q_proj", s.num_heads * s.head_dim), ("k_proj", kv), ("v_proj", kv)]
        slots: dict[str, Slot] = {}
        moe_owned: set[int] = set()  # what a MoE layer's own slots place (MoE.slots)
        for name, m in self.named_modules():
            if isinstance(m, MoE):
                slots.update(m.slots(name, int(name.split(".")[1])))
                moe_owned.update(id(p) for p in m.own_parameters())
        if self.embed_tokens is None:  # tied: one table, which the checkpoint may give under either name
            slots["model.embed_tokens.weight"] = Slot(
                "lm_head.weight", self.lm_head.weight, 0, self.vocab_rows
            )
        # a quantised linear's (s, o) table or FP8 scales beside its parameters (quant_loading names them)
        quantised = [(f"{n}.{b}", t) for n, lin in self._linears_by_name().items()
                     for b, t in (("group_table", lin.group_table), ("scale", lin.scale)) if t is not None]  # fmt: skip
        for name, t in [*self.named_parameters(), *quantised]:
            if id(t) in moe_owned:
                continue
            hf = name if name.startswith("lm_head.") else "model." + name
            module = name.split(".")[-2]
            start = 0
            # a gate_up_proj's halves: the dense MLP's or a shared expert's intermediate size
            parts = {
                "qkv_proj": qkv,
                "gate_up_proj": [("gate_proj", t.shape[0] // 2), ("up_proj", t.shape[0] // 2)],
            }
            shards = {}
            if self.tp is not None:
                shards = decoder_shards(
                    name, module, t, self.tp.rank, self.tp.size, self.full_spec, self.spec
                )
            for part, rows in parts.get(module, []):  # before the fused name: a missing part is named first
                slots[hf.replace(module, part)] = Slot(name, t, start, start + rows, shard=shards.get(part))
                start += rows
            # Granite's residual multiplier, folded (load_weights): into the scales of a quantised weight
            # (s, o) or FP8 scale, not into its integer or FP8 q
            folded = module in ("o_proj", "down_proj") and t.is_floating_point() and t.element_size() > 1
            scale = r if folded else 1.0
            if (
                self.tp is not None
                and self.tp.rank
                and module in ("o_proj", "down_proj")
                and name.endswith(".bias")
            ):
                scale = 0.0  # a row-parallel projection's bias is added once, by rank 0, before the sum
            slots[hf] = Slot(name, t, 0, t.shape[0], scale, shard=shards.get(module))
        if self.embed_tokens is None and self.tp is not None:
            slots["model.embed_tokens.weight"] = dataclasses.replace(
                slots["model.embed_tokens.weight"], shard=slots["lm_head.weight"].shard
            )
        return slots
