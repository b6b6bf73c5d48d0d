"""Random-weight Llama models built in memory, the token-id workload, and the three throughput contenders.

Used by gpu_check.py. Weights are random, so every contender generates fixed lengths (EOS ignored) and
prompts are token ids of the workload's lengths. An 8B checkpoint would take minutes to save and load;
instead the HF model is initialised on the GPU and the engine's decoder is filled from it in memory.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.workload import generate as workload_lines
from tests.tiny_models import byte_tokenizer
from worker.engine.engine import Engine
from worker.engine.kv_pool import size_kv_pool
from worker.engine.model_runner import ModelRunner
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig
from worker.kernels.backend import select_backend
from worker.models.layers import RotaryTable
from worker.models.llama import DecoderSpec, LlamaFamilyModel
from worker.models.loader import LoadedModel

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B-like (untied head) and Llama-3-8B.
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256),
    # Qwen3-0.6B's dimensions on the Llama architecture (no q/k norms: their cost is a rounding error here)
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000),
}  # fmt: skip


@dataclass
class Job:
    prompt_ids: list[int]
    max_new_tokens: int


class _WordCounter:
    """Stands in for a tokenizer in workload.generate: one token per word, so its length fitting yields
    prompts of the workload's target lengths (30-600) without a real tokenizer."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return " ".join(m["content"] for m in messages)

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": [0] * len(text.split())}


def workload(n: int, vocab: int, seed: int = 0, max_prompt: int = 600) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for line in workload_lines(n, seed, tokenizer=_WordCounter()):
        length = min(max_prompt, len(" ".join(m["content"] for m in line["messages"]).split()))
        jobs.append(Job([rng.randrange(3, vocab) for _ in range(max(1, length))], line["max_new_tokens"]))
    return jobs


