"""CUDA-graph decode: batch-size bucketing and padding rows on any machine; graph replay = eager on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.engine.eager_graphs import CountedGraphs, eager_graphs, install_eager_graphs
from tests.engine.fakes import make_seq
from tests.tiny_models import build_tiny_checkpoint
from worker.engine.cuda_graphs import bucket, capture_sizes
from worker.engine.engine import Engine
from worker.engine.model_runner import ModelRunner
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine.scheduler import ScheduledBatch
from worker.engine.sequence import Sequence
from worker.engine.step_io import DecodeDone, StepInputs, decode_to_device
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


def _graphed(tiny_dir: Path) -> tuple[ModelRunner, CountedGraphs, list[Sequence], list[list[int]]]:
    """A CPU runner whose pool has blocks 0-7 and the dummy block 8, two sequences prefilled (_prefilled),
    and an eager graph runner over its pool (not installed)."""
    loaded = load_model(str(tiny_dir), torch.float32, torch.device("cpu"))
    dummy, cpu = 8, torch.device("cpu")
    runner = ModelRunner(
        loaded.model, select_backend(EngineConfig(), cpu, torch.float32), dummy + 1, BLOCK, cpu, torch.float32,
        loaded.max_model_len, 8, cuda_graphs=False,
    )  # fmt: skip
    seqs, tables = _prefilled(runner)
    graphs = eager_graphs(runner, dummy, 64, 8, sizes=[4, 8])  # two rows pad to four
    return runner, graphs, seqs, tables


def _kv(runner: ModelRunner) -> list[Tensor]:
    """Every layer's K and V blocks 0-7 (not the dummy block 8), copied."""
    return [t.narrow(runner._block_axis, 0, 8).clone() for kv in runner.kv_caches for t in kv]


def test_a_graphed_step_pads_to_its_size_and_its_padding_touches_only_the_dummy_block(tiny_dir: Path) -> None:
    # Everything of CudaGraphRunner.run but the graph itself, on CPU: the step's tensors copied into the
    # static buffers, two padding rows (context 1, the dummy block), the logits slice.
    runner, graphs, seqs, tables = _graphed(tiny_dir)
    batch = ScheduledBatch("decode", seqs, tables)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    eager = runner.compute_logits(batch).clone()  # [2, vocab]
    eager_kv = _kv(runner)
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    runner.graphs = graphs
    graphed = runner.compute_logits(batch)  # two rows in the size-4 "graph"
    assert graphs.replays == 1 and graphed.shape == eager.shape
    # Close, not equal: a 4-row GEMM may round differently from a 2-row one.
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    assert graphs.context_lens[:4].tolist() == [6, 10, 1, 1]
    assert graphs.positions[:4].tolist() == [5, 9, 0, 0] and graphs.input_ids[2:4].tolist() == [0, 0]
    # token 5 of seq 0 lives in its 2nd block (id 1) at offset 1; token 9 of seq 1 in block 4 at offset 1
    assert graphs.slot_mapping[:4].tolist() == [1 * BLOCK + 1, 4 * BLOCK + 1, 8 * BLOCK, 8 * BLOCK]
    assert graphs.block_tables[1, :3].tolist() == [2, 3, 4] and graphs.block_tables[2:].eq(8).all()
    # A padding row landing in a real block would write a whole different K/V vector there. Slots no
    # sequence owns hold the same uninitialised values on both sides (NaN included).
    for got, want in zip(_kv(runner), eager_kv, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_a_narrower_batch_resets_the_rows_a_wider_one_left(tiny_dir: Path) -> None:
    runner, graphs, seqs, tables = _graphed(tiny_dir)
    both = runner.decode_inputs(seqs, tables)
    eager = runner.compute_logits(ScheduledBatch("decode", seqs, tables)).clone()
    with torch.inference_mode():
        torch.testing.assert_close(graphs.run(both), eager, rtol=1e-5, atol=1e-5)
        # seq 1 alone in row 0, over the wider table's stale columns; row 1 is padding again
        one = graphs.run(runner.decode_inputs(seqs[1:], tables[1:]))
        torch.testing.assert_close(one, eager[1:], rtol=1e-5, atol=1e-5)
        assert graphs.context_lens[:2].tolist() == [10, 1] and graphs.block_tables[1].eq(8).all()
        # Input ids given apart (a step in flight's sampled ids, on the device) replace the step's own.
        flipped = runner.decode_inputs(seqs, tables)
        flipped.input_ids = flipped.input_ids.flip(0)
        swapped = graphs.run(both, flipped.input_ids)
        assert graphs.input_ids[:2].tolist() == flipped.input_ids.tolist()
        hidden = runner.model(
            flipped.input_ids, flipped.positions, flipped.meta, runner.kv_caches, runner.backend
        )
        torch.testing.assert_close(swapped, runner.model.compute_logits(hidden), rtol=1e-5, atol=1e-5)
    assert graphs.can_run(8, 16) and not graphs.can_run(9, 16) and not graphs.can_run(1, 17)


def _config(tiny_dir: Path, overlap: bool) -> EngineConfig:
    return EngineConfig(model=str(tiny_dir), dtype="float32", kv_cache_gb=0.002, block_size=BLOCK,
                        max_num_seqs=8, async_scheduling=overlap)  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True])
