"""Sliding-window attention and attention-logit soft-capping in every attention backend, against the torch
reference: the torch backend's decode (C kernel, torch workspace, one sequence per gather), prefill (new
K/V, from the cache, causal tiles), cascade decode, and the Triton kernels (under the interpreter without a
GPU), over the kernel grid with fresh random data.

Windows of one key, of a width no block size divides, of whole blocks, and wider than every context.
Blocks wholly before every query's window are what the engine releases: their table entries here point at
a garbage block (NaN V), so a kernel that reads one returns NaN.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from tests.kernels.paged_cases import (
    GRID,
    Case,
    PagedCache,
    assert_close,
    build_cache,
    random_queries,
)
from tests.kernels.test_cascade import layout, shared_cache
from tests.kernels.test_cpu_attention import cpu_layout
from worker.kernels import native_attention, reference
from worker.kernels.backend import TORCH_LINEAR, Backend, torch_attention, triton_attention
from worker.kernels.causal_tiles import causal_tiles, first_block
from worker.kernels.torch_attention import TorchAttention
from worker.models.layers import AttentionMetadata, paged_attention

CPU = torch.device("cpu")
SOFTCAP = 2.0  # scores of unit-scale q and k reach a few units: a cap of 2 bends most of them


def windows(case: Case) -> list[tuple[int | None, float | None]]:
    """(window, softcap) pairs: each window with and without the cap across the grid's cases."""
    bs = case.block_size
    pairs: list[tuple[int | None, float | None]] = [(1, None), (5, SOFTCAP), (2 * bs, None), (37, SOFTCAP)]
    return [*pairs, (10_000, None), (None, SOFTCAP)]


def release_before_windows(cache: PagedCache, earliest: list[int], window: int | None, bs: int) -> None:
    """Point every table entry wholly before each sequence's first query's window at a garbage block, as if
    the engine had released it. earliest: each sequence's first query position."""
    garbage = int(cache.block_tables[0, -1])  # build_cache's spare column: a block no sequence owns
    for b, pos in enumerate(earliest):
        cache.block_tables[b, : first_block(pos, window, bs)] = garbage


