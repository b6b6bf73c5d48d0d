"""The CPU attention path (worker/kernels/cpu.py) matches the torch reference over the kernel grid.

The CPU path keeps its cache kv-head-major; the cases are built in the reference layout and permuted.
Garbage (huge values and NaN) fills every slot no sequence owns, so a wrong block, a read past a
context or an unmasked padded row shows up as NaN or a wrong softmax.
"""

from __future__ import annotations

import math
import platform
from pathlib import Path

import pytest
import torch

from tests.kernels.paged_cases import (
    GRID,
    Case,
    assert_close,
    bf16,
    build_cache,
    f32,
    garbage_cache,
    random_queries,
)
from tests.kernels.test_triton_decode import decode_lengths
from tests.kernels.test_triton_prefill import prefill_lengths
from worker.kernels import native_attention, native_build, reference
from worker.kernels.causal_tiles import causal_tiles
from worker.kernels.torch_attention import TorchAttention, length_groups

CPU = torch.device("cpu")


def cpu_layout(cache: torch.Tensor) -> torch.Tensor:
    # [num_blocks, block_size, kv_heads, head_dim] -> [kv_heads, num_blocks, block_size, head_dim]
    return cache.permute(2, 0, 1, 3).contiguous()


@pytest.mark.parametrize(
    ("native", "workspace_bytes"),
    [(True, 64 << 20), (False, 64 << 20), (False, 1)],
    ids=["c-kernel", "torch-workspace", "torch-one-seq-per-gather"],
)
@pytest.mark.parametrize("case", GRID, ids=str)
def test_decode_matches_reference(case: Case, native: bool, workspace_bytes: int) -> None:
    gen = torch.Generator().manual_seed(case.seed)
    # Lengths in several groups (1, blocks, 2,000) plus duplicates that share a group.
    lens = [*decode_lengths(case, gen), 5, case.block_size * 4 + 2, 1999]
    cache = build_cache(case, lens, gen, CPU)
    q = random_queries(case, len(lens), gen, CPU)
    scale = 1 / math.sqrt(case.head_dim)
    attn = TorchAttention(workspace_bytes=workspace_bytes, native=native)
    if native and not native_attention.supports(q, cache.k_cache):
        # Only a missing compiler may send the C-kernel case to the torch path; a shape must not.
        assert case.dtype not in (torch.float32, torch.bfloat16) or native_attention.library() is None
        pytest.skip(f"the C kernel does not take {case} here (compiler: {native_build.compiler()})")

    got = attn.paged_decode_attention(
        q, cpu_layout(cache.k_cache), cpu_layout(cache.v_cache), cache.block_tables, cache.context_lens, scale
    )

    want = reference.paged_decode_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale
    )
    assert_close(got, want, case.dtype)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_the_c_decode_kernel_matches_the_reference_on_every_instruction_set_and_odd_shapes(
    isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # BATCHQ_CPU_ISA=avx2 builds what AVX2-only CPUs run, on any x86 machine. Beyond the grid: 7 query heads
    # per kv head (more accumulators than AVX2's registers hold in one pass over V) and a head dim of 96
    # (no specialised shape: the generic body).
    monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BATCHQ_CPU_ISA", isa)
    native_build.clear_caches()
    try:
        extra = [Case(64, 7, 2, 16, torch.float32, seed=21), Case(96, 2, 2, 16, torch.bfloat16, seed=22)]
        for case in [*GRID, *extra]:
            gen = torch.Generator().manual_seed(case.seed)
            lens = [*decode_lengths(case, gen), 5, 1999]
            cache = build_cache(case, lens, gen, CPU)
            q = random_queries(case, len(lens), gen, CPU)
            scale = 1 / math.sqrt(case.head_dim)
            assert native_attention.supports(q, cache.k_cache), case
            for window, softcap in ((None, None), (37, 2.0)):  # and within a window, soft-capped
                got = TorchAttention(native=True).paged_decode_attention(
                    q, cpu_layout(cache.k_cache), cpu_layout(cache.v_cache), cache.block_tables,
                    cache.context_lens, scale, window=window, softcap=softcap,
                )  # fmt: skip
                want = reference.paged_decode_attention(
                    q,
                    cache.k_cache,
                    cache.v_cache,
                    cache.block_tables,
                    cache.context_lens,
                    scale,
                    window,
                    softcap,
                )
                assert_close(got, want, case.dtype)
    finally:
        native_build.clear_caches()


@pytest.mark.parametrize("new_kv", [True, False], ids=["new-kv", "from-cache"])
@pytest.mark.parametrize("case", GRID, ids=str)
def test_prefill_matches_reference(case: Case, new_kv: bool) -> None:
    gen = torch.Generator().manual_seed(100 + case.seed)
    seqs = prefill_lengths(case)
    cache = build_cache(case, [ctx for _, ctx in seqs], gen, CPU)
    q_lens = torch.tensor([0] + [n for n, _ in seqs])
    cu_seqlens = q_lens.cumsum(0).to(torch.int32)
    q = random_queries(case, int(q_lens.sum()), gen, CPU)
    scale = 1 / math.sqrt(case.head_dim)
    # This step's new K/V: the last q_len tokens of each context, as the model hands them over.
    bs = case.block_size
    new_k, new_v = [], []
    for b, (n, ctx) in enumerate(seqs):
        pos = torch.arange(ctx - n, ctx)
        slots = cache.block_tables[b, pos // bs].long() * bs + pos % bs
        new_k.append(cache.k_cache.flatten(0, 1)[slots])
        new_v.append(cache.v_cache.flatten(0, 1)[slots])
    kv = {"k": torch.cat(new_k), "v": torch.cat(new_v)} if new_kv else {}
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu_seqlens, cache.context_lens, scale)

    got = TorchAttention(native=True).paged_prefill_attention(
        q, cpu_layout(cache.k_cache), cpu_layout(cache.v_cache), *args[3:], **kv
    )

    assert_close(got, reference.paged_prefill_attention(*args), case.dtype)


@pytest.mark.parametrize("case", GRID[:4], ids=str)
def test_write_kv_matches_reference(case: Case) -> None:
    gen = torch.Generator().manual_seed(200 + case.seed)
    k_cache, v_cache = garbage_cache(case, 6, gen)
    slots = torch.randperm(6 * case.block_size, generator=gen)[:37]
    k = torch.randn(37, case.kv_heads, case.head_dim, generator=gen)
    v = torch.randn(37, case.kv_heads, case.head_dim, generator=gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, want_k, want_v, slots)
    # torch ops, and paged_decode.c's one pass (K and V as strided views into a fused QKV output, as the
    # model hands them over)
    qkv = torch.cat(
        [torch.randn(37, 2, case.kv_heads, case.head_dim, generator=gen), k[:, None], v[:, None]], 1
    )
    for native, (kk, vv) in ((False, (k, v)), (True, (k, v)), (True, (qkv[:, 2], qkv[:, 3]))):
        got_k, got_v = cpu_layout(k_cache), cpu_layout(v_cache)
        if native:
            assert native_attention.write_kv(kk, vv, got_k, got_v, slots)  # what native=True runs
        else:
            TorchAttention(native=False).write_kv(kk, vv, got_k, got_v, slots)
        torch.testing.assert_close(got_k, cpu_layout(want_k), atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(got_v, cpu_layout(want_v), atol=0, rtol=0, equal_nan=True)


def test_write_kv_in_c_writes_an_fp8_cache_as_the_torch_ops_do() -> None:
    # saturation past 448, subnormals, signs: the cast's edge cases, through the C pass and the torch ops
    gen = torch.Generator().manual_seed(9)
    case = GRID[2]
    k_cache, v_cache = (cpu_layout(c).to(torch.float8_e4m3fn) for c in garbage_cache(case, 5, gen))
    slots = torch.randperm(5 * case.block_size, generator=gen)[:50]
    qkv = (
        torch.randn(50, 4, case.kv_heads, case.head_dim, generator=gen)
        * torch.tensor([1e-3, 1.0, 300.0, 2e3])[
            torch.randint(0, 4, (50, 4, case.kv_heads, case.head_dim), generator=gen)
        ]
    )
    want = [c.clone() for c in (k_cache, v_cache)]
    TorchAttention(native=False).write_kv(qkv[:, 2], qkv[:, 3], *want, slots)
    assert native_attention.write_kv(qkv[:, 2], qkv[:, 3], k_cache, v_cache, slots)
    for got, ref in zip((k_cache, v_cache), want, strict=True):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_length_groups_cover_every_sequence_once_with_bounded_padding() -> None:
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 2000, (300,), generator=gen).tolist()
    groups = length_groups(lens, 16, max_group=64)
    assert sorted(i for g in groups for i in g) == list(range(300))
    for g in groups:
        assert len(g) <= 64
        assert max(lens[i] for i in g) <= 1.25 * min(lens[i] for i in g) + 16


def test_decode_plan_is_shared_by_layers_and_rebuilt_when_the_step_changes() -> None:
    # The plan (groups, gather rows, masks) is built once per step: a second layer with the same
    # metadata reuses it; an in-place update of context_lens (static buffers) or new tensors rebuild it.
    case = GRID[2]
    gen = torch.Generator().manual_seed(42)
    cache = build_cache(case, [40, 300, 7, 129], gen, CPU)
    layer2 = (cache.k_cache * 0.5, cache.v_cache * 2.0)  # same tables, other K/V
    attn = TorchAttention(native=False)
    q = random_queries(case, 4, gen, CPU)

    def check(kv: tuple[torch.Tensor, torch.Tensor], lens: torch.Tensor) -> None:
        k, v = kv
        got = attn.paged_decode_attention(q, cpu_layout(k), cpu_layout(v), cache.block_tables, lens, 0.1)
        want = reference.paged_decode_attention(q, k, v, cache.block_tables, lens, 0.1)
        assert_close(got, want, case.dtype)

    lens = cache.context_lens
    check((cache.k_cache, cache.v_cache), lens)
    plan = attn._plans[None]
    check(layer2, lens)
    assert attn._plans[None] is plan
    lens[1] = 150  # shorter context, same buffer
    check((cache.k_cache, cache.v_cache), lens)
    assert attn._plans[None] is not plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("q_len", "offset"), [(300, 0), (300, 77), (128, 0), (129, 1000)])
