"""CUDA-graph decode: batch-size bucketing and padding rows on any machine; graph replay = eager on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.fakes import make_seq
from tests.tiny_models import build_tiny_checkpoint
from worker.engine.cuda_graphs import CudaGraphRunner, bucket, capture_sizes, pad_decode
from worker.engine.engine import Engine
from worker.engine.model_runner import ModelRunner
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine.scheduler import ScheduledBatch
from worker.engine.sequence import Sequence
from worker.engine_config import EngineConfig
from worker.kernels.backend import select_backend
from worker.models.layers import AttentionMetadata
from worker.models.loader import load_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BLOCK = 4


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(100)[-3:] == [80, 96, 100]


def test_a_batch_pads_up_to_the_next_captured_size() -> None:
    sizes = capture_sizes(64)
    assert [bucket(n, sizes) for n in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 48, 64]
    assert bucket(65, sizes) is None


def test_padding_rows_touch_only_the_dummy_block() -> None:
    dummy = 9
    p = pad_decode([11, 12], [6, 10], [[0, 1], [2, 3, 4]], 4, BLOCK, dummy)
    assert p.input_ids == [11, 12, 0, 0]
    assert p.positions == [5, 9, 0, 0]
    # token 5 of seq 0 lives in its 2nd block (id 1) at offset 1; token 9 of seq 1 in block 4 at offset 1
    assert p.slot_mapping == [1 * BLOCK + 1, 4 * BLOCK + 1, dummy * BLOCK, dummy * BLOCK]
    assert p.context_lens == [6, 10, 1, 1]
    assert p.block_tables == [[0, 1, dummy], [2, 3, 4], [dummy] * 3, [dummy] * 3]
    assert p.flat()[:4] == p.input_ids and len(p.flat()) == 4 * 4 + 4 * 3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("graphs"), "llama")


def _prefilled(runner: ModelRunner) -> tuple[list[Sequence], list[list[int]]]:
    """Two sequences (prompts 5 and 9 tokens) prefilled into blocks [0, 1] and [2, 3, 4], one token sampled."""
    gen = torch.Generator().manual_seed(0)
    seqs = [make_seq(f"s{i}", n, 4) for i, n in enumerate((5, 9))]
    for s in seqs:
        s.prompt_ids = torch.randint(3, 200, (s.prompt_len,), generator=gen).tolist()
    tables = [[0, 1], [2, 3, 4]]
    for s, tok in zip(seqs, runner.run(ScheduledBatch("prefill", seqs, tables)).tokens, strict=True):
        s.output_ids.append(tok)
    return seqs, tables


def test_padded_decode_gives_the_real_rows_eager_logits_and_spares_their_kv(tiny_dir: Path) -> None:
    # What a replayed graph computes, run eagerly on CPU: the padded inputs through the torch backend.
    loaded = load_model(str(tiny_dir), torch.float32, torch.device("cpu"))
    dummy = 8
    runner = ModelRunner(
        loaded.model,
        select_backend(EngineConfig(), torch.device("cpu"), torch.float32),
        dummy + 1,
        BLOCK,
        torch.device("cpu"),
        torch.float32,
        max_model_len=loaded.max_model_len,
        max_num_seqs=4,
        cuda_graphs=False,
    )
    seqs, tables = _prefilled(runner)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    eager = runner.compute_logits(ScheduledBatch("decode", seqs, tables))  # [2, vocab]
    eager_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        k.copy_(k0)
        v.copy_(v0)

    p = pad_decode([s.last_token for s in seqs], [s.num_tokens for s in seqs], tables, 4, BLOCK, dummy)
    meta = AttentionMetadata(
        phase="decode",
        slot_mapping=torch.tensor(p.slot_mapping),
        block_tables=torch.tensor(p.block_tables, dtype=torch.int32),
        context_lens=torch.tensor(p.context_lens, dtype=torch.int32),
    )
    with torch.inference_mode():
        hidden = loaded.model(
            torch.tensor(p.input_ids), torch.tensor(p.positions), meta, runner.kv_caches, runner.backend
        )
        padded = loaded.model.compute_logits(hidden)  # [4, vocab]
    torch.testing.assert_close(padded[:2], eager, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(padded[2:]).all()
    # Close, not equal: a 4-row GEMM may round differently from a 2-row one. A padding row landing in a
    # real block would write a whole different K/V vector there.
    # The torch backend's cache is [kv_heads, blocks, block_size, head_dim]: the real blocks are dim 1's
    # first `dummy` (slicing dim 0 compared the dummy block too, which only zero-filled pools let pass).
    # Slots no sequence owns hold the same uninitialised values on both sides (NaN included).
    for (k, v), (ek, ev) in zip(runner.kv_caches, eager_kv, strict=True):
        torch.testing.assert_close(k[:, :dummy], ek[:, :dummy], rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(v[:, :dummy], ev[:, :dummy], rtol=1e-5, atol=1e-5, equal_nan=True)


class _EagerReplay:
    """Stands in for a captured graph on CPU: replay() runs the same forward over the static buffers."""

    def __init__(self, runner: CudaGraphRunner, size: int) -> None:
        self.runner, self.size = runner, size

    def replay(self) -> None:
        self.runner.logits[self.size].copy_(self.runner._forward(self.size))


class _EagerGraphRunner(CudaGraphRunner):
    def _capture(self) -> None:
        for size in self.sizes:
            self.graphs[size] = _EagerReplay(self, size)  # type: ignore[assignment]
            self.logits[size] = torch.empty(size, self.model.spec.vocab_size)


def test_run_stages_a_batch_into_the_static_buffers_and_slices_the_real_rows(tiny_dir: Path) -> None:
    # Everything of CudaGraphRunner.run but the graph itself, on CPU: padding, the one staged copy,
    # the static-buffer views, the stale columns of a previous wider batch, the logits slice.
    loaded = load_model(str(tiny_dir), torch.float32, torch.device("cpu"))
    dummy, cpu = 8, torch.device("cpu")
    runner = ModelRunner(
        loaded.model, select_backend(EngineConfig(), cpu, torch.float32), dummy + 1, BLOCK, cpu, torch.float32,
        loaded.max_model_len, 8, cuda_graphs=False,
    )  # fmt: skip
    seqs, tables = _prefilled(runner)
    graphs = _EagerGraphRunner(loaded.model, runner.backend, runner.kv_caches, BLOCK, dummy, 8, 64, cpu)
    assert graphs.block_tables.shape == (8, 16) and graphs.can_run(2, tables)
    assert not graphs.can_run(9, tables) and not graphs.can_run(1, [list(range(17))])
    with torch.inference_mode():
        eager = runner.compute_logits(ScheduledBatch("decode", seqs, tables))
        both = graphs.run([s.last_token for s in seqs], [s.num_tokens for s in seqs], tables)
        torch.testing.assert_close(both, eager, rtol=1e-5, atol=1e-5)
        assert graphs.context_lens[:2].tolist() == [6, 10] and graphs.block_tables[1, :3].tolist() == [
            2,
            3,
            4,
        ]
        # A narrower batch next: seq 1 alone in row 0 over the wider table's stale columns.
        one = graphs.run([seqs[1].last_token], [seqs[1].num_tokens], [tables[1]])
        torch.testing.assert_close(one, eager[1:], rtol=1e-5, atol=1e-5)


@needs_cuda
def test_graph_replay_matches_eager_decode_logits(tiny_dir: Path) -> None:
    dev = torch.device("cuda")
    loaded = load_model(str(tiny_dir), torch.float32, dev)
    backend = select_backend(EngineConfig(attention_backend="triton"), dev, torch.float32)
    runner = ModelRunner(
        loaded.model, backend, 8, BLOCK, dev, torch.float32, loaded.max_model_len, 8, cuda_graphs=True
    )
    assert runner.graphs is not None and runner.kv_caches[0][0].shape[0] == 9  # one dummy block
    seqs, tables = _prefilled(runner)
    batch = ScheduledBatch("decode", seqs, tables)
    graphed = runner.compute_logits(batch).clone()  # 2 rows replay the batch-2 graph
    graphs, runner.graphs = runner.graphs, None
    eager = runner.compute_logits(batch)  # rewrites the same K/V into the same slots
    runner.graphs = graphs
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("n", [3, 9])  # padded to 4 and to 16 rows
def test_engine_greedy_tokens_are_the_same_with_and_without_graphs(tiny_dir: Path, n: int) -> None:
    def run(graphs: bool) -> list[list[int]]:
        cfg = EngineConfig(
            model=str(tiny_dir), device="cuda", dtype="float32", kv_cache_gb=0.01, cuda_graphs=graphs
        )
        engine = Engine.load(cfg)
        params = GenerationParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        reqs = [
            EngineRequest(f"r{i}", params, prompt_token_ids=list(range(3 + i, 40 + 7 * i))) for i in range(n)
        ]
        return [r.token_ids for r in engine.generate(reqs)]

    assert run(True) == run(False)
