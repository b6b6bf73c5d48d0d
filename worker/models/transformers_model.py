"""The transformers fallback: any other decoder-only `*ForCausalLM` runs Hugging Face's own modules
(embeddings, norms, MLPs, rotary embedding from position_ids, logits) with batchq's paged attention plugged in
through transformers' AttentionInterface, as vLLM's Transformers backend does.

The Hugging Face model sees one batch row of the step's T packed tokens with their real position_ids. Every
attention module calls `paged_hf_attention` (registered as ATTN_NAME, the model's attn_implementation) with
its rotated q/k/v; that function writes K/V into the module's layer (module.layer_idx) of the paged cache and
attends over each sequence's cached context with the backend's kernels (layers.paged_attention, the very
calls our own decoder makes). No mask is built: transformers creates none for an attention function it does
not know, and ours needs none, since the step's metadata says where each sequence starts. So prefix caching,
chunked prefill and mixed decode/prefill steps hold as for a native family, and the outputs are exact.

Each module's sliding window and attention-logit softcap arrive as the interface's keywords (`sliding_window`,
`softcap`: what transformers' own kernels are given) and go to the kernels as they are, so Gemma 2's capped
and interleaved local/global layers, Gemma 3's, Mistral's and Qwen2's windows run exactly over the full
context. The windows the modules pass are recorded on the first pass (`layer_windows`, what the engine's
block manager reads) and checked against what the config's mask says (spec.sliding_windows): a layer the mask
windows but whose module passes no such window would attend to what Hugging Face hides, and is refused.
Attention sinks (`s_aux`, a module's `sinks`) go to the kernels as they are. What our attention cannot
compute is refused at load: layer types other than full and sliding attention, a model whose attention does not go through the interface (`check_exact` then finds
layers that never called it or logits that differ from Hugging Face's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from worker.kernels.backend import Backend
from worker.models.layers import AttentionMetadata, KVCache, paged_attention
from worker.models.llama import LlamaFamilyModel
from worker.models.spec import UnsupportedLayers, sliding_windows

ATTN_NAME = "batchq_paged"
STEP_KWARG = "batchq_step"  # the keyword that carries a step's _Step from forward() to paged_hf_attention


@dataclass(frozen=True)
class CacheSpec:
    """The shape of the model's KV cache and logits (what the runner and the pool sizing read of a spec)."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int  # the width of its final hidden states (an embedding's)


@dataclass
class _Step:
    meta: AttentionMetadata
    kv_caches: list[KVCache]
    backend: Backend
    scales: list[tuple[float, float]]  # per layer (k_scale, v_scale)
    absmax: list[tuple[float, float]] | None  # receives each layer's largest |K|, |V| (FP8 calibration)
    calls: list[int]  # the layers that attended, in order
    windows: list[int | None]  # the sliding window each of them passed (None: full attention)


class UnsupportedAttention(ValueError):
    """The model asked our attention for something it does not compute (sinks, a window below one key)."""


def paged_hf_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature. query: [1, heads, T, head_dim], key, value:
    [1, kv_heads, T, head_dim] (rotated) -> ([1, T, heads, head_dim], no weights)."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, _Step):
        raise RuntimeError(f"{ATTN_NAME} attention runs only inside batchq's forward pass (no step metadata)")
    sinks = kwargs.get("s_aux")  # gpt-oss-style attention sinks, a logit per head: every backend takes them
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UnsupportedAttention(
            f"sliding_window {window!r}: batchq's attention takes a positive token count"
        )
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    q = query[0].transpose(0, 1).contiguous()  # [T, heads, head_dim]
    k = key[0].transpose(0, 1).contiguous()  # [T, kv_heads, head_dim]
    v = value[0].transpose(0, 1).contiguous()
    if step.absmax is not None:
        step.absmax.append((float(k.abs().max()), float(v.abs().max())))
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    k_scale, v_scale = step.scales[layer]
    o = paged_attention(
        q, k, v, step.kv_caches[layer], step.meta, step.backend, scale, k_scale, v_scale, window,
        None if softcap is None else float(softcap), sinks,
    )  # fmt: skip
    step.calls.append(layer)
    step.windows.append(window)
    return o.unsqueeze(0), None


