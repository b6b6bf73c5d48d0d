"""Rank 0's commands to the other ranks of a tensor-parallel group: a JSON header and raw tensor bytes, never a
pickle. Every dtype the engine sends comes back with its bits, shape and dtype; a step's attention metadata
(a mixed step's, nested) survives the trip; a header that names an unknown dtype is refused; and two ranks
of a real gloo group exchange a command."""

from __future__ import annotations

import threading

import orjson
import pytest
import torch

from worker.engine.tensor_parallel import pack_meta, unpack_meta
from worker.models.layers import AttentionMetadata
from worker.parallel.group import TPGroup, decode_command, encode_command, free_port


def sample_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(2, 2, generator=g).to(torch.float16),
        torch.arange(11, dtype=torch.int64) - 5,
        torch.arange(6, dtype=torch.int32).reshape(2, 3),
        torch.tensor(True),
        torch.empty(0, 4),
        torch.randn(4, 3, generator=g).t(),  # not contiguous
    ]


def test_tensors_come_back_bit_for_bit() -> None:
    sent = sample_tensors()
    header, got = decode_command(encode_command({"op": "x", "n": 3, "nested": {"a": [1, 2]}}, sent))
    assert header == {"op": "x", "n": 3, "nested": {"a": [1, 2]}}
    assert len(got) == len(sent)
    for a, b in zip(sent, got, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(a, b)


def test_the_header_is_json_and_the_payload_raw() -> None:
    data = encode_command({"op": "logits"}, [torch.ones(2, dtype=torch.float32)]).numpy().tobytes()
    hlen = int.from_bytes(data[:8], "little")
    header = orjson.loads(data[8 : 8 + hlen])
    assert header == {"op": "logits", "tensors": [{"dtype": "float32", "shape": [2], "offset": 0}]}
    assert data.endswith(torch.ones(2).numpy().tobytes())
    assert b"\x80" not in data[: 8 + hlen]  # no pickle opcode anywhere in the header


def test_an_unknown_dtype_is_refused() -> None:
    data = bytearray(encode_command({"op": "x"}, [torch.ones(1)]).numpy().tobytes())
    forged = data.replace(b'"float32"', b'"object!"')
    with pytest.raises(ValueError, match="unknown dtype 'object!'"):
        decode_command(torch.frombuffer(forged, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cannot carry dtype complex64"):
        encode_command({"op": "x"}, [torch.ones(1, dtype=torch.complex64)])


def test_a_mixed_steps_metadata_survives() -> None:
    decode = AttentionMetadata("decode", torch.tensor([4, 9]), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                               torch.tensor([5, 10], dtype=torch.int32))  # fmt: skip
    meta = AttentionMetadata("mixed", torch.arange(5), torch.tensor([[4, 5]], dtype=torch.int32),
                             torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
                             decode)  # fmt: skip
    tensors = [torch.zeros(5, dtype=torch.int64)]
    packed = pack_meta(meta, tensors)
    header, got = decode_command(encode_command({"meta": packed}, tensors))
    back = unpack_meta(header["meta"], got)
    assert back.phase == "mixed" and back.decode is not None and back.decode.phase == "decode"
    assert back.decode.decode is None and back.decode.cu_seqlens_q is None
    for name in ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q"):
        assert torch.equal(getattr(back, name), getattr(meta, name))
    for name in ("slot_mapping", "block_tables", "context_lens"):
        assert torch.equal(getattr(back.decode, name), getattr(decode, name))


def test_two_ranks_exchange_a_command() -> None:
    port, received = free_port(), []
    groups: dict[int, TPGroup] = {}

    def rank1() -> None:
        groups[1] = TPGroup.connect(1, 2, port, torch.device("cpu"))
        received.append(groups[1].receive_command())

    t = threading.Thread(target=rank1)
    t.start()
    group = TPGroup.connect(0, 2, port, torch.device("cpu"))
    sent = sample_tensors()
    group.send_command({"op": "forward", "own": True}, sent)
    t.join(30)
    assert not t.is_alive()
    header, got = received[0]
    assert header == {"op": "forward", "own": True}
    assert all(torch.equal(a, b) for a, b in zip(sent, got, strict=True))
