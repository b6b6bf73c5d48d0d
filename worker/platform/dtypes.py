"""The engine's element types, decided once at load: what the model computes in, what its linear weights and
KV cache store, and the dtype its results name."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine_config import KVCacheDtype, WeightDtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Dtypes:
    """requested: the dtype as asked, or auto's choice; results name it. compute: what the model computes in.
    storage: a narrower type the linear weights and the KV cache keep (a CPU's batch-invariant bfloat16 or
    float16, computed in float32 by the C kernels); None: compute's."""

    requested: torch.dtype
    compute: torch.dtype
    storage: torch.dtype | None = None

    @property
    def name(self) -> str:
        """The requested dtype's name: a CPU's invariant bfloat16 computes in float32 outside its bf16
        storage and products, and is still the bfloat16 engine."""
        return str(self.requested).removeprefix("torch.")

    def for_model(self, implementation: str) -> Dtypes:
        """Hugging Face's layers (the transformers fallback) compute in the dtype asked: no narrow storage."""
        return self if implementation == "native" else Dtypes(self.requested, self.requested)

    def kv_cache(self, name: KVCacheDtype) -> torch.dtype:
        """The KV pool's element type: auto = the storage type, else the compute dtype."""
        auto = self.storage or self.compute
        return auto if name == "auto" else {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn}[name]

    def weights(self, name: WeightDtype, device: torch.device) -> torch.dtype:
        """The linear weights' storage: auto = the compute dtype, or the narrow storage (bfloat16; float32
        for float16). A narrower one (bfloat16, int8) only on a CPU with float32 compute, where the C linear
        kernel widens it as it reads."""
        storage = self.storage
        auto = self.compute if storage is None else (storage if storage == torch.bfloat16 else torch.float32)
        want = auto if name == "auto" else {**DTYPES, "int8": torch.int8}[name]
        if want != self.compute and (device.type != "cpu" or self.compute != torch.float32):
            compute = str(self.compute).removeprefix("torch.")
            raise ValueError(
                f"weight_dtype {name} needs a CPU with float32 compute (dtype = 'float32'); this engine "
                f"computes in {compute} on {device.type}: use weight_dtype = 'auto'"
            )
        return want
