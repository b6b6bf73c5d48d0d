"""Weights streamed from a checkpoint into the model's parameters, one tensor at a time.

`Checkpoint` (over checkpoint.py's listing) yields a checkpoint's tensors as `WeightSource`s: each reads its
bytes into the destination the model gives it (a parameter, or its rows of a fused one), in the serving
dtype, on the target device. `fill` is the model's side: it takes (name, tensor or source) pairs in any
order, checks each against the slot the model has for the name, fills it, and at the end checks that every
parameter was filled exactly once. Every fault raises CheckpointError, one line naming tensor and file.

Why reads rather than a mapping: the pages of a mapped file that a process touches count in its RSS
(RssFile) until they are unmapped, so copying a mapped shard out puts the whole shard in RSS beside the
weights. A safetensors tensor is read with pread from the offsets of its file's header, in chunks that
READ_THREADS threads read at once: on the CPU, in the file's dtype, straight into the destination's memory;
otherwise (another dtype, or a GPU) into READ_THREADS staging buffers of CHUNK_BYTES, each converted (or
copied to the device) as it arrives while the others fill. Loading then holds the final weights plus those
buffers at most (64 MiB: less than the largest tensor of any model of a billion parameters or more). The
file's pages stay in the page cache, which the kernel reclaims as it needs; they are not the process's.

pytorch_model.bin has no header to read offsets from: its shards are mapped by torch.load(mmap=True), and
a tensor is copied in chunks of CHUNK_BYTES, each chunk's pages handed back once it is copied (madvise
MADV_DONTNEED on the pages wholly within it: clean pages of a private file mapping, read again from the
file if anything touches them), so the mapping adds a chunk to the RSS, not the shard.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from worker.models.checkpoint import DTYPES, TensorEntry, list_tensors, map_bin
from worker.models.errors import CheckpointError
from worker.models.sharding import Shard

# Preads in flight: the page faults of fresh parameter memory and the copy out of the page cache run on
# several cores, and the disk sees more than one request at a time.
READ_THREADS = 4
CHUNK_BYTES = 16 << 20  # one pread, and a reading thread's staging buffer (conversions, device copies)
_READ_MAX = 1 << 30  # bytes per pread call (Linux returns at most about 2 GiB from one)
FLOAT_DTYPES = set(DTYPES.values())  # converted to whatever the destination takes


class WeightSource(Protocol):
    """A checkpoint tensor not yet read: its shape, where it comes from, and how it reaches its place."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype:
        """Its dtype in the file."""
        ...

    @property
    def where(self) -> str:
        """The file it is read from (for messages)."""
        ...

    def read_into(self, dest: Tensor) -> None:
        """Copy the tensor into `dest` (contiguous, of its shape), converting to dest's dtype and device."""
        ...


@dataclass(frozen=True)
class InMemory:
    """A tensor already in memory (a Hugging Face state dict's) as a WeightSource."""

    tensor: Tensor
    where: str = "the state dict"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def read_into(self, dest: Tensor) -> None:
        dest.copy_(self.tensor)

    def read_rows_into(self, dest: Tensor, start: int, stop: int) -> None:
        dest.copy_(self.tensor[start:stop])


