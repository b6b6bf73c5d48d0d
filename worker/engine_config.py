"""Engine configuration: which model, where it runs, how much KV memory, how big a step may be.

One pydantic model, validated once when it is built (from code, or nested in the worker's config that
`worker.config` reads from TOML and flags). Every setting and its default is defined here only. It lies
below the engine and everything the engine composes (platform, kernels, models), which all read it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "torch", "triton"]
CpuKernels = Literal["auto", "torch"]
SchedulePolicy = Literal["fcfs", "longest_first"]
Admission = Literal["optimistic", "reserve"]
KVCacheDtype = Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3"]
WeightDtype = Literal["auto", "float32", "bfloat16", "int8"]
ModelImpl = Literal["auto", "native", "transformers"]
ReasoningParser = Literal["auto", "none", "think", "harmony"]
Pooling = Literal["last", "mean"]  # how an embedding request's hidden states become its vector


class EngineConfig(BaseModel):
    """Everything `Engine.load` needs. Bad values fail here, at start-up, naming the setting."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    model: str = Field(
        default="smollm2-135m",
        min_length=1,
        description="local HF checkpoint dir | .gguf file | hub id | alias 'smollm2-135m'",
    )
    model_impl: ModelImpl = Field(
        default="auto",
        description="which code runs the model. auto: batchq's own decoder for its native families (llama, "
        "mistral, qwen2, qwen3, granite, olmo2, phi3), any other decoder-only *ForCausalLM through transformers "
        "(Hugging Face's own layers with batchq's paged attention: exact and continuously batched, slower, no "
        "C linear kernels, weight_dtype auto only); native: refuse a model without a native path; "
        "transformers: the fallback even for a native family",
    )
    device: Device = "auto"
    dtype: Dtype = Field(
        default="auto",
        description="auto: bfloat16 on CUDA; on a CPU bfloat16 where it has AVX-512 BF16, else float32 (with "
        "batch_invariant off: bfloat16 where its matmuls run >= 1.3x faster). On a CPU under batch_invariant, "
        "bfloat16 / float16 store the weights (bfloat16 only) and the KV cache narrow and compute in float32 in "
        "the C kernels, but for bfloat16 products in the linears where AVX-512 BF16 exists",
    )
    batch_invariant: bool = Field(
        default=True,
        description="a request's numbers (logits, label scores, logprobs, embeddings, greedy tokens) never "
        "depend on what shares its step: no kernel, split or code path is chosen by a step's rows. CPU: "
        "float32 arithmetic in the C kernels (never oneDNN's bf16 GEMM), decode attention per sequence (no "
        "cascade over a shared prefix); CUDA: fixed-tile Triton GEMMs and RMSNorm, a fixed KV split for "
        "decode. false: the fastest kernels, whose rounding may follow the batch",
    )
    attention_backend: AttentionBackendName = Field(
        default="auto", description="auto: Triton kernels on CUDA where they import, else torch"
    )
    cpu_kernels: CpuKernels = Field(
        default="auto",
        description="auto: the CPU kernels in C (decode attention; under float32 compute also the linear "
        "layers, RMSNorm and rotary), compiled at load where a C compiler builds them, else torch (one warning "
        "says why); torch: torch ops only, nothing compiled (weight_dtype then takes auto only)",
    )
    decode_stack: bool = Field(
        default=True,
        description="run each CPU decode step whole, every layer in one C call (decode_stack.c), where it "
        "applies (float32 compute, cpu_kernels auto, no shared prefix for cascade attention); off: layer by "
        "layer, the same kernels with torch ops between them",
    )
    block_size: int = Field(default=16, ge=1, description="tokens per KV block")
    kv_cache_gb: float | None = Field(
        default=None,
        gt=0,
        description="size of the KV pool in GB, at most what kv_watermark leaves. Default: CUDA, what "
        "kv_watermark leaves; CPU, what max_num_seqs + 1 sequences of max_model_len tokens can use. Set it to "
        "share a machine between workers (or, on a CPU, to give the prefix cache more room)",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        default="auto",
        description="element type of the KV pool; auto: the compute dtype. bfloat16 under float32 compute "
        "halves the pool's bytes per token (twice the sequences) and decode's K/V reads, fp8_e4m3 quarters "
        "them (per-layer scales calibrated at load); K/V are rounded as they are written and attention "
        "still computes in the compute dtype (torch/C path; the Triton kernels take auto only)",
    )
    weight_dtype: WeightDtype = Field(
        default="auto",
        description="storage of the linear layers' weights; auto: the compute dtype. CPU with float32 compute "
        "only: bfloat16 halves the bytes a decode step streams, int8 (a scale per output row) quarters them; "
        "the C linear kernel widens them to float32 as it reads (bfloat16 on CPUs with fast bf16 GEMMs: prompt "
        "steps take oneDNN's bf16 GEMM). Both change outputs slightly",
    )
    kv_watermark: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="CUDA: share of the device's total memory for weights, peak activations and the KV pool "
        "(the pool fills it); CPU: share of the memory available at start-up for the largest step and the KV "
        "pool (an upper bound: the pool is sized by (max_num_seqs + 1) x max_model_len tokens, or kv_cache_gb)",
    )
    max_num_seqs: int = Field(default=64, ge=1, description="sequences decoded together at most")
    max_num_batched_tokens: int = Field(
        default=4096,
        ge=1,
        description="token budget of one step: a token per decoding sequence, the rest for prompt chunks",
    )
    admission: Admission = Field(
        default="optimistic",
        description="optimistic: admit on expected growth, preempt (and recompute) when the pool runs out; "
        "reserve: reserve every request's worst case, never preempt (see scheduler.py)",
    )
    prefix_cache: bool = Field(
        default=True, description="reuse the K/V of prompt blocks already computed (automatic prefix caching)"
    )
    repetition_window: int = Field(default=10, ge=0, description="loop detection window in tokens (0: off)")
    repetition_repeats: int = Field(
        default=3, ge=0, description="windows repeated in a row that end a loop (0: off)"
    )
    schedule_policy: SchedulePolicy = Field(
        default="longest_first", description="admission order of waiting requests (see scheduler.py)"
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="cap below the model's context length (default: the model's own)"
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU threads (default: the cores of the affinity mask, cut to the cgroup quota)",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="ranks the model is split over (tensor parallelism): one process each, rank 0 the engine's "
        "own; gloo on a CPU, NCCL on GPUs. For a model no single device holds",
    )
    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="tensor parallelism: how long a rank waits for the others in one collective before the "
        "group is taken down (a rank that died is seen at once)",
    )
    cuda_graphs: bool = Field(default=True, description="capture decode steps as CUDA graphs (CUDA + Triton)")
    async_scheduling: bool = Field(
        default=True,
        description="overlap the host's work with the model's: while a decode step runs (on a device thread), "
        "the next is scheduled and launched, its input tokens taken from the running step's without waiting "
        "for them, and the step before's tokens go through the stop rules. Only where every running request "
        "is plain (no grammar, choices, logprobs, penalties, reasoning, embeddings) and none can be admitted; "
        "a stop rule then ends a request a step late, its extra token discarded. Outputs are the serial "
        "engine's, token for token. Beside CUDA graphs too: a graphed step takes its input ids on the device",
    )
    reasoning_parser: ReasoningParser = Field(
        default="auto",
        description="how a reasoning model marks its thinking in chat requests (returned as reasoning_content, "
        "apart from the answer). auto: harmony where the vocabulary has gpt-oss's channel tokens, think "
        "where the vocabulary has <think> and </think> tokens (Qwen3, DeepSeek-R1 distills, Phi-4-reasoning), "
        "else none; none: the thinking stays in the text",
    )
    embedding_pooling: Literal["auto", "last", "mean"] = Field(
        default="auto",
        description="how /v1/embeddings requests pool the final hidden states: auto: as the checkpoint's "
        "sentence-transformers config says (modules.json, 1_Pooling/config.json), else the last token (as "
        "Qwen3-Embedding and other decoder embedders do); last; mean (over every input token)",
    )
    lora: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters served over the model: name -> PEFT adapter folder (adapter_config.json and "
        "adapter_model.safetensors), read and checked at load. A request names one in `model` or `lora`",
    )
    lora_dir: str | None = Field(
        default=None,
        description="a folder of PEFT adapter folders, each served under its folder's name, read on first use",
    )
    max_loras: int = Field(default=4, ge=1, description="LoRA adapters resident at once (least recently used "
                           "leaves first); a step mixes the base model and every resident adapter")  # fmt: skip
    max_lora_rank: int = Field(default=64, ge=1, description="the highest LoRA rank an adapter may have")

    @model_validator(mode="after")
    def _budget_holds_every_decode_row(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every decoding sequence takes one token of a step's budget"
            )
        return self

    def context_len(self, model_context: int) -> int:
        """The longest sequence (prompt + output) the engine serves: the model's, capped by max_model_len."""
        return min(model_context, self.max_model_len or model_context)
