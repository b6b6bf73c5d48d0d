"""The parts of Engine.load that are the engine's own, beside the platform's and the loader's: the weights
stored as the dtypes say, the KV cache's element type, whether batch invariance holds with the kernels
chosen, what the sliding windows do to the pool, and the fingerprint of everything that decides the
engine's outputs."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import torch

from worker.engine.block_manager import BlockManager
from worker.engine.fingerprint import engine_fingerprint, tokenizer_digest, weights_digest
from worker.engine.kv_pool import CALIBRATION_TEXT, calibrate_kv_scales
from worker.engine.kv_window import SlidingWindow
from worker.engine.model_runner import ModelRunner
from worker.engine.reasoning import ReasoningMarkers
from worker.engine_config import EngineConfig
from worker.kernels.backend import Backend, select_backend
from worker.models.loader import LoadedModel, load_model
from worker.parallel.group import TPGroup
from worker.platform import Dtypes, Platform

log = logging.getLogger(__name__)


def build_model(
    cfg: EngineConfig, platform: Platform, dtypes: Dtypes, tp: TPGroup | None = None
) -> tuple[LoadedModel, Dtypes, Backend]:
    """The model loaded (this rank's share under tensor parallelism), its weights stored as the dtypes
    say and prepared for the backend chosen for it; -> the model, the dtypes as they apply to it, the
    backend."""
    device = platform.device
    loaded = load_model(
        cfg.model, dtypes.compute, device, cfg.model_impl, fallback_dtype=dtypes.requested, tp=tp
    )  # Hugging Face's layers (the fallback) are not batch-invariant in any dtype: they compute in the one asked
    dtypes = dtypes.for_model(loaded.implementation)
    weight_dtype = dtypes.weights(cfg.weight_dtype, device)
    platform.after_load()
    backend = select_backend(
        cfg,
        device,
        dtypes.compute,
        weight_dtype,
        fast_bf16_gemm=platform.fast_bf16_gemm(cfg, weight_dtype),
        bf16_dot=dtypes.storage == torch.bfloat16,
        linear_tuning=platform.linear_tuning,
    ).for_model(loaded.model)
    store_weights(cfg, loaded, backend, dtypes, weight_dtype)
    loaded.model.use_backend(backend)
    return loaded, dtypes, backend


def batch_invariant_here(backend: Backend, loaded: LoadedModel) -> bool:
    """Whether the kernels chosen hold batch invariance (cfg.batch_invariant asks for it); the load log
    says why where they cannot."""
    why = None
    if loaded.implementation != "native":
        why = "the model runs Hugging Face's own layers (the transformers fallback), whose GEMMs pick kernels by row count"
    elif backend.name == "triton" and not getattr(backend.linear, "invariant", False):
        why = "its linear layers run cuBLAS (F.linear), which picks kernels by row count"
    elif backend.name != "triton" and backend.linear.name != "c":
        why = "its linear layers run torch's GEMMs (no C kernels here), which pick kernels by row count"
    if why is not None:
        log.warning("batch_invariant: not held by this engine: %s; a request's numbers may depend on what "
                    "shares its step", why)  # fmt: skip
    return why is None


def store_weights(
    cfg: EngineConfig,
    loaded: LoadedModel,
    backend: Backend,
    dtypes: Dtypes,
    weight_dtype: torch.dtype,
) -> None:
    """The linear weights stored as weight_dtype where it differs from the compute dtype (linear.c reads
    them), a quantised checkpoint's dequantised where no kernel here runs it as stored. A narrow storage
    that weight_dtype auto took from the dtypes is dropped quietly where it cannot apply (a quantised
    checkpoint, Hugging Face's layers)."""
    dtype = dtypes.compute
    quantised = loaded.model.quantised_linears()
    if (
        dtypes.storage is not None
        and cfg.weight_dtype == "auto"
        and (quantised or loaded.implementation != "native")
    ):
        weight_dtype = dtype
    if weight_dtype != dtype:
        if loaded.implementation == "transformers":
            loaded.model.quantize_weights(weight_dtype)  # raises: it has no narrower weights
        if backend.linear.name != "c":
            why = "cpu_kernels = 'torch'" if cfg.cpu_kernels == "torch" else "the warning above says why"
            raise ValueError(
                f"weight_dtype {cfg.weight_dtype} needs the C linear kernel, unavailable here ({why}): use "
                "weight_dtype = 'auto'"
            )
        loaded.model.quantize_weights(weight_dtype)
        log.info("linear weights stored as %s", weight_dtype)
    if quantised and backend.linear.name == "torch":
        loaded.model.dequantize_weights(dtype)  # torch's F.linear would dequantise them every step
        log.info("%d quantised linear layers dequantised to %s (no kernel here runs them as stored)",
                 len(quantised), str(dtype).removeprefix("torch."))  # fmt: skip


def kv_cache_dtype(
    cfg: EngineConfig, loaded: LoadedModel, backend: Backend, dtypes: Dtypes, device: torch.device
) -> torch.dtype:
    """The KV pool's element type; an FP8 cache's per-layer scales calibrated on a short text first."""
    kv_dtype = dtypes.kv_cache(cfg.kv_cache_dtype)
    if backend.name == "triton" and kv_dtype != dtypes.compute:
        raise ValueError(
            f"kv_cache_dtype {cfg.kv_cache_dtype} with {dtypes.compute} compute: the Triton kernels read a "
            "cache of the compute dtype only; use kv_cache_dtype = 'auto' or attention_backend = 'torch'"
        )
    if kv_dtype == torch.float8_e4m3fn:
        ids = loaded.tokenizer(CALIBRATION_TEXT, add_special_tokens=False).input_ids
        scales = calibrate_kv_scales(loaded.model, ids, device)
        log.info("FP8 KV cache: K/V scales per layer %s", [f"{k:.3g}/{v:.3g}" for k, v in scales])
    return kv_dtype


def engine_fingerprint_of(
    loaded: LoadedModel,
    model_runner: ModelRunner,
    cfg: EngineConfig,
    eos_token_ids: list[int],
    max_model_len: int,
    compute_dtype: torch.dtype,
    batch_invariant: bool,
    reasoning: ReasoningMarkers | None,
) -> str:
    """The engine's fingerprint (fingerprint.engine_fingerprint) from its loaded parts."""
    backend = model_runner.backend
    tp = cfg.tensor_parallel_size
    return engine_fingerprint(
        weights_digest(loaded.model),
        tokenizer=tokenizer_digest(loaded.tokenizer),
        kv_dtype=str(model_runner.kv_caches[0][0].dtype),
        device=model_runner.device.type,
        attention=backend.name,
        native_decode=backend.c_decode,
        native_linear=loaded.model.uses_c_linear,
        native_stack=backend.decode_stack,
        bf16_gemm_rows=backend.bf16_gemm_rows,
        # the compute dtype apart from the weights' and the KV cache's (a CPU's invariant bfloat16
        # stores narrow and computes in float32), and whether the kernels follow the batch
        compute_dtype=str(compute_dtype),
        batch_invariant=batch_invariant,
        # bfloat16 products (linear_bf16dot.c) round x where float32 arithmetic on bf16 weights does not;
        # only such engines add the key
        **({"bf16_products": True} if backend.linear.bf16_dot else {}),
        eos=sorted(eos_token_ids),
        repetition=[cfg.repetition_window, cfg.repetition_repeats],
        max_model_len=max_model_len,
        # Hugging Face's layers round differently from ours; only the fallback adds the key, so native
        # engines keep the fingerprints (and cached results) they had
        **({"implementation": loaded.implementation} if loaded.implementation != "native" else {}),
        # results of a reasoning model carry the split; engines without a parser keep their fingerprints
        **({"reasoning": reasoning.kind} if reasoning is not None else {}),
        # a model split over ranks sums its row-parallel outputs in another order (and hashes one share
        # of its weights); unsplit engines keep their fingerprints
        **({"tensor_parallel": tp} if tp > 1 else {}),
        # an image-text model's vision side decides its image requests' answers; text models add no key
        **({"vision": vision_digest(loaded.vision)} if loaded.vision is not None else {}),
    )


def vision_digest(vision: Any) -> list[str]:
    """The vision side's weights (sampled as the decoder's are) and its image processor's settings."""
    settings = orjson.dumps(vision.settings, option=orjson.OPT_SORT_KEYS).decode()
    return [*(weights_digest(m) for m in vision.modules()), settings]


def log_windows(windows: tuple[int | None, ...], window: SlidingWindow | None, bm: BlockManager) -> None:
    """What the model's sliding windows do to the KV pool, at load."""
    windowed = [w for w in windows if w is not None]
    if window is not None:
        log.info(
            "sliding window %d in every layer: a sequence's blocks before it go back to the pool as it "
            "advances; one holds at most %d blocks at once", window.tokens, window.held_blocks(bm.block_size),
        )  # fmt: skip
    elif windowed:
        log.info(
            "sliding windows in %d of %d layers: their blocks stay while the full-attention layers read them "
            "(one block table for every layer); per-layer tables would free %d/%d of an idle block's bytes",
            len(windowed), len(windows), len(windowed), len(windows),
        )  # fmt: skip
