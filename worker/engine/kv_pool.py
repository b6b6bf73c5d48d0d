"""KV pool sizing: how many blocks of block_size tokens the engine's cache holds, decided at load."""

from __future__ import annotations

import logging

import psutil
import torch

from worker.engine.kv_window import SlidingWindow
from worker.engine_config import EngineConfig
from worker.kernels.backend import torch_backend
from worker.models.layers import AttentionMetadata, KVCache
from worker.models.transformers_model import AnyModel

log = logging.getLogger(__name__)


def kv_bytes_per_token(model: AnyModel, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv heads x head dim x dtype bytes."""
    s = model.spec
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * dtype.itemsize


def _scratch_prefill(
    model: AnyModel, t: int, block_size: int, device: torch.device
) -> tuple[list[KVCache], AttentionMetadata]:
    """A dummy one-sequence prefill of `t` tokens over scratch caches of its own (zeroed, so they are
    resident before anything is measured): the caches and the step's metadata (positions = slot_mapping)."""
    s = model.spec
    dtype = model.dtype
    nblk = -(-t // block_size)
    shape = torch_backend().attention.kv_cache_shape(nblk, block_size, s.num_kv_heads, s.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(s.num_layers)
    ]
    meta = AttentionMetadata(
        phase="prefill",
        slot_mapping=torch.arange(t, device=device),
        block_tables=torch.arange(nblk, dtype=torch.int32, device=device).unsqueeze(0),
        context_lens=torch.tensor([t], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=device),
    )
    return caches, meta


@torch.inference_mode()
def _peak_activation_bytes(cfg: EngineConfig, model: AnyModel, device: torch.device) -> int:
    """Run a dummy prefill of one full token budget (with a scratch cache) and measure its peak."""
    t = min(cfg.max_num_batched_tokens, model.max_positions)
    caches, meta = _scratch_prefill(model, t, cfg.block_size, device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(t, dtype=torch.long, device=device)
    hidden = model(ids, meta.slot_mapping, meta, caches, torch_backend())
    model.compute_logits(hidden[-cfg.max_num_seqs :])
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, hidden
    torch.cuda.empty_cache()
    return int(peak)


PROBE_TOKENS = 1024  # the CPU working-memory probe runs this many tokens and scales to the budget


def _rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


@torch.inference_mode()
def _cpu_step_bytes(cfg: EngineConfig, model: AnyModel) -> int:
    """The working memory of the largest step on the CPU, measured: the resident memory a dummy prefill
    of PROBE_TOKENS adds (freed step memory stays in the heap, see platform.cpu_settings.keep_freed_memory, so it
    shows in RSS), scaled to the token budget."""
    t = min(cfg.max_num_batched_tokens, PROBE_TOKENS, model.max_positions)
    caches, meta = _scratch_prefill(model, t, cfg.block_size, torch.device("cpu"))
    before = _rss_bytes()  # the scratch cache is resident already: not part of the step
    hidden = model(torch.zeros(t, dtype=torch.long), meta.slot_mapping, meta, caches, torch_backend())
    model.compute_logits(hidden[-min(t, cfg.max_num_seqs) :])
    grown = max(0, _rss_bytes() - before)
    del caches, hidden
    return grown * max(1, -(-cfg.max_num_batched_tokens // t))


SPARE_SEQUENCES = 1  # the CPU default's room beyond max_num_seqs full-length sequences (see below)


def concurrency_blocks(
    max_num_seqs: int, max_model_len: int, block_size: int, window: SlidingWindow | None = None
) -> int:
    """The blocks the configured concurrency can use: (max_num_seqs + SPARE_SEQUENCES) sequences of
    max_model_len tokens, each rounded up to whole blocks (where every layer has a sliding window: each the
    blocks its window leaves it at once, if fewer).

    max_num_seqs full-length sequences are the most the running sequences can hold, so a pool of that
    size never preempts. The spare sequence's worth is for what lives beside them: a choices request's
    label rows take scratch blocks beyond its prompt, and the prefix cache keeps a long shared prompt
    (a few-shot preamble) even while the running sequences are at their longest."""
    per_seq = -(-max_model_len // block_size)
    if window is not None:
        per_seq = min(per_seq, window.held_blocks(block_size))
    return (max_num_seqs + SPARE_SEQUENCES) * per_seq


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def size_kv_pool(cfg: EngineConfig, model: AnyModel, dtype: torch.dtype, device: torch.device) -> int:
    """Number of KV blocks in the pool, logged with the reason for it.

    CUDA: total device memory x kv_watermark, less what is in use (the weights) and the measured peak
    activations of one full step, capped by kv_cache_gb; like vLLM, the pool fills what the watermark
    leaves. CPU: what the configured concurrency can use (`concurrency_blocks`), or kv_cache_gb when it
    is set; in either case at most the memory available at start-up (the weights are loaded by then) x
    kv_watermark, less the measured working memory of the largest step. On a CPU the pool is ordinary
    memory the machine shares with other work, and the prefix cache's least-recently-freed reuse touches
    every block in time, so a pool sized to the watermark ends up resident in full.
    """
    block_bytes = kv_bytes_per_token(model, dtype) * cfg.block_size
    gb_cap = None if cfg.kv_cache_gb is None else int(cfg.kv_cache_gb * 1024**3)
    if device.type == "cuda":
        peak = step = _peak_activation_bytes(cfg, model, device)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cfg.kv_watermark) - used - peak
        log.info(
            "GPU %.1f GiB total, %.1f used, %.2f activation peak", total / 2**30, used / 2**30, peak / 2**30
        )
    else:
        step = _cpu_step_bytes(cfg, model)
        available = int(psutil.virtual_memory().available)
        budget = int(available * cfg.kv_watermark) - step
        log.info("CPU memory %.1f GiB available, %.2f GiB for a step", available / 2**30, step / 2**30)
    weights = weight_bytes(model)
    if budget < block_bytes:
        raise ValueError(
            f"no room for the KV cache: kv_watermark {cfg.kv_watermark} leaves {budget} bytes, one block "
            f"needs {block_bytes} (per {_rank(cfg)}: weights {_size(weights)}, a step's activations {_size(step)}"
            + ("; a larger tensor_parallel_size splits them further)" if device.type == "cuda" else ")")
        )
    watermark_blocks = budget // block_bytes
    why_watermark = f"what kv_watermark {cfg.kv_watermark} leaves ({_size(budget)})"
    if device.type == "cuda":
        if gb_cap is not None and gb_cap // block_bytes < watermark_blocks:
            num_blocks, why = gb_cap // block_bytes, f"kv_cache_gb {cfg.kv_cache_gb}"
        else:
            num_blocks, why = watermark_blocks, why_watermark
    else:
        max_model_len = cfg.context_len(model.max_positions)
        window = SlidingWindow.of_layers(model.layer_windows, cfg.max_num_batched_tokens)
        need = concurrency_blocks(cfg.max_num_seqs, max_model_len, cfg.block_size, window)
        concurrency = (
            f"(max_num_seqs {cfg.max_num_seqs} + {SPARE_SEQUENCES}) x max_model_len {max_model_len:,} tokens"
        )
        if window is not None and need < concurrency_blocks(cfg.max_num_seqs, max_model_len, cfg.block_size):
            concurrency += f", each at most the {window.held_blocks(cfg.block_size)} blocks its window holds"
        wanted, why = need, concurrency
        if gb_cap is not None:
            wanted, why = gb_cap // block_bytes, f"kv_cache_gb {cfg.kv_cache_gb}"
            if wanted > need:
                why += f" ({concurrency} use {need:,} blocks; the rest serves the prefix cache only)"
        if wanted <= watermark_blocks:
            num_blocks, why = wanted, f"{why}; kv_watermark would allow {_size(budget)}"
        else:
            num_blocks = watermark_blocks
            why = f"{why_watermark}; {why} would take {wanted:,} blocks ({_size(wanted * block_bytes)})"
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: kv_cache_gb {cfg.kv_cache_gb} is under one block ({block_bytes} bytes)"
        )
    log.info("KV pool: %s blocks (%s) = %s", f"{num_blocks:,}", _size(num_blocks * block_bytes), why)
    log.info(
        "memory plan per %s: weights %s, KV %s, a step's activations %s; %s tokens in flight at most",
        _rank(cfg), _size(weights), _size(num_blocks * block_bytes), _size(step),
        f"{num_blocks * cfg.block_size:,}",
    )  # fmt: skip
    return int(num_blocks)


def weight_bytes(model: AnyModel) -> int:
    """The bytes of the model's weights on its device (this rank's share under tensor parallelism)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _rank(cfg: EngineConfig) -> str:
    return "rank" if cfg.tensor_parallel_size > 1 else "device"


FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_HEADROOM = 2.0  # K/V up to this multiple of the calibration's largest stay within range (beyond: clamped)
# Calibration text for FP8 scales: prose, a list, code and figures, to see K/V of ordinary prompts.
CALIBRATION_TEXT = (
    "Classify the sentiment of this review as positive, negative or neutral.\n"
    "Review: The battery lasts two days, the screen is sharp, but the speaker crackles at high volume.\n"
    "Answer: neutral\n\n"
    "Summarise the following report in one sentence. In 2025 the city opened 14 new libraries, "
    "recorded 3.2 million visits (up 11%) and lent 480,000 e-books; funding fell by 2.5%.\n\n"
    "def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs) if xs else 0.0\n\n"
    "Les montagnes étaient couvertes de neige; 北京是中国的首都。 1, 2, 3, 5, 8, 13, 21, 34.\n"
)


@torch.inference_mode()
def calibrate_kv_scales(model: AnyModel, ids: list[int], device: torch.device) -> list[tuple[float, float]]:
    """Per-layer scales of an FP8 KV cache: each layer's largest |K| and |V| over a prefill of `ids`
    (CALIBRATION_TEXT tokenised), times FP8_HEADROOM, mapped to FP8_MAX. A per-tensor scale keeps small
    values (V is often ~0.01) out of FP8's subnormals and large ones (K after RoPE) below 448.
    Sets each layer's k_scale / v_scale (model.set_kv_scales) and returns them."""
    t = min(len(ids), model.max_positions)
    caches, meta = _scratch_prefill(model, t, 16, device)
    model.set_kv_scales([(1.0, 1.0)] * model.spec.num_layers)  # observe K and V as they are
    ids_t = torch.tensor(ids[:t], device=device)
    observed = model.kv_absmax(ids_t, meta.slot_mapping, meta, caches, torch_backend())
    scales = [
        (max(kmax, 1e-6) * FP8_HEADROOM / FP8_MAX, max(vmax, 1e-6) * FP8_HEADROOM / FP8_MAX)
        for kmax, vmax in observed
    ]
    model.set_kv_scales(scales)
    return scales


def copy_kv_blocks(kv_caches: list[KVCache], axis: int, copies: list[tuple[int, int]]) -> None:
    """Copy each (source, destination) block's K/V in every layer, along the cache layout's block axis."""
    device = kv_caches[0][0].device
    src = torch.tensor([a for a, _ in copies], device=device)
    dst = torch.tensor([b for _, b in copies], device=device)
    for k, v in kv_caches:
        for cache in (k, v):
            raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # index ops on FP8
            raw.index_copy_(axis, dst, raw.index_select(axis, src))