def test_the_window_is_transformers_sliding_window_mask() -> None:
    """Which keys a query sees, read off the reference's output (q = 0: uniform weights over the visible
    keys; V = one-hot of the key's position), equals transformers' sliding-window causal mask."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    n = 12
    case = Case(16, 1, 1, 4, torch.float32, seed=0)
    cache = build_cache(case, [n], torch.Generator().manual_seed(0), CPU)
    table = cache.block_tables[0]
    slots = table[torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4
    v = torch.zeros(n, 1, 16)
    v[torch.arange(n), 0, torch.arange(n)] = 1.0
    reference.write_kv(torch.zeros(n, 1, 16), v, cache.k_cache, cache.v_cache, slots)
    for window in (1, 3, 4, 7, 20):
        q = torch.zeros(n, 1, 16)
        cu = torch.tensor([0, n], dtype=torch.int32)
        out = reference.paged_prefill_attention(
            q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, 1.0, window
        )
        mask = sliding_window_causal_mask_function(window)
        for i in range(n):
            want = [bool(mask(*(torch.tensor(x) for x in (0, 0, i, j)))) for j in range(n)]
            assert (out[i, 0, :n] > 0).tolist() == want, (window, i)


@pytest.mark.parametrize(
    ("native", "workspace_bytes"),
    [(True, 64 << 20), (False, 64 << 20), (False, 1)],
    ids=["c-kernel", "torch-workspace", "torch-one-seq-per-gather"],
)
@pytest.mark.parametrize("case", GRID, ids=str)
def test_decode_within_windows_matches_reference(case: Case, native: bool, workspace_bytes: int) -> None:
    gen = torch.Generator().manual_seed(300 + case.seed)
    bs = case.block_size
    lens = [1, bs, 3 * bs - 1, 4 * bs + 1, 77, 300]
    q = random_queries(case, len(lens), gen, CPU)
    scale = 1 / math.sqrt(case.head_dim)
    for window, softcap in windows(case):
        cache = build_cache(case, lens, gen, CPU)
        release_before_windows(cache, [n - 1 for n in lens], window, bs)
        attn = TorchAttention(native=native, workspace_bytes=workspace_bytes)
        if native and not native_attention.supports(q, cpu_layout(cache.k_cache)):
            pytest.skip("no C kernel here")
        kc, vc = cpu_layout(cache.k_cache), cpu_layout(cache.v_cache)
        got = attn.paged_decode_attention(
            q, kc, vc, cache.block_tables, cache.context_lens, scale, window=window, softcap=softcap
        )
        want = reference.paged_decode_attention(
            q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale, window, softcap
        )
        assert_close(got, want, case.dtype)


@pytest.mark.parametrize("new_kv", [True, False], ids=["new-kv", "from-cache"])
@pytest.mark.parametrize("case", GRID, ids=str)
def test_prefill_within_windows_matches_reference(case: Case, new_kv: bool) -> None:
    gen = torch.Generator().manual_seed(400 + case.seed)
    bs = case.block_size
    seqs = [(1, 1), (bs, bs), (2 * bs + 5, 2 * bs + 5), (bs - 3, 4 * bs - 3), (7, 300), (1, 129), (150, 150)]
    q_lens = torch.tensor([0] + [n for n, _ in seqs])
    cu_seqlens = q_lens.cumsum(0).to(torch.int32)
    q = random_queries(case, int(q_lens.sum()), gen, CPU)
    scale = 1 / math.sqrt(case.head_dim)
    for window, softcap in windows(case):
        cache = build_cache(case, [ctx for _, ctx in seqs], gen, CPU)
        new_k, new_v = [], []
        for b, (n, ctx) in enumerate(seqs):
            pos = torch.arange(ctx - n, ctx)
            slots = cache.block_tables[b, pos // bs].long() * bs + pos % bs
            new_k.append(cache.k_cache.flatten(0, 1)[slots])
            new_v.append(cache.v_cache.flatten(0, 1)[slots])
        if not new_kv:  # a prompt computed whole attends to its own K/V: no block before a window to skip
            release_before_windows(cache, [ctx - n for n, ctx in seqs], window, bs)
        kv = {"k": torch.cat(new_k), "v": torch.cat(new_v)} if new_kv else {}
        args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu_seqlens, cache.context_lens, scale)
        got = TorchAttention(native=True).paged_prefill_attention(
            q, cpu_layout(cache.k_cache), cpu_layout(cache.v_cache), *args[3:], window=window,
            softcap=softcap, **kv,
        )  # fmt: skip
        assert_close(got, reference.paged_prefill_attention(*args, window, softcap), case.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("q_len", "offset", "window"), [(300, 0, 1), (300, 77, 50), (129, 1000, 200), (40, 3, 900)]
)
def test_causal_tiles_within_a_window_match_float64_attention(
    dtype: torch.dtype, q_len: int, offset: int, window: int
) -> None:
    # Tile edges (128 rows), a window narrower than a tile and wider than the keys, soft-capped scores.
    gen = torch.Generator().manual_seed(q_len + offset + window)
    kvh, g, d, n = 2, 3, 64, offset + q_len
    q = torch.randn(kvh * g, q_len, d, generator=gen)
    k, v = torch.randn(kvh, n, d, generator=gen), torch.randn(kvh, n, d, generator=gen)
    qpos = torch.arange(offset, n).unsqueeze(1)
    kpos = torch.arange(n).unsqueeze(0)
    visible = (kpos <= qpos) & (kpos > qpos - window)
    scores = torch.einsum("hqd,hkd->hqk", q.double(), k.double().repeat_interleave(g, 0)) * 0.125
    scores = (torch.tanh(scores / SOFTCAP) * SOFTCAP).masked_fill(~visible, float("-inf"))
    want = (torch.softmax(scores, -1) @ v.double().repeat_interleave(g, 0)).transpose(0, 1)

    got = causal_tiles(q.transpose(0, 1).to(dtype), k.to(dtype), v.to(dtype), offset, 0.125, window, SOFTCAP)

    assert got.shape == (q_len, kvh * g, d) and got.dtype == dtype
    assert_close(got, want.to(dtype), dtype)


@pytest.mark.parametrize("case", GRID[:4], ids=str)
def test_cascade_soft_caps_and_steps_aside_for_a_window(case: Case) -> None:
    """Shared prefixes with soft-capping go through cascade attention; a window narrower than a context
    keeps the step off it (a member would see part of the shared prefix only), and both equal the reference."""
    gen = torch.Generator().manual_seed(500 + case.seed)
    lens, groups = layout(case, case.seed, [1] * 8)
    cache = shared_cache(case, lens, groups, gen)
    q = random_queries(case, len(lens), gen, CPU)
    scale = 1 / math.sqrt(case.head_dim)
    kc, vc = cpu_layout(cache.k_cache), cpu_layout(cache.v_cache)
    if not native_attention.supports(q, kc):
        pytest.skip("cascade decode runs with the C kernel, which does not take this case here")
    for window, softcap, cascaded in ((None, SOFTCAP, True), (max(lens), SOFTCAP, True), (40, None, False)):
        attn = TorchAttention(native=True)
        got = attn.paged_decode_attention(
            q, kc, vc, cache.block_tables, cache.context_lens, scale, window=window, softcap=softcap
        )
        assert attn._cascade.shared_steps == int(cascaded), window
        want = reference.paged_decode_attention(
            q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale, window, softcap
        )
        assert_close(got, want, case.dtype)


@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto-splits", "3-splits"])
@pytest.mark.parametrize("case", GRID, ids=str)
def test_triton_decode_within_windows_matches_reference(
    kernels: ModuleType, device: torch.device, case: Case, num_splits: int | None
) -> None:
    gen = torch.Generator().manual_seed(600 + case.seed)
    bs = case.block_size
    lens = [1, bs + 1, 3 * bs - 1, 77, 600]
    q = random_queries(case, len(lens), gen, device)
    scale = 1 / math.sqrt(case.head_dim)
    pairs = windows(case)
    for window, softcap in pairs[:3] if num_splits is None else pairs[3:]:
        cache = build_cache(case, lens, gen, device)
        release_before_windows(cache, [n - 1 for n in lens], window, bs)
        args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
        got = kernels.paged_decode_attention(*args, num_splits=num_splits, window=window, softcap=softcap)
        assert_close(got, reference.paged_decode_attention(*args, window, softcap), case.dtype)


@pytest.mark.parametrize("case", GRID, ids=str)
def test_triton_prefill_within_windows_matches_reference(
    kernels: ModuleType, device: torch.device, case: Case
) -> None:
    gen = torch.Generator().manual_seed(700 + case.seed)
    bs = case.block_size
    seqs = [(1, 1), (2 * bs + 5, 2 * bs + 5), (bs - 3, 4 * bs - 3), (7, 300), (70, 70)]
    q_lens = torch.tensor([0] + [n for n, _ in seqs])
    cu_seqlens = q_lens.cumsum(0).to(device=device, dtype=torch.int32)
    q = random_queries(case, int(q_lens.sum()), gen, device)
    scale = 1 / math.sqrt(case.head_dim)
    for window, softcap in windows(case)[1:5]:
        cache = build_cache(case, [ctx for _, ctx in seqs], gen, device)
        release_before_windows(cache, [ctx - n for n, ctx in seqs], window, bs)
        args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu_seqlens, cache.context_lens, scale)
        got = kernels.paged_prefill_attention(*args, window=window, softcap=softcap)
        assert_close(got, reference.paged_prefill_attention(*args, window, softcap), case.dtype)


def test_triton_launchers_refuse_a_window_or_cap_below_one(kernels: ModuleType, device: torch.device) -> None:
    case = GRID[0]
    cache = build_cache(case, [5], torch.Generator().manual_seed(0), device)
    q = random_queries(case, 1, torch.Generator().manual_seed(1), device)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1)
    with pytest.raises(ValueError, match=r"window must be >= 1"):
        kernels.paged_decode_attention(*args, window=0)
    with pytest.raises(ValueError, match=r"softcap must be > 0"):
        kernels.paged_decode_attention(*args, softcap=0.0)


def mixed_step(
    case: Case, window: int, gen: torch.Generator, device: torch.device
) -> tuple[PagedCache, AttentionMetadata, int]:
    """A mixed step's metadata over one cache: three decode rows, then two prompt chunks (one over a cached
    prefix), their first queries' windows released. -> cache, metadata, decode rows."""
    bs = case.block_size
    decode_lens, chunks = [bs + 3, 90, 1], [(20, 20), (9, 70)]
    cache = build_cache(case, decode_lens + [ctx for _, ctx in chunks], gen, device)
    release_before_windows(cache, [n - 1 for n in decode_lens] + [c - n for n, c in chunks], window, bs)
    nd = len(decode_lens)
    tables, lens = cache.block_tables, cache.context_lens
    positions = [n - 1 for n in decode_lens] + [p for n, c in chunks for p in range(c - n, c)]
    rows = [i for i in range(nd)] + [nd + j for j, (n, _) in enumerate(chunks) for _ in range(n)]
    pos_t, rows_t = torch.tensor(positions, device=device), torch.tensor(rows, device=device)
    slots = tables[rows_t, pos_t // bs].long() * bs + pos_t % bs
    cu = torch.tensor([0, chunks[0][0], chunks[0][0] + chunks[1][0]], dtype=torch.int32, device=device)
    decode = AttentionMetadata("decode", slots[:nd], tables[:nd], lens[:nd])
    meta = AttentionMetadata("mixed", slots, tables[nd:], lens[nd:], cu, decode)
    return cache, meta, nd


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_a_mixed_step_attends_within_each_rows_window(
    kernels: ModuleType, device: torch.device, backend_name: str
) -> None:
    """layers.paged_attention over decode rows and prompt chunks in one step writes the new K/V and
    attends within the window, soft-capped: each row as the reference computes it."""
    case = GRID[3] if backend_name == "torch" else GRID[0]
    gen = torch.Generator().manual_seed(800)
    window = 2 * case.block_size + 3
    cache, meta, nd = mixed_step(case, window, gen, device)
    t = meta.slot_mapping.shape[0]
    q = random_queries(case, t, gen, device)
    k = torch.randn(t, case.kv_heads, case.head_dim, generator=gen).to(device=device, dtype=case.dtype)
    v = torch.randn(t, case.kv_heads, case.head_dim, generator=gen).to(device=device, dtype=case.dtype)
    scale = 1 / math.sqrt(case.head_dim)
    ref_k, ref_v = cache.k_cache.clone(), cache.v_cache.clone()
    reference.write_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    assert meta.decode is not None and meta.cu_seqlens_q is not None
    want = torch.cat([
        reference.paged_decode_attention(q[:nd], ref_k, ref_v, meta.decode.block_tables,
                                         meta.decode.context_lens, scale, window, SOFTCAP),
        reference.paged_prefill_attention(q[nd:], ref_k, ref_v, meta.block_tables, meta.cu_seqlens_q,
                                          meta.context_lens, scale, window, SOFTCAP),
    ])  # fmt: skip
    if backend_name == "torch":
        attention = torch_attention(c_decode=True)
        kv = (cpu_layout(cache.k_cache), cpu_layout(cache.v_cache))
    else:
        attention = triton_attention()
        kv = (cache.k_cache, cache.v_cache)
    got = paged_attention(
        q, k, v, kv, meta, Backend(attention, TORCH_LINEAR), scale, window=window, softcap=SOFTCAP
    )
    assert_close(got, want, case.dtype)
