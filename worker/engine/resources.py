"""Device, dtype and KV-pool sizing decisions, made once at start-up."""

from __future__ import annotations

import ctypes
import logging
import os
import time

import torch

from worker.engine.config import DEFAULT_CPU_KV_CACHE_GB, EngineConfig
from worker.engine.model_runner import kv_bytes_per_token
from worker.models.layers import AttentionMetadata
from worker.models.llama import LlamaFamilyModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


# auto on CPU takes bfloat16 only where its matmuls are clearly faster than float32 (AMX, Zen 4): on
# CPUs that merely convert bf16 (AVX512-BF16 without AMX) bf16 GEMMs are slower and float32 is exact.
BF16_MIN_SPEEDUP = 1.3


def gemm_flops(dtype: torch.dtype, n: int = 1024, reps: int = 4) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on the CPU (one warm-up, best of `reps`)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def cpu_auto_dtype() -> torch.dtype:
    """bfloat16 when its GEMMs run BF16_MIN_SPEEDUP x faster than float32 here, else float32."""
    if not torch.backends.mkldnn.is_available():
        return torch.float32
    f32, bf16 = gemm_flops(torch.float32), gemm_flops(torch.bfloat16)
    choice = torch.bfloat16 if bf16 >= BF16_MIN_SPEEDUP * f32 else torch.float32
    log.info(
        "dtype auto: CPU matmul %.0f GFLOP/s float32, %.0f bfloat16 -> %s",
        f32 / 1e9,
        bf16 / 1e9,
        str(choice).removeprefix("torch."),
    )
    return choice


# oneDNN, which runs bf16 matmuls on the CPU, JIT-compiles a kernel per matmul shape and keeps up to
# 1024 of them (its primitive cache, and ideep's LRU cache in front of it), about 0.9 MB each. Serving
# meets new shapes nearly every step (token counts, sequence counts, context lengths): a worker's RSS
# grew by 700 MB over one 256-request bf16 run. 128 entries still hold a whole step's shapes, so every
# layer after the first reuses them (32 entries cost 15% of the run's speed). oneDNN reads these once,
# at its first matmul in the process; a value already in the environment wins.
ONEDNN_CACHE_CAPACITY = 128


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's per-shape kernel caches. Only effective before the process's first bf16 matmul."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


# glibc hands every freed block above its mmap threshold back to the kernel, and trims the heap's top
# once 128 KB are free there. A CPU step's large temporaries (a 4096-token prefill's 25 MB MLP
# activations, the logits) are then page-faulted in again, zero-filled, every time they are allocated:
# ~12% of a bf16 prefill step on 2 Zen 5 cores (benchmarks/profile_engine.py). Keeping freed memory
# in the heap lets the next step reuse it; RSS holds at the step's high-water mark instead.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = 1 << 30


def keep_freed_memory(limit: int = KEEP_FREED_BYTES) -> bool:
    """Tell glibc's malloc to keep freed blocks of up to `limit` bytes for reuse. False off glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # The mmap threshold first: setting either fixes both, and a trim threshold alone would leave the
    # mmap threshold at 128 KB, where every large block is mapped and faulted in afresh.
    if mallopt(M_MMAP_THRESHOLD, limit) != 1:
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, limit) == 1)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA; on CPU the faster of float32 and bfloat16 (see cpu_auto_dtype)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else cpu_auto_dtype()
    return _DTYPES[name]


@torch.inference_mode()
def _peak_activation_bytes(cfg: EngineConfig, model: LlamaFamilyModel, device: torch.device) -> int:
    """Run a dummy prefill of one full token budget (with a one-block scratch cache) and measure its peak."""
    from worker.kernels.backend import torch_backend

    s = model.spec
    dtype = model.lm_head.weight.dtype
    t = min(cfg.max_num_batched_tokens, model.rotary.cos.shape[0])
    nblk = -(-t // cfg.block_size)
    backend = torch_backend()
    shape = backend.kv_cache_shape(nblk, cfg.block_size, s.num_kv_heads, s.head_dim)
    caches = [(torch.empty(shape, dtype=dtype, device=device),) * 2 for _ in range(s.num_layers)]
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(t, dtype=torch.long, device=device)
    pos = torch.arange(t, device=device)
    meta = AttentionMetadata(
        phase="prefill",
        slot_mapping=pos,
        block_tables=torch.arange(nblk, dtype=torch.int32, device=device).unsqueeze(0),
        context_lens=torch.tensor([t], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=device),
    )
    hidden = model(ids, pos, meta, caches, backend)
    model.compute_logits(hidden[-cfg.max_num_seqs :])
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, hidden
    torch.cuda.empty_cache()
    return int(peak)


def size_kv_pool(cfg: EngineConfig, model: LlamaFamilyModel, dtype: torch.dtype, device: torch.device) -> int:
    """Number of KV blocks: explicit kv_cache_gb, else (GPU) free memory × watermark after weights and
    peak activations, else (CPU) DEFAULT_CPU_KV_CACHE_GB."""
    block_bytes = kv_bytes_per_token(model, dtype) * cfg.block_size
    if cfg.kv_cache_gb is not None:
        budget = int(cfg.kv_cache_gb * 1024**3)
    elif device.type == "cuda":
        peak = _peak_activation_bytes(cfg, model, device)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cfg.kv_watermark) - used - peak
        log.info(
            "GPU %.1f GiB total, %.1f used, %.2f activation peak", total / 2**30, used / 2**30, peak / 2**30
        )
    else:
        budget = int(DEFAULT_CPU_KV_CACHE_GB * 1024**3)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"no room for the KV cache: budget {budget} bytes, one block needs {block_bytes}")
    return int(num_blocks)
