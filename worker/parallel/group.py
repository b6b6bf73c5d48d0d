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
import io
import pickle
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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


def _on_this_rank(t: Tensor) -> Tensor:
    """A device tensor of rank 0's command, on the receiving rank's own device."""
    return t.to(torch.cuda.current_device()) if torch.cuda.is_available() else t


class _CommandPickler(pickle.Pickler):
    """Pickles a device tensor as its CPU copy, rebuilt on the receiving rank's device (each rank has its
    own GPU: a CUDA tensor pickled as it is would be rebuilt on rank 0's)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor) and obj.device.type != "cpu":
            return _on_this_rank, (obj.detach().cpu(),)
        return NotImplemented


@dataclass
class TPGroup:
    """rank of size; `tensors`: the process group of the model's collectives (gloo on a CPU, NCCL on CUDA);
    `control`: a gloo group for rank 0's commands (pickled, broadcast as bytes)."""

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

    def send_command(self, command: Any) -> None:
        """Rank 0: `command` to every other rank (pickled; tensors travel as CPU tensors)."""
        buf = io.BytesIO()
        _CommandPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(command)
        data = buf.getvalue()
        size = torch.tensor([len(data)], dtype=torch.int64)
        with self._failing("a command"):
            self.control.broadcast(size, 0).wait()
            self.control.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0).wait()

    def receive_command(self) -> Any:
        """The other ranks: rank 0's next command (blocks until it comes, without a timeout of its own:
        an idle engine sends nothing for as long as it is idle)."""
        size = torch.empty(1, dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, IDLE_TIMEOUT
        with self._failing("waiting for a command"):
            self.control.broadcast([size], opts).wait()
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self.control.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())