def register_attention() -> None:
    """Make ATTN_NAME a valid attn_implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_hf_attention)


class TransformersModel(nn.Module):
    """A Hugging Face causal LM behind LlamaFamilyModel's interface (what the runner, the pool sizing and the
    engine call), its attention on batchq's paged cache. Its weights stay Hugging Face's: no C linear layers,
    no decode stack, no narrower weight storage."""

    def __init__(self, hf: Any, max_len: int) -> None:
        super().__init__()
        self.hf = hf  # a PreTrainedModel whose attn_implementation is ATTN_NAME
        cfg = hf.config.get_text_config()
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        self.spec = CacheSpec(
            vocab_size=int(cfg.vocab_size),
            num_layers=int(cfg.num_hidden_layers),
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            hidden_size=int(cfg.hidden_size),
        )
        self.max_positions = max_len
        # What the causal-LM head does to lm_head's output beyond the matmul (compute_logits); check_exact
        # compares the result with the model's own logits, so a head that does something else is refused.
        self.logit_scale = float(getattr(cfg, "logit_scale", None) or 1.0)  # Cohere
        self.logits_scaling = float(getattr(cfg, "logits_scaling", None) or 1.0)  # Granite
        self.final_softcap: float | None = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2
        self._scales = [(1.0, 1.0)] * self.spec.num_layers
        # each layer's sliding window as its module passed it on the first pass (fallback_model runs one)
        self.layer_windows: tuple[int | None, ...] = ()

    decode_stack_unsupported = "Hugging Face's layers: the transformers fallback"
    """Why neither decode_stack.c nor linear.c runs this model (Backend.for_model)."""

    native_layers_unsupported = decode_stack_unsupported
    uses_c_linear = False

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    def use_backend(self, backend: Backend) -> None:
        """Nothing to move: Hugging Face's layers run as they are; attention takes the backend per step."""

    def quantised_linears(self) -> list[nn.Module]:
        """None: Hugging Face's own layers hold whatever the checkpoint held, in the compute dtype."""
        return []

    def dequantize_weights(self, dtype: torch.dtype) -> None:
        pass

    def quantize_weights(self, dtype: torch.dtype) -> None:
        raise ValueError(
            f"weight_dtype {dtype}: the transformers fallback runs Hugging Face's own linear layers in the compute "
            "dtype; use weight_dtype = 'auto'"
        )

    def set_kv_scales(self, scales: list[tuple[float, float]]) -> None:
        """Each layer's (k_scale, v_scale): its cache holds K / k_scale and V / v_scale."""
        assert len(scales) == self.spec.num_layers
        self._scales = list(scales)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        backend: Backend,
    ) -> Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden] after the final norm
        return self._run(input_ids, positions, _Step(meta, kv_caches, backend, self._scales, None, [], []))

    @torch.inference_mode()
    def kv_absmax(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        backend: Backend,
    ) -> list[tuple[float, float]]:
        """Each layer's largest |K| and |V| before the cache's scales (FP8 calibration), from one pass."""
        step = _Step(meta, kv_caches, backend, self._scales, [], [], [])
        self._run(input_ids, positions, step)
        assert step.absmax is not None
        return step.absmax

    def _run(self, input_ids: Tensor, positions: Tensor, step: _Step) -> Tensor:
        out = self.hf.base_model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            **{STEP_KWARG: step},
        )
        if step.calls != list(range(self.spec.num_layers)):
            raise RuntimeError(
                f"transformers fallback: layers {step.calls} attended through batchq's cache, expected every "
                f"one of {self.spec.num_layers} once"
            )
        windows = tuple(step.windows)
        if not self.layer_windows:
            self.layer_windows = windows
        assert windows == self.layer_windows, f"layer windows changed: {windows} after {self.layer_windows}"
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        # hidden: [S, hidden] -> [S, vocab] float32
        logits = self.hf.get_output_embeddings()(hidden)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()


AnyModel = LlamaFamilyModel | TransformersModel  # what the engine runs, whichever path loaded it

CHECK_PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2])  # token ids below any vocabulary's size


