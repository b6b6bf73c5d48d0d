"""Tensor parallelism over quantised checkpoints, with real rank processes over gloo: GPTQ (4-bit, and 8-bit
with act-order), AWQ, compressed-tensors FP8 and a GGUF file of mixed formats (its quantised, tied LM head
split by vocabulary rows) split over two ranks answer as the unsplit model does (greedy tokens equal,
logprobs within 1e-5), each rank holding its share of the groups; and what a split cannot keep in whole
groups is refused by name."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.engine.test_tensor_parallel import answers, assert_same_answers, engine, requests
from tests.quant_checkpoints import quantise_checkpoint
from tests.tiny_gguf import HIDDEN, INTER, write_tiny_gguf
from tests.tiny_models import VOCAB_SIZE, build_tiny_checkpoint
from worker.engine.request import EngineResult
from worker.engine.tensor_parallel import ShardedModel
from worker.models.errors import ModelLoadError
from worker.models.llama import LlamaFamilyModel
from worker.models.resolve import resolve_checkpoint

pytestmark = pytest.mark.slow


def split_answers(path: Path, check: Callable[[LlamaFamilyModel], None]) -> list[EngineResult]:
    """The answers of `path` split over two ranks, after `check(rank 0's model)`."""
    e = engine(path, 2)
    try:
        model = e.model_runner.model
        assert isinstance(model, ShardedModel)
        check(model.local)
        return e.generate(requests())
    finally:
        e.close()


@pytest.mark.parametrize(
    ("method", "bits", "group", "act_order"),
    # act-order in groups of 16: two in each rank's 32 inputs of o_proj, which its order interleaves
    [("gptq", 4, 32, False), ("gptq", 8, 16, True), ("awq", 4, 32, False), ("fp8", 8, 0, False)],
)
def test_a_quantised_checkpoint_split_over_two_ranks_answers_as_the_whole_one_does(
    tmp_path: Path, method: str, bits: int, group: int, act_order: bool
) -> None:
    src = build_tiny_checkpoint(tmp_path / "float", "llama")  # hidden 64, 4 heads, intermediate 128
    path = tmp_path / method
    # act-order: each row-parallel projection's groups within one rank's inputs (GPTQ's own orders scatter
    # them: refused below); the column-parallel ones' orders over all inputs, as GPTQ writes them
    quantise_checkpoint(src, path, method, bits, group, act_order, row_shares=2)

    def check(model: LlamaFamilyModel) -> None:
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp  # type: ignore[union-attr]
        # the rank's heads and intermediate rows; o_proj's and down_proj's inputs halved
        assert (attn.qkv_proj.out_features, attn.o_proj.in_features) == (32 + 2 * 16, 32)
        assert (mlp.gate_up_proj.out_features, mlp.down_proj.in_features) == (128, 64)
        kept = model.quantised_linears()
        assert all(any(lin is k for k in kept) for lin in (attn.qkv_proj, attn.o_proj, mlp.down_proj))
        if method == "fp8":  # o_proj's scales: one per output, every rank all of them
            assert attn.o_proj.scale.shape == (64,)
        else:  # o_proj's (s, o): the rank's groups of its 32 inputs
            assert attn.o_proj.bits == bits and attn.o_proj.group_s_o()[0].shape == (64, 32 // group)
        if act_order:  # the rank's own inputs, in its groups' order
            perm = attn.o_proj.in_perm.tolist()
            assert sorted(perm) == list(range(32)) and perm != sorted(perm)

    assert_same_answers(answers(path, 1), split_answers(path, check))


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Iterator[Path]:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    yield path
    shutil.rmtree(
        resolve_checkpoint(str(path))
    )  # its config and tokenizer, cached by the file's size and time


def test_a_gguf_file_split_over_two_ranks_answers_as_the_whole_file_does(tiny_gguf: Path) -> None:
    def check(model: LlamaFamilyModel) -> None:
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp  # type: ignore[union-attr]
        # Q4_K o_proj: 128 inputs a rank, half a super-block, whole groups of 32 as decoded
        assert (attn.o_proj.in_features, attn.o_proj.bits, attn.o_proj.group) == (HIDDEN // 2, 4, 32)
        assert (attn.qkv_proj.bits, attn.qkv_proj.group) == (8, 16)  # Q4_K q, k beside a Q6_K v
        assert (mlp.down_proj.in_features, mlp.down_proj.group) == (INTER // 2, 16)  # Q6_K
        # the tied Q8_0 table: the rank's vocabulary rows (the last share padded), kept quantised
        assert (model.lm_head.out_features, model.lm_head.bits) == (-(-(VOCAB_SIZE + 2) // 2), 8)

    assert_same_answers(answers(tiny_gguf, 1), split_answers(tiny_gguf, check))


def test_groups_a_split_cannot_keep_whole_are_refused_by_name(tmp_path: Path) -> None:
    src = build_tiny_checkpoint(tmp_path / "float", "llama")
    wide = tmp_path / "groups-of-64"
    quantise_checkpoint(src, wide, "gptq", 4, 64)  # o_proj's 64 inputs: 32 a rank, half a group
    with pytest.raises(
        ModelLoadError,
        match=r"^model .*: tensor_parallel_size 2: quantised module 'model\.layers\.0\.self_attn\.o_proj' \(GPTQ, "
        r"groups of 64 input rows\): its 64 inputs give 32 a rank, not whole groups; use tensor_parallel_size = 1$",
    ):
        engine(wide, 2)
    scattered = tmp_path / "act-order"
    quantise_checkpoint(src, scattered, "gptq", 4, 32, act_order=True)  # orders over all of o_proj's inputs
    with pytest.raises(
        ModelLoadError,
        match=r"^model .*: cannot load its weights: tensor_parallel_size 2: quantised module "
        r"'model\.layers\.0\.mlp\.down_proj' \(GPTQ act-order\): its g_idx groups input rows of more than one "
        r"rank's share, which a row-parallel split cannot; use a checkpoint without desc_act, or "
        r"tensor_parallel_size = 1$",
    ):
        engine(scattered, 2)