class Checkpoint:
    """The weight files of one checkpoint folder: their tensors listed up front, read when asked for.

    Use as a context manager: the open file (and a .bin shard's mapping) is closed on exit."""

    def __init__(self, folder: Path, quantized: bool = False) -> None:
        """quantized: list a quantised checkpoint's integer and FP8 tensors too (each still reads only into a
        destination of its own dtype)."""
        self.where, self.entries = list_tensors(folder, quantized)
        self._fd: tuple[Path, int] | None = None
        self._shard: tuple[Path, dict[str, Tensor]] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: list[Tensor] = []  # the staging buffers of conversions and device copies

    @property
    def names(self) -> set[str]:
        return {e.name for e in self.entries}

    def tensors(self) -> Iterator[tuple[str, WeightSource]]:
        """Every tensor, in file order (each file read front to back once)."""
        for e in sorted(self.entries, key=lambda e: (str(e.file), e.offset)):
            yield e.name, _Source(self, e)

    def read_into(self, e: TensorEntry, dest: Tensor) -> None:
        assert tuple(dest.shape) == e.shape and dest.is_contiguous(), (e.name, dest.shape)
        if e.dtype != dest.dtype and e.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {e.name!r} in {e.file}: dtype {str(e.dtype).removeprefix('torch.')}, where the model "
                f"takes {str(dest.dtype).removeprefix('torch.')} (a quantised tensor its config does not describe)"
            )
        if e.file.suffix == ".bin":
            self._read_bin(e, dest)
        else:
            self._read_safetensors(e, dest)

    def read_rows_into(self, e: TensorEntry, dest: Tensor, start: int, stop: int) -> None:
        """Rows [start, stop) of `e` into `dest`: in a safetensors file only their bytes are read (a row range
        of a row-major tensor is one byte range); a .bin file's mapped tensor is sliced."""
        if e.file.suffix == ".bin":
            if self._shard is None or self._shard[0] != e.file:
                self._shard = None
                self._shard = (e.file, map_bin(e.file))
            dest.copy_(self._shard[1][e.name][start:stop])
            return
        row = e.nbytes // e.shape[0] if e.shape[0] else 0
        part = dataclasses.replace(
            e, shape=(stop - start, *e.shape[1:]), offset=e.offset + start * row, nbytes=(stop - start) * row
        )
        self.read_into(part, dest)

    def _read_safetensors(self, e: TensorEntry, dest: Tensor) -> None:
        fd = self._open(e.file)
        flat = dest.detach().view(-1)
        size = e.dtype.itemsize
        per = CHUNK_BYTES // size
        chunks = [(start, min(per, flat.numel() - start)) for start in range(0, flat.numel(), per)]
        if dest.device.type != "cpu" or dest.dtype != e.dtype:
            self._read_staged(fd, e, flat, chunks)
        elif len(chunks) == 1:
            _pread_into(fd, e, e.offset, _bytes_of(flat))
        else:  # straight into the parameter, the chunks on the reading threads
            parts = [(e.offset + start * size, _bytes_of(flat[start : start + n])) for start, n in chunks]
            for future in [self._threads().submit(_pread_into, fd, e, o, b) for o, b in parts]:
                future.result()  # raises the first chunk's error

    def _read_staged(self, fd: int, e: TensorEntry, flat: Tensor, chunks: list[tuple[int, int]]) -> None:
        """Chunks read by the threads into READ_THREADS staging buffers, each converted (or copied to the
        device) by this thread as it arrives, with torch's own threads, then refilled with the next chunk."""
        cuda = flat.device.type == "cuda"
        if not self._buffers or self._buffers[0].is_pinned() != cuda:
            self._buffers = [
                torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=cuda) for _ in range(READ_THREADS)
            ]
        size = e.dtype.itemsize
        pending: deque[tuple[int, Tensor, Future[None]]] = deque()

        def submit(k: int, buffer: Tensor) -> None:
            start, n = chunks[k]
            read = self._threads().submit(
                _pread_into, fd, e, e.offset + start * size, _bytes_of(buffer[: n * size])
            )
            pending.append((k, buffer, read))

        for k, buffer in zip(range(len(chunks)), self._buffers, strict=False):
            submit(k, buffer)
        upcoming = len(pending)
        while pending:
            k, buffer, future = pending.popleft()
            future.result()
            start, n = chunks[k]
            buf = buffer[: n * size]
            if flat.dtype == e.dtype:  # the bytes as they are, to the device
                flat.view(torch.uint8)[start * size : (start + n) * size].copy_(buf, non_blocking=cuda)
            else:
                flat[start : start + n].copy_(buf.view(e.dtype), non_blocking=cuda)
            if upcoming < len(chunks):
                if cuda:  # the device has the buffer's bytes before it is refilled
                    torch.cuda.current_stream(flat.device).synchronize()
                submit(upcoming, buffer)
                upcoming += 1
        if cuda:  # the tensor is whole when this returns
            torch.cuda.current_stream(flat.device).synchronize()

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="batchq-read")
        return self._pool

    def _read_bin(self, e: TensorEntry, dest: Tensor) -> None:
        if self._shard is None or self._shard[0] != e.file:
            self._shard = None  # the last shard's mapping goes before the next is mapped
            self._shard = (e.file, map_bin(e.file))
        t = self._shard[1][e.name]
        if not t.is_contiguous():
            dest.copy_(t)
            _release_pages(t)
            return
        src, flat = t.view(-1), dest.detach().view(-1)
        per = CHUNK_BYTES // t.element_size()
        for start in range(0, flat.numel(), per):  # in chunks: a chunk's pages are mapped while it is copied
            flat[start : start + per].copy_(src[start : start + per])
            _release_pages(src[start : start + per])

    def _open(self, file: Path) -> int:
        if self._fd is None or self._fd[0] != file:
            self._close_fd()
            try:
                self._fd = (file, os.open(file, os.O_RDONLY))
            except OSError as err:
                raise CheckpointError(f"{file}: cannot open it ({err.strerror})") from None
        return self._fd[1]

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd[1])
            self._fd = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._buffers = []
        self._close_fd()
        self._shard = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Source:
    checkpoint: Checkpoint
    entry: TensorEntry

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    @property
    def where(self) -> str:
        return str(self.entry.file)

    def read_into(self, dest: Tensor) -> None:
        self.checkpoint.read_into(self.entry, dest)

    def read_rows_into(self, dest: Tensor, start: int, stop: int) -> None:
        """Rows [start, stop) of the tensor (its first dimension) into `dest`, reading only their bytes."""
        self.checkpoint.read_rows_into(self.entry, dest, start, stop)


def _bytes_of(t: Tensor) -> memoryview:
    """A CPU tensor's memory as a writable buffer (t contiguous)."""
    return t.view(torch.uint8).numpy().data