def fallback_model(hf: Any, max_len: int) -> TransformersModel:
    """`hf` with batchq's attention plugged in, once it has shown itself exact against transformers' eager
    attention (`check_exact`). Raises ValueError with the reason where it is not."""
    if not hf._can_set_attn_implementation():
        raise ValueError("its attention modules do not call transformers' AttentionInterface")
    # The reference runs transformers' eager attention: its only one that every model's rules reach (sdpa,
    # which transformers 5.17 picks for Gemma 2, skips its attention-logit soft-capping).
    hf.set_attn_implementation("eager")
    with torch.inference_mode():
        device = next(hf.parameters()).device
        reference = [hf(torch.tensor([p], device=device)).logits[0].float() for p in CHECK_PROMPTS]
    register_attention()
    hf.set_attn_implementation(ATTN_NAME)
    model = TransformersModel(hf, max_len).eval()
    why = check_exact(model, reference)
    if why is not None:
        raise ValueError(why)
    why = check_windows(model, hf.config.get_text_config())
    if why is not None:
        raise ValueError(why)
    return model


def check_windows(model: TransformersModel, cfg: Any) -> str | None:
    """Why the windows the attention modules passed (model.layer_windows) are not the mask's, or None: each
    layer the config's mask windows (spec.sliding_windows, as transformers' create_masks_for_generate reads
    it) must pass that window. A module may pass a window the generic reading misses (Mistral's code windows
    every layer and ignores layer_types): its own is what Hugging Face computes."""
    try:
        masked = sliding_windows(cfg, "layer_types")
    except UnsupportedLayers as e:
        return str(e)
    for layer, (want, got) in enumerate(zip(masked, model.layer_windows, strict=True)):
        if want is not None and got != want:
            return (
                f"layer {layer}'s mask has a sliding window of {want} tokens but its attention module passes "
                f"{got!r} to the attention function"
            )
    return None


@torch.inference_mode()
def check_exact(model: TransformersModel, reference: list[Tensor], block_size: int = 4) -> str | None:
    """Why `model` is not exact, or None: CHECK_PROMPTS packed in one step over scratch caches must give
    `reference`, each prompt's logits under transformers' eager attention, every layer attending through
    batchq's cache."""
    from worker.kernels.backend import torch_backend

    backend = torch_backend()
    device = next(model.hf.parameters()).device
    s = model.spec
    lens = [len(p) for p in CHECK_PROMPTS]
    nblk = [-(-n // block_size) for n in lens]
    shape = backend.attention.kv_cache_shape(sum(nblk), block_size, s.num_kv_heads, s.head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=model.dtype, device=device),
            torch.zeros(shape, dtype=model.dtype, device=device),
        )
        for _ in range(s.num_layers)
    ]
    tables = torch.tensor([list(range(nblk[0])), list(range(nblk[0], sum(nblk)))], dtype=torch.int32)
    slots = [*range(lens[0]), *range(nblk[0] * block_size, nblk[0] * block_size + lens[1])]
    meta = AttentionMetadata(
        phase="prefill",
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device),
    )
    ids = torch.tensor([*CHECK_PROMPTS[0], *CHECK_PROMPTS[1]], device=device)
    positions = torch.tensor([*range(lens[0]), *range(lens[1])], device=device)
    try:
        ours = model.compute_logits(model(ids, positions, meta, caches, backend))  # [T, vocab]
    except UnsupportedAttention as e:
        return str(e)
    except (
        Exception
    ) as e:  # whatever Hugging Face's forward raised under our attention: a reason, in one line
        text = " ".join(str(e).split())
        return f"its forward pass fails under batchq's attention: {type(e).__name__}: {text[:300]}"
    # float32: rounding alone; 16-bit: the two attention paths round differently, while what this check is for
    # (a layer outside our cache, a head's missing factor) moves logits by far more than either
    tol = 1e-3 if model.dtype == torch.float32 else 1e-1
    start = 0
    for p, ref in zip(CHECK_PROMPTS, reference, strict=True):
        got = ours[start : start + len(p)]
        start += len(p)
        err = float((got - ref).abs().max())
        if err > tol * max(1.0, float(ref.abs().max())):
            return f"its logits differ from Hugging Face's by {err:.3g} under batchq's attention"
    return None