def test_graphed_steps_give_the_eager_engine_tokens(tiny_dir: Path, overlap: bool) -> None:
    """Serially and overlapped (async scheduling: a graphed step's input ids are the step in flight's)."""

    def requests() -> list[EngineRequest]:
        reqs = []
        for i in range(11):  # 11 > 8 seats: admissions as others end, batches of every width
            p = GenerationParams(max_new_tokens=4 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i,
                                 ignore_eos=i % 3 == 0, stop=("ab",) if i % 4 == 1 else ())  # fmt: skip
            ids = [3 + (i * 13 + k) % 250 for k in range(3 + i)]
            reqs.append(EngineRequest(f"r{i}", p, prompt_token_ids=ids))
        return reqs

    def outcomes(engine: Engine) -> list[tuple[list[int], str, str | None]]:
        return [(r.token_ids, r.text, r.finish_reason) for r in engine.generate(requests())]

    engine = Engine.load(_config(tiny_dir, overlap))
    graphs = install_eager_graphs(engine, sizes=[4, 8])
    assert outcomes(engine) == outcomes(Engine.load(_config(tiny_dir, False)))
    assert graphs.replays > 20
    assert (engine.stats().overlapped_steps > 10) == overlap


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
    """Graphs off, graphs with serial steps, graphs with async scheduling (steps launched behind the one in
    flight: inputs from pinned memory, sampled ids back behind an event, step_io.py)."""

    def run(graphs: bool, overlap: bool) -> list[list[int]]:
        cfg = EngineConfig(model=str(tiny_dir), device="cuda", dtype="float32", kv_cache_gb=0.01,
                           cuda_graphs=graphs, async_scheduling=overlap)  # fmt: skip
        engine = Engine.load(cfg)
        assert (engine.model_runner.graphs is not None) == graphs
        params = GenerationParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        reqs = [
            EngineRequest(f"r{i}", params, prompt_token_ids=list(range(3 + i, 40 + 7 * i))) for i in range(n)
        ]
        tokens = [r.token_ids for r in engine.generate(reqs)]
        assert (engine.stats().overlapped_steps > 5) == overlap
        return tokens

    eager = run(False, False)
    assert run(True, False) == eager
    assert run(True, True) == eager
    assert run(False, True) == eager


@needs_cuda
def test_a_launched_steps_tokens_come_back_through_pinned_memory() -> None:
    tokens = torch.arange(5, device="cuda") * 7
    done = DecodeDone.of(tokens, 0.0)
    assert done.host is not None and done.host.is_pinned() and done.ready is not None
    assert done.token_list() == [0, 7, 14, 21, 28]
    step = decode_to_device(StepInputs(torch.tensor([1, 2]), torch.tensor([3, 4]), AttentionMetadata(
        phase="decode", slot_mapping=torch.tensor([5, 6]), block_tables=torch.tensor([[7], [8]], dtype=torch.int32),
        context_lens=torch.tensor([4, 5], dtype=torch.int32)), torch.arange(2), [0, 1], every_row=True),
        torch.device("cuda"))  # fmt: skip
    assert step.input_ids.is_cuda and step.meta.block_tables.dtype == torch.int32
    assert [step.input_ids.tolist(), step.positions.tolist(), step.meta.slot_mapping.tolist()] == [
        [1, 2],
        [3, 4],
        [5, 6],
    ]
    assert step.meta.context_lens.tolist() == [4, 5] and step.meta.context_lens.dtype == torch.int32
