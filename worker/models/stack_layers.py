"""A Llama-family decoder's layers as the C decode stack takes them (decode_stack.c runs a decode step's every
layer in one call): each layer's projections, norms, caches and scales."""

from __future__ import annotations

from typing import Any

import torch

from worker.kernels.backend import Backend, DecodeStack, StackLayer, StackLinear
from worker.models.layers import KVCache
from worker.models.mlp import MLP


def build_stack(model: Any, kv_caches: list[KVCache], backend: Backend) -> DecodeStack | None:
    """The decoder's layers as decode_stack.c takes them, over these caches; None where its rotary tables are not
    float32 or decode_stack_unsupported names a reason."""
    tables = [model.rotary] + ([] if model.rotary_local is None else [model.rotary_local])
    if any(t.cos.dtype != torch.float32 for t in tables):  # the step's rotary rows are read as float32
        return None
    if model.decode_stack_unsupported is not None:
        return None
    s = model.spec
    layers = []
    for module, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        layer: Any = module  # a DecoderLayer (llama.py imports this module, so it is not named here)
        assert layer.input_layernorm is not None
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, MLP)  # decode_stack_unsupported declines experts
        # sandwich norms (Gemma): the MLP's input norm is pre_feedforward_layernorm, and
        # post_attention_layernorm norms attention's output
        sandwich = layer.pre_feedforward_layernorm is not None
        before_mlp = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        assert before_mlp is not None
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        qkv, o, gate_up, down = (
            StackLinear(lin.weight, lin.scale, lin.bias, lin.groups()) for lin in projections
        )
        layers.append(
            StackLayer(
                qkv,
                o,
                gate_up,
                down,
                input_norm=layer.input_layernorm.scale(),
                post_attention_norm=before_mlp.scale(),
                q_norm=None if attn.q_norm is None else attn.q_norm.scale(),
                k_norm=None if attn.k_norm is None else attn.k_norm.scale(),
                k_cache=k_cache,
                v_cache=v_cache,
                q_scale=attn.scale * attn.k_scale,  # as forward() scales q (double, then float32)
                k_scale=attn.k_scale,
                v_scale=attn.v_scale,
                window=attn.window,
                softcap=attn.softcap,
                attention_out_norm=layer.post_attention_layernorm.scale() if sandwich else None,
                mlp_out_norm=(
                    layer.post_feedforward_layernorm.scale()
                    if sandwich and layer.post_feedforward_layernorm is not None
                    else None
                ),
                activation=s.activation,
                local_rope=attn.local_rope and model.rotary_local is not None,
            )
        )
    return backend.build_decode_stack(
        layers, model.norm.scale(), s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
    )