def hf_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """A random-weight LlamaForCausalLM initialised directly on `device` (seconds, even for 8B)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        **SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.to(device).eval()  # a no-op unless from_config ignored the device context


def engine_from_hf(hf: Any, cfg: EngineConfig) -> Engine:
    """Engine.load, but from an HF model already in memory: our decoder is allocated empty on the
    device (no second random init) and filled from the HF weights."""
    device, dtype = hf.device, hf.dtype
    hcfg = hf.config
    spec = DecoderSpec.from_hf_config(hcfg, qk_norm=False, qkv_bias=False, o_bias=False)
    rope = hf.model.rotary_emb
    max_len = int(hcfg.max_position_embeddings)
    rotary = RotaryTable(rope.inv_freq.float().cpu(), float(rope.attention_scaling), max_len).to(device)
    model = LlamaFamilyModel.empty(spec, rotary, dtype, device)
    model.load_weights(hf.state_dict().items())
    model.eval()
    loaded = LoadedModel("random-" + str(spec.hidden_size), model, byte_tokenizer(), hcfg, [2], max_len, "")
    backend = select_backend(cfg, device, dtype)
    model.use_backend(backend)
    num_blocks = size_kv_pool(cfg, model, dtype, device)
    context = cfg.context_len(max_len)
    runner = ModelRunner(
        model, backend, num_blocks, cfg.block_size, device, dtype,
        max_model_len=context, max_num_seqs=cfg.max_num_seqs, cuda_graphs=cfg.cuda_graphs,
    )  # fmt: skip
    return Engine(cfg, loaded, runner, num_blocks, context)


@torch.inference_mode()
def quantize_rtn(engine: Engine, bits: int = 4, group: int = 128) -> int:
    """Every projection of the engine's model (the LM head stays) kept quantised in place, min-max per group
    of `group` input rows (float16 s and o), as a GPTQ/AWQ checkpoint would be held. Returns the layers."""
    model = engine.model_runner.model
    assert isinstance(model, LlamaFamilyModel)
    layers = [lin for lin in model.linears() if lin is not model.lm_head]
    top = (1 << bits) - 1
    for lin in layers:
        w = lin.dequantized(torch.float32)
        n, k = w.shape
        wg = w.view(n, k // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        sc = ((hi - lo) / top).clamp_min(1e-8)
        z = torch.round(-lo / sc)
        q = torch.clamp(torch.round(wg / sc[..., None]) + z[..., None], 0, top).view(n, k)
        q = q.to(torch.uint8) if bits == 4 else (q - 128).to(torch.int8)
        off = sc * (z if bits == 4 else z - 128)
        lin.load_groups(q, sc.half(), off.half(), group, bits)
    model._stack = None
    return len(layers)


def run_engine(engine: Engine, jobs: list[Job], budget_s: float) -> dict[str, Any]:
    """Continuous batching over every job; stops early (partial=True) when the budget runs out."""

    def reqs(js: list[Job], tag: str) -> list[EngineRequest]:
        out = []
        for i, j in enumerate(js):
            p = GenerationParams(max_new_tokens=j.max_new_tokens, temperature=0, ignore_eos=True)
            out.append(EngineRequest(f"{tag}{i}", p, prompt_token_ids=j.prompt_ids))
        return out

    engine.generate(reqs(jobs[:8], "warm"))  # Triton prefill variants, cuBLAS handles
    for r in reqs(jobs, "r"):
        engine.add_request(r)
    before = engine.stats().tokens_generated
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    done = 0
    while engine.has_work() and time.perf_counter() < deadline:
        done += len(engine.step())
    wall = time.perf_counter() - t0
    tokens = engine.stats().tokens_generated - before
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "requests_done": done,
            "partial": done < len(jobs), "max_num_seqs": engine.cfg.max_num_seqs,
            "cuda_graphs": engine.model_runner.graphs is not None}  # fmt: skip


@torch.inference_mode()
def run_hf_generate(hf: Any, jobs: list[Job], batch_sizes: list[int], budget_s: float) -> dict[str, Any]:
    """Static batches in workload order, left-padded; each batch decodes to its longest request, but only
    the tokens each request asked for count. Best batch size wins; each size gets a share of the budget."""
    device = hf.device
    best: dict[str, Any] = {"tok_s": 0.0}
    per_size = budget_s / len(batch_sizes)
    _hf_batch(hf, jobs[:2], device)  # warm-up
    for bs in batch_sizes:
        t0 = time.perf_counter()
        tokens = done = 0
        for s in range(0, len(jobs), bs):
            batch = jobs[s : s + bs]
            _hf_batch(hf, batch, device)
            tokens += sum(j.max_new_tokens for j in batch)
            done += len(batch)
            if time.perf_counter() - t0 > per_size:
                break
        wall = time.perf_counter() - t0
        if tokens / wall > best["tok_s"]:
            best = {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "batch_size": bs,
                    "requests_done": done, "partial": done < len(jobs)}  # fmt: skip
    return best


def _hf_batch(hf: Any, batch: list[Job], device: torch.device) -> None:
    width = max(len(j.prompt_ids) for j in batch)
    ids = torch.tensor([[0] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch], device=device)
    mask = torch.tensor(
        [[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in batch], device=device
    )
    new = max(j.max_new_tokens for j in batch)
    out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                pad_token_id=0)  # fmt: skip
    assert out.shape[1] == width + new, "HF generate stopped early; every request must run to its length"


def run_hf_continuous(hf: Any, jobs: list[Job], budget_s: float) -> dict[str, Any]:
    """transformers' own continuous batching (the manager behind model.generate_batch), fed per-request
    lengths with EOS off; stops collecting when the budget runs out."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(j.max_new_tokens for j in jobs), eos_token_id=-1
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(j.prompt_ids) for j in jobs),
        max_generated_length=gen.max_new_tokens,
        num_requests=len(jobs),
    )
    with hf.continuous_batching_context_manager(
        generation_config=gen, timeout=5, workload_hints=hints
    ) as mgr:
        t0 = time.perf_counter()
        for i, j in enumerate(jobs):
            mgr.add_request(
                j.prompt_ids, request_id=f"r{i}", max_new_tokens=j.max_new_tokens, eos_token_id=-1
            )
        tokens = done = 0
        while done < len(jobs) and time.perf_counter() - t0 < budget_s:
            res = mgr.get_result(timeout=1)
            if res is not None and res.is_finished():
                done += 1
                tokens += len(res.generated_tokens)
            elif res is None and not mgr.is_running():
                raise RuntimeError("the continuous batching thread died")
        wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "requests_done": done,
            "partial": done < len(jobs)}  # fmt: skip