def _pread_into(fd: int, e: TensorEntry, offset: int, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        try:
            n = os.preadv(fd, [buf[done : done + _READ_MAX]], offset + done)
        except OSError as err:
            raise CheckpointError(f"tensor {e.name!r} in {e.file}: cannot read it ({err.strerror})") from None
        if n == 0:
            raise CheckpointError(
                f"tensor {e.name!r} in {e.file}: the file ends inside it (a torn download?)"
            )
        done += n


def _release_pages(t: Tensor) -> None:
    """Hand back the pages wholly within `t`'s bytes, a .bin shard's, once they are copied: clean pages of a
    private file mapping, which DONTNEED drops from the process (a later touch reads them from the file)."""
    if sys.platform != "linux":
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: rows [start, stop) of parameter `param` (the whole of it, or its
    part of a fused one), times `scale` after it is read. `shard`: under tensor parallelism, the part of the
    tensor this rank takes (the tensor is read whole, then its share kept)."""

    param: str
    tensor: Tensor  # the whole parameter
    start: int
    stop: int
    scale: float = 1.0
    shard: Shard | None = None

    @property
    def dest(self) -> Tensor:
        return self.tensor.detach()[self.start : self.stop]


@dataclass
class _Filled:
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # (start, stop, checkpoint name)

    def rows(self) -> int:
        return sum(stop - start for start, stop, _ in self.spans)


def read_shard(src: WeightSource, shard: Shard, dest: Tensor) -> None:
    """A rank's share of a checkpoint tensor into `dest`, reading only what it takes where the source reads
    row ranges: its spans of rows, or, for a span of columns, the tensor's rows a chunk at a time (so the
    load never holds more than the share and one chunk). Otherwise the tensor is read whole first."""
    rows_of = getattr(src, "read_rows_into", None)
    if rows_of is None:
        staged = torch.empty(src.shape, dtype=dest.dtype, device=dest.device)
        src.read_into(staged)
        dest.copy_(shard.take(staged))
        return
    if shard.dim == 0:
        at = 0
        for a, b in shard.spans:
            rows_of(dest[at : at + b - a], a, b)
            at += b - a
        if at < dest.shape[0]:  # the vocabulary's last share, padded
            dest[at:].zero_()
        return
    full = shard.full
    per_row = max(1, math.prod(full[1:]) * dest.element_size())
    step = max(1, CHUNK_BYTES // per_row)
    for r0 in range(0, full[0], step):
        r1 = min(full[0], r0 + step)
        staged = torch.empty((r1 - r0, *full[1:]), dtype=dest.dtype, device=dest.device)
        rows_of(staged, r0, r1)
        dest[r0:r1].copy_(shard.take(staged))


def fill(slots: dict[str, Slot], weights: Iterable[tuple[str, Tensor | WeightSource]], where: str) -> None:
    """Read every (name, tensor) into its slot, in any order, each parameter's rows exactly once; `where`
    names what should have held a missing tensor. Names in `slots` that share a parameter are alternatives
    (q_proj, k_proj, v_proj or the fused qkv_proj): together they must cover it, without overlap."""
    filled: dict[str, _Filled] = {s.param: _Filled() for s in slots.values()}
    for name, weight in weights:
        src: WeightSource = InMemory(weight) if isinstance(weight, Tensor) else weight
        slot = slots.get(name)
        if slot is None:
            raise CheckpointError(f"tensor {name!r} in {src.where}: the model has no weight of that name")
        want = (slot.stop - slot.start, *slot.tensor.shape[1:])
        if slot.shard is not None:
            want = slot.shard.full
        rows = "" if slot.stop - slot.start == slot.tensor.shape[0] else f"rows {slot.start}:{slot.stop} of "
        if tuple(src.shape) != want:
            raise CheckpointError(
                f"tensor {name!r} in {src.where}: shape {list(src.shape)}, expected {list(want)} (for "
                f"{rows}the decoder's {slot.param})"
            )
        spans = filled[slot.param].spans
        clash = next((n for a, b, n in spans if a < slot.stop and slot.start < b), None)
        if clash is not None:
            raise CheckpointError(
                f"tensor {name!r} in {src.where}: overlaps {clash!r} in {rows}the decoder's {slot.param}"
            )
        dest = slot.dest
        if slot.shard is None:
            src.read_into(dest)
        else:
            read_shard(src, slot.shard, dest)
        if slot.scale != 1.0:
            dest.mul_(slot.scale)
        spans.append((slot.start, slot.stop, name))
    for name, slot in slots.items():
        if filled[slot.param].rows() == slot.tensor.shape[0]:
            continue
        spans = filled[slot.param].spans
        if any(a < slot.stop and slot.start < b for a, b, _ in spans):
            continue  # a part of this parameter is there: another of its names is the one missing
        # The first name of the rows that nothing filled; with nothing of the parameter there, its other
        # whole name too (the fused qkv_proj beside q_proj, a tied table's lm_head beside embed_tokens).
        whole = next((n for n, s in slots.items() if s.param == slot.param and n != name
                      and s.stop - s.start == s.tensor.shape[0]), None)  # fmt: skip
        alt = f", nor is {whole!r}" if whole is not None and not spans else ""
        raise CheckpointError(f"tensor {name!r} is not in the checkpoint ({where}){alt}")
