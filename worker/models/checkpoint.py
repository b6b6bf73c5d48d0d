"""What a checkpoint folder holds: its weight files and their tensors, listed without reading their bytes.

model.safetensors; the shards that model.safetensors.index.json names; pytorch_model.bin and its shards
(mapped by torch.load(mmap=True, weights_only=True), which reads only the pickle). A safetensors file's
header gives every tensor's dtype, shape and byte range, which weights.py reads from. A file that is not
what it says raises CheckpointError naming it (and the tensor).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from worker.models.errors import CheckpointError, one_line

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX)  # the order transformers prefers them in

# The dtypes of safetensors' header that a decoder's weights come in; a quantised checkpoint's packed
# integers and FP8 weights besides (read only where its quantization_config says how: quant_loading.py).
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
QUANT_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
}
_HEADER_MAX = 100 << 20  # a safetensors header longer than this is a corrupt file, not a header


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint file as its header (or torch.load's mapping) describes it."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # safetensors: where its bytes start in the file; .bin: 0 (torch.load maps them)
    nbytes: int


def list_tensors(folder: Path, quantized: bool = False) -> tuple[str, list[TensorEntry]]:
    """(what lists the tensors: the index or the single file, for messages; every tensor) of a checkpoint
    folder."""
    where, files = _weight_files(folder)
    entries: list[TensorEntry] = []
    seen: dict[str, Path] = {}
    for f in files:
        for e in _bin_entries(f, quantized) if f.suffix == ".bin" else _safetensors_entries(f, quantized):
            if e.name in seen:
                raise CheckpointError(f"tensor {e.name!r} is in both {seen[e.name]} and {f}")
            seen[e.name] = f
            entries.append(e)
    return where, entries


def _weight_files(folder: Path) -> tuple[str, list[Path]]:
    """(what names the tensors, for messages; the weight files) of a checkpoint folder."""
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return str(path), [path]
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: cannot read it: {one_line(err)}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise CheckpointError(f"{path}: not a checkpoint index (no weight_map of names to files)")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{path} names {missing[0]}, which is not in {folder}")
        return str(path), [folder / s for s in shards]
    raise CheckpointError(f"{folder}: no weights: none of {', '.join(WEIGHT_FILES)}")


def _safetensors_entries(file: Path, quantized: bool) -> list[TensorEntry]:
    """The tensors of a safetensors file from its header: 8 bytes of header length, the header (JSON: name
    -> dtype, shape, data_offsets from the end of the header), then the data."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else size
            raw = f.read(length) if length <= min(size - 8, _HEADER_MAX) else None
    except OSError as err:
        raise CheckpointError(f"{file}: cannot read it ({err.strerror})") from None
    if raw is None:
        raise CheckpointError(f"{file}: not a safetensors file (its header would run past the file's end)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{file}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a safetensors file (its header is not a JSON object)")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
            dtype_name = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"tensor {name!r} in {file}: its header entry is malformed") from None
        dtype = DTYPES.get(dtype_name) or (QUANT_DTYPES.get(dtype_name) if quantized else None)
        if dtype is None:
            raise CheckpointError(
                f"tensor {name!r} in {file}: dtype {dtype_name}, not one of {', '.join(DTYPES)} (quantised "
                "checkpoints are not loaded natively)"
            )
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise CheckpointError(
                f"tensor {name!r} in {file}: {list(shape)} of {dtype_name} is {numel * dtype.itemsize} bytes, "
                f"its header gives {end - begin}"
            )
        if 8 + length + end > size:
            raise CheckpointError(
                f"tensor {name!r} in {file}: its bytes end past the end of the file ({size} bytes; a torn "
                "download?)"
            )
        entries.append(TensorEntry(name, file, dtype, shape, 8 + length + begin, end - begin))
    return entries


def map_bin(file: Path) -> dict[str, Tensor]:
    """A pytorch_model.bin shard, mapped (no tensor's bytes are read until it is copied)."""
    try:
        sd = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as err:  # torch.load says "mmap can only be used with files saved with ..." etc.
        raise CheckpointError(
            f"{file}: cannot map it ({one_line(err)}); a checkpoint in torch.save's legacy format: convert it "
            "to safetensors"
        ) from None
    except (OSError, ValueError, EOFError) as err:
        raise CheckpointError(f"{file}: cannot read it: {one_line(err)}") from None
    except Exception as err:  # weights_only's unpickler refusing a global: a pickle that is not plain tensors
        raise CheckpointError(f"{file}: not a state dict of tensors: {one_line(err)}") from None
    if not isinstance(sd, dict) or not all(isinstance(t, Tensor) for t in sd.values()):
        raise CheckpointError(f"{file}: not a state dict of tensors")
    return sd


def _bin_entries(file: Path, quantized: bool) -> list[TensorEntry]:
    out = []
    for name, t in map_bin(file).items():
        if t.dtype not in DTYPES.values() and not (quantized and t.dtype in QUANT_DTYPES.values()):
            raise CheckpointError(
                f"tensor {name!r} in {file}: dtype {t.dtype}, not a floating type batchq loads"
            )
        out.append(TensorEntry(name, file, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size()))
    return out
