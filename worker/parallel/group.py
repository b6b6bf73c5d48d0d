"""A tensor-parallel group as one rank sees it: its rank, its size, and the collectives the sharded model
runs (a sum over ranks after each row-parallel projection, a gather of the vocabulary-parallel logits), plus
the control channel over which rank 0 sends every step's inputs to the others.

The process groups are made directly over a TCP store (torch.distributed's ProcessGroupGloo / NCCL), not as
torch.distributed's default group: a process may hold more than one engine, and nothing global is touched.
Every collective waits at most `timeout`: a rank that died or hangs takes the group down with an error
rather than leaving the others blocked for ever.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import torch
import torch.distributed as dist
from torch import Tensor

# How long a collective may wait for the other ranks. A step of a large model on a slow machine takes
# seconds; a dead peer is seen when this runs out, or sooner where the transport notices the closed socket.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


# How long the ranks wait for each other to load their shares of the model.
LOAD_TIMEOUT = datetime.timedelta(hours=1)
# How long the other ranks wait for rank 0's next command: an engine with no work sends none. Rank 0 dying
# ends the wait sooner (its connections close).
IDLE_TIMEOUT = datetime.timedelta(days=365)


def free_port() -> int:
    """A TCP port free on this host now (the group's store listens on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GroupFailure(RuntimeError):
    """A rank of the group died, hung past the collective timeout, or could not join: the group cannot go on,
    and its engine's requests must run elsewhere."""


# The dtypes a command's tensors may have: a header naming any other is refused, not looked up in torch.
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn)
}  # fmt: skip
_ALIGN = 16  # each tensor's bytes start at a multiple of this, so that they are viewed in place


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as a command's JSON names it ("bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"a tensor-parallel command cannot carry dtype {name}")
    return name


def dtype_named(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"a tensor-parallel command named an unknown dtype {name!r}") from None


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_command(header: dict[str, Any], tensors: Sequence[Tensor]) -> Tensor:
    """One command as the bytes broadcast: the JSON header (which lists each tensor's dtype, shape and
    offset under "tensors") then each tensor's raw bytes, aligned. No pickle: a rank runs nothing but the
    commands it knows, and the payload stays readable."""
    parts: list[tuple[int, Tensor]] = []
    described: list[dict[str, Any]] = []
    end = 0
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        offset = _padded(end)
        described.append({"dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
        parts.append((offset, raw))
        end = offset + raw.numel()
    head = orjson.dumps({**header, "tensors": described})
    start = _padded(8 + len(head))
    data = torch.zeros(start + end, dtype=torch.uint8)
    data[:8] = torch.tensor([len(head)], dtype=torch.int64).view(torch.uint8)
    data[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    for offset, raw in parts:
        data[start + offset : start + offset + raw.numel()] = raw
    return data


def decode_command(data: Tensor, device: torch.device | None = None) -> tuple[dict[str, Any], list[Tensor]]:
    """encode_command's bytes -> (header, tensors), the tensors on `device` (CPU: views of `data`)."""
    hlen = int(data[:8].view(torch.int64).item())
    header = orjson.loads(data[8 : 8 + hlen].numpy().tobytes())
    start, tensors = _padded(8 + hlen), []
    for d in header.pop("tensors"):
        dtype, shape = dtype_named(d["dtype"]), tuple(d["shape"])
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        t = data[start + d["offset"] : start + d["offset"] + n].view(dtype).reshape(shape)
        tensors.append(t if device is None or device.type == "cpu" else t.to(device))
    return header, tensors


@dataclass
class TPGroup:
    """rank of size; `tensors`: the process group of the model's collectives (gloo on a CPU, NCCL on CUDA);
    `control`: a gloo group for rank 0's commands (a JSON header and raw tensor bytes, broadcast)."""

    rank: int
    size: int
    tensors: Any
    control: Any
    store: Any

    @classmethod
    def connect(
        cls,
        rank: int,
        size: int,
        port: int,
        device: torch.device,
        timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
    ) -> TPGroup:
        """Join the group whose store rank 0 serves on `port` (rank 0 serves it): blocks until every rank
        has joined, or raises after `timeout`."""
        c10d: Any = dist  # (torch's stubs do not export the store and group classes it has)
        store = c10d.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout)
        control = c10d.ProcessGroupGloo(c10d.PrefixStore("control", store), rank, size, timeout)
        tensors: Any
        if device.type == "cuda":
            opts = c10d.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            tensors = c10d.ProcessGroupNCCL(c10d.PrefixStore("tensors", store), rank, size, opts)
        else:
            tensors = c10d.ProcessGroupGloo(c10d.PrefixStore("tensors", store), rank, size, timeout)
        return cls(rank, size, tensors, control, store)

    def all_reduce(self, t: Tensor) -> Tensor:
        """The sum of every rank's `t`, in place (each rank gets the same bits)."""
        with self._failing("a sum"):
            self.tensors.allreduce([t]).wait()
        return t

    def all_gather(self, t: Tensor) -> Tensor:
        """Every rank's `t` [..., n] joined along the last dimension, rank order: [..., size * n]."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        with self._failing("a gather"):
            self.tensors.allgather([parts], [t.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def barrier(self, what: str, timeout: datetime.timedelta = LOAD_TIMEOUT) -> None:
        """Wait until every rank is here (`what`: for the message), at most `timeout`: loading a large
        model's share takes longer than any collective may."""
        opts = dist.AllreduceOptions()
        opts.timeout = timeout
        with self._failing(what):
            self.control.allreduce([torch.zeros(1)], opts).wait()

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as e:  # gloo / NCCL: a peer's connection closed, or the timeout ran out
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise GroupFailure(
                f"tensor-parallel rank {self.rank}: {what} over {self.size} ranks failed: {first}"
            ) from e

    def send_command(self, header: dict[str, Any], tensors: Sequence[Tensor] = ()) -> None:
        """Rank 0: a command to every other rank: `header`, a JSON object, and `tensors`, sent as raw bytes
        beside it (device tensors travel through host memory)."""
        data = encode_command(header, tensors)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        with self._failing("a command"):
            self.control.broadcast(size, 0).wait()
            self.control.broadcast(data, 0).wait()

    def receive_command(self, device: torch.device | None = None) -> tuple[dict[str, Any], list[Tensor]]:
        """The other ranks: rank 0's next command, its tensors on `device` (blocks until it comes, without
        a timeout of its own: an idle engine sends nothing for as long as it is idle)."""
        size = torch.empty(1, dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, IDLE_TIMEOUT
        with self._failing("waiting for a command"):
            self.control.broadcast([size], opts).wait()
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self.control.broadcast(data, 0).wait()
        return decode_command(data, device)
