"""Engine configuration: which model, where it runs, how much KV memory, how big a step may be."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
BackendName = Literal["auto", "torch", "triton"]

DEFAULT_CPU_KV_CACHE_GB = 1.0


@dataclass
class EngineConfig:
    """Everything `Engine.load` needs. Validated in `__post_init__` so bad settings fail at start-up."""

    model: str  # local HF dir | .gguf file | hub id | alias "smollm2-135m"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (CUDA: bfloat16; CPU: the faster of float32 and bfloat16) | float32 | ...16
    block_size: int = 16
    kv_cache_gb: float | None = None  # explicit pool size; CPU default DEFAULT_CPU_KV_CACHE_GB
    kv_watermark: float = 0.9  # GPU: fraction of device memory usable by weights + activations + KV
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096  # token budget per step
    attention_backend: str = "auto"  # auto | torch | triton
    repetition_window: int = 10  # 0 switches loop detection off
    repetition_repeats: int = 3  # 0 switches loop detection off
    schedule_policy: str = "longest_first"  # fcfs | longest_first (see scheduler.py)
    max_model_len: int | None = None  # cap below the model's context length (None: the model's own)
    num_threads: int | None = None  # torch CPU threads (None: torch's default)
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs (CUDA + Triton backend only)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        if self.schedule_policy not in ("fcfs", "longest_first"):
            raise ValueError(f"schedule_policy must be fcfs or longest_first, got {self.schedule_policy!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if not 0.0 < self.kv_watermark <= 1.0:
            raise ValueError(f"kv_watermark must be in (0, 1], got {self.kv_watermark}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.repetition_window < 0 or self.repetition_repeats < 0:
            raise ValueError("repetition_window and repetition_repeats must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