def test_causal_tiles_match_float64_attention(dtype: torch.dtype, q_len: int, offset: int) -> None:
    # Tile edges (128 rows), a last partial tile, and a cached prefix that shifts every query's horizon.
    gen = torch.Generator().manual_seed(q_len + offset)
    kvh, g, d, n = 2, 3, 64, offset + q_len
    q = torch.randn(kvh * g, q_len, d, generator=gen)
    k, v = torch.randn(kvh, n, d, generator=gen), torch.randn(kvh, n, d, generator=gen)
    qpos = torch.arange(offset, n).unsqueeze(1)
    mask = torch.arange(n).unsqueeze(0) <= qpos
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double()[None], k.double()[None], v.double()[None], attn_mask=mask, scale=0.125, enable_gqa=True
    )[0].transpose(0, 1)

    got = causal_tiles(q.transpose(0, 1).to(dtype), k.to(dtype), v.to(dtype), offset, 0.125)

    assert got.shape == (q_len, kvh * g, d) and got.dtype == dtype
    assert_close(got, want.to(dtype), dtype)


@pytest.mark.parametrize(
    "case",
    [Case(32, 12, 1, 8, f32, seed=11), Case(16, 2, 2, 5, bf16, seed=12), Case(256, 16, 1, 16, f32, seed=13)],
    ids=str,
)
def test_c_kernel_outside_its_specialised_shapes(case: Case) -> None:
    """Head dims and group sizes the C kernel has no unrolled copy for run its generic loop, correctly."""
    if native_attention.library() is None:
        pytest.skip(f"no C kernel here (compiler: {native_build.compiler()})")
    gen = torch.Generator().manual_seed(case.seed)
    lens = [1, 7, case.block_size * 3, 300]
    cache = build_cache(case, lens, gen, CPU)
    q = random_queries(case, len(lens), gen, CPU)
    scale = 1 / math.sqrt(case.head_dim)
    k, v = cpu_layout(cache.k_cache), cpu_layout(cache.v_cache)
    assert native_attention.supports(q, k)

    got = native_attention.paged_decode(q, k, v, cache.block_tables, cache.context_lens, scale)

    want = reference.paged_decode_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale
    )
    assert got is not None
    assert_close(got, want, case.dtype)


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_the_c_prefill_kernel_matches_float64_attention_and_splits_a_prompt_without_changing_a_bit(
    isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prefill_attention.c on the instruction set AVX2-only CPUs run too. Shapes: one query head per kv
    # head to 8 (SmolLM2's 3), head dims 64, 96 (half an AVX-512 tile of columns) and 128; prompts shorter
    # than a block of keys, across block and task edges, and a chunk after a cached prefix (offset). q, k
    # and v are views of one fused QKV row, as the model hands them over; garbage past the keys a query
    # sees would show up as NaN.
    if platform.machine() not in ("x86_64", "AMD64") and isa != "native":
        pytest.skip("an x86 instruction set")
    monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BATCHQ_CPU_ISA", isa)
    native_build.clear_caches()
    try:
        gen = torch.Generator().manual_seed(31)
        for kvh, g, d, n in ((3, 3, 64, 203), (1, 1, 128, 5), (2, 8, 96, 130), (2, 4, 64, 64), (1, 2, 64, 1)):
            h = kvh * g
            qkv = torch.randn(n + 1, (h + 2 * kvh) * d, generator=gen)
            qkv[n] = float("nan")  # a row past the prompt
            q = qkv[:n, : h * d].view(n, h, d)
            k = qkv[:n, h * d : (h + kvh) * d].view(n, kvh, d).transpose(0, 1)
            v = qkv[:n, (h + kvh) * d :].view(n, kvh, d).transpose(0, 1)
            assert native_attention.prefill_supported(q, k, v)
            want = torch.nn.functional.scaled_dot_product_attention(
                q.double().transpose(0, 1)[None], k.double()[None], v.double()[None], is_causal=True,
                scale=d**-0.5, enable_gqa=True,
            )[0].transpose(0, 1)  # fmt: skip

            whole = native_attention.prefill(q, k, v, 0, d**-0.5)

            assert whole is not None and whole.shape == (n, h, d)
            torch.testing.assert_close(whole.double(), want, rtol=1e-5, atol=1e-5)
            for cut in {n // 3, n - 1} - {0}:  # the rest of the prompt after a cached prefix of `cut` keys
                rest = native_attention.prefill(q[cut:], k, v, cut, d**-0.5)
                assert rest is not None and torch.equal(rest, whole[cut:]), (kvh, g, d, n, cut)
    finally:
        native_build.clear_caches()
