"""Compile every Triton kernel for Hopper (sm_90) down to a cubin, with no GPU needed.

The interpreter accepts code the compiler rejects (plain globals in jit code, loop-carried values that
change type, bad dot shapes), so the CPU tests alone would miss those. Run as a script in a process
without TRITON_INTERPRET: `python -m tests.kernels.hopper_compile`.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from worker.kernels import triton_cache, triton_decode, triton_prefill

HOPPER = GPUTarget("cuda", 90, 32)
INDEX_ARGS = ("block_tables_ptr", "context_lens_ptr", "cu_seqlens_ptr", "slot_ptr")


def signature(fn: triton.JITFunction, dtype: str, constexprs: dict[str, object]) -> dict[str, str]:
    # Pointers to index tensors are int32, partial results fp32, other pointers `dtype`; scalars by name.
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INDEX_ARGS:
            sig[name] = "*i32"
        elif name.startswith("part_") or name == "sinks_ptr":
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name in ("scale_log2", "softcap_log2") else "i32"
    return sig


def compile_for_hopper(fn: triton.JITFunction, dtype: str, constexprs: dict[str, object]) -> None:
    src = ASTSource(fn, signature(fn, dtype, constexprs), constexprs)
    kernel = triton.compile(src, target=HOPPER, options={"num_warps": 4, "num_stages": 2})
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"


def main() -> None:
    # (windowed, soft-capped): plain, and both a layer's variants on (Gemma 2's local layers)
    for dtype in ("bf16", "fp32"):
        precision = "ieee" if dtype == "fp32" else "tf32"
        for windowed, softcap in ((False, False), (True, True)):
            variant = {"WINDOWED": windowed, "SOFTCAP": softcap, "SINKS": windowed}  # gpt-oss: sinks, windows
            for splits in (1, 4):
                compile_for_hopper(
                    triton_decode.decode_kernel, dtype,
                    {"HEADS": 32, "BLOCK_SIZE": 16, "GROUP": 4, "BLOCK_H": 16, "HEAD_DIM": 128, "BLOCK_N": 64,
                     "NUM_SPLITS": splits, "DOT_PRECISION": precision, "UPCAST": False, **variant},
                )  # fmt: skip
            compile_for_hopper(
                triton_prefill.prefill_kernel, dtype,
                {"HEADS": 9, "BLOCK_SIZE": 16, "GROUP": 3, "HEAD_DIM": 64, "BLOCK_M": 64, "BLOCK_Q": 21,
                 "BLOCK_N": 64, "DOT_PRECISION": precision, "UPCAST": False, **variant},
            )  # fmt: skip
        compile_for_hopper(
            triton_decode.decode_merge_kernel,
            dtype,
            {"HEADS": 32, "HEAD_DIM": 128, "NUM_SPLITS": 4, "SPLITS_PAD": 4, "SINKS": True},
        )
        compile_for_hopper(
            triton_cache.write_kv_kernel, dtype, {"KV_HEADS": 3, "KV_HEADS_PAD": 4, "HEAD_DIM": 64}
        )
    print("all kernels compiled for sm_90")


if __name__ == "__main__":
    main()
