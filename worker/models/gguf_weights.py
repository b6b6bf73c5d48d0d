"""A GGUF file's tensors under Hugging Face's names, streamed into the native decoder with their
quantisation kept (gguf_quants.py decodes the blocks; nothing is dequantised).

The file's header (gguf's reader) gives each tensor's type, shape and offset; the bytes are read with pread,
one tensor at a time (a mapping would put every page it touched in the process's RSS). GGUF's names map to
Hugging Face's through gguf's own table for the file's architecture, and the tensors are put back as
Hugging Face's GGUF loader puts them: a llama-architecture file's q and k rows un-permuted (llama.cpp's
converter interleaves each head's rotary halves), Gemma's norm weights less the 1 the converter added. A
quantised tensor becomes `<linear>.weight` (q) and `<linear>.group_table` (s, o) for the decoder's
quantised Linear; where the parts of one of batchq's fused projections come in different formats (a
Q4_K_M file's Q6_K v beside Q4_K q and k), each part is re-expressed, exactly, in the widest of them (8-bit
q, the smallest group, float32 s and o).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from worker.models import gguf_quants
from worker.models.errors import CheckpointError
from worker.models.quant_loading import QuantizedModule

FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}  # BF16: no numpy dtype, read as uint16


@dataclass(frozen=True)
class _Tensor:
    name: str  # GGUF's
    type_name: str
    shape: tuple[int, ...]  # torch's order (GGUF lists the innermost dimension first)
    offset: int
    nbytes: int


# GGUF's metadata value types: struct formats of the fixed-size ones; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Header:
    """A cursor over a GGUF file's mapped header."""

    def __init__(self, m: mmap.mmap, path: Path) -> None:
        self.m, self.path, self.pos = m, path, 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        out = struct.unpack_from("<" + fmt, self.m, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return out

    def string(self) -> str:
        (n,) = self.unpack("Q")
        self.pos += n
        return self.m[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int) -> object:
        """The value of metadata type `kind` (an array's elements are skipped: None)."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == 8:
            return self.string()
        if kind != 9:
            raise CheckpointError(f"{self.path}: unknown GGUF metadata type {kind}")
        elem, count = self.unpack("IQ")
        if elem in _SCALARS:
            self.pos += count * struct.calcsize("<" + _SCALARS[elem])
        else:
            for _ in range(count):
                self.value(elem)
        return None


def read_header(path: Path) -> tuple[dict[str, object], list[tuple[str, int, tuple[int, ...], int]]]:
    """A GGUF file's scalar and string metadata, and its tensors as (name, GGML type id, dims in GGUF's
    order, absolute offset of the data). Reads only the header (gguf's reader decodes every metadata array,
    the vocabulary's strings too, which takes seconds)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        h = _Header(m, path)
        if m[:4] != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file")
        h.pos = 4
        version, n_tensors, n_kv = h.unpack("IQQ")
        if version < 2:
            raise CheckpointError(f"{path}: GGUF version {version}; batchq reads versions 2 and 3")
        meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = h.string()
            value = h.value(h.unpack("I")[0])
            if value is not None:
                meta[key] = value
        infos = []
        for _ in range(n_tensors):
            name = h.string()
            (n_dims,) = h.unpack("I")
            dims = h.unpack(f"{n_dims}Q")
            kind, offset = h.unpack("IQ")
            infos.append((name, int(kind), tuple(int(d) for d in dims), int(offset)))
        align = int(meta.get("general.alignment", 32))  # type: ignore[call-overload]
        start = -(-h.pos // align) * align
    return meta, [(n, k, d, start + o) for n, k, d, o in infos]


class GGUFCheckpoint:
    """The tensors of one GGUF file for the decoder: `names` (Hugging Face's), `modules` (the quantised
    linears and how each is kept, for LlamaFamilyModel.prepare_quantized), `tensors()` to load_weights."""

    def __init__(self, path: Path, hf_config: object) -> None:
        from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

        self.where = str(path)
        meta, infos = read_header(path)
        arch = str(meta.get("general.architecture"))
        self.arch = arch
        arch_key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
        if arch_key is None:
            raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not in gguf's tables")
        layers = int(hf_config.num_hidden_layers)  # type: ignore[attr-defined]
        self._heads = int(hf_config.num_attention_heads)  # type: ignore[attr-defined]
        self._kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or self._heads)
        name_map = get_tensor_name_map(arch_key, layers)
        entries = []
        for name, kind, dims, offset in infos:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise CheckpointError(f"tensor {name!r} in {path}: unknown GGML type {kind}") from None
            block, size = GGML_QUANT_SIZES[qtype]
            elements = math.prod(dims)
            entries.append(_Tensor(name, qtype.name, tuple(reversed(dims)), offset, elements // block * size))
        self._by_hf: dict[str, _Tensor] = {}
        for e in entries:
            hf = self._hf_name(e.name, name_map)
            if hf is None:
                raise CheckpointError(f"tensor {e.name!r} in {path}: no Hugging Face name for it ({arch})")
            self._by_hf[hf] = e
        if "lm_head.weight" not in self._by_hf and "model.embed_tokens.weight" in self._by_hf:
            # tied: the one table serves as batchq's lm_head, which keeps it quantised
            self._by_hf["lm_head.weight"] = self._by_hf.pop("model.embed_tokens.weight")
        self.names = set(self._by_hf)
        self.modules: dict[str, QuantizedModule] = {}

    def keep_quantised(
        self, linears: set[str], fused: dict[str, tuple[str, ...]]
    ) -> dict[str, QuantizedModule]:
        """Which of the decoder's linears (`linears`: Hugging Face's module names) keep their quantisation,
        and how; a quantised tensor of anything else (an untied embedding table) is dequantised as it loads.
        fused: batchq's fused projection -> the Hugging Face modules it holds."""
        self.modules = {m: q for m, q in self._quantised_modules(fused).items() if m in linears}
        return self.modules

    def _hf_name(self, gguf_name: str, name_map: object) -> str | None:
        base, _, suffix = gguf_name.rpartition(".")
        for hf_base in self._candidates(base):
            if name_map.get_name(hf_base) == base:  # type: ignore[attr-defined]
                return f"{hf_base}.{suffix}"
        return None

    def _candidates(self, base: str) -> Iterator[str]:
        """Hugging Face module names a GGUF base name may come from (gguf's table maps theirs to ours)."""
        if base.startswith("blk."):
            i = base.split(".")[1]
            for sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "self_attn.qkv_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate_up_proj",
                        "input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm",
                        "pre_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):  # fmt: skip
                yield f"model.layers.{i}.{sub}"
        else:
            yield from ("model.embed_tokens", "lm_head", "model.norm")

    def _quantised_modules(self, fused: dict[str, tuple[str, ...]]) -> dict[str, QuantizedModule]:
        """Every quantised linear's storage; the parts of one fused projection stored alike, the widest."""
        own: dict[str, QuantizedModule] = {}
        for hf, e in self._by_hf.items():
            if hf.endswith(".weight") and gguf_quants.supported(e.type_name):
                bits = 4 if e.type_name in ("Q4_0", "Q4_1", "Q4_K") else 8
                group = 16 if e.type_name == "Q6_K" else 32
                half = e.type_name in gguf_quants.F16_GROUPS
                own[hf.removesuffix(".weight")] = QuantizedModule(
                    "groups", bits, group, table="f16" if half else "f32", fmt=f"GGUF {e.type_name}"
                )
            elif hf.endswith(".weight") and e.type_name not in FLOAT_TYPES:
                raise CheckpointError(
                    f"tensor {e.name!r} in {self.where}: GGUF type {e.type_name}; batchq reads "
                    f"{', '.join([*FLOAT_TYPES, *gguf_quants.BLOCKS])}"
                )
        out = dict(own)
        for parts in fused.values():
            for group_names in self._fused_groups(parts):
                present = [n for n in group_names if n in own]
                if len(present) < 2 or len({own[n] for n in present}) == 1:
                    continue
                widest = QuantizedModule(
                    "groups",
                    max(own[n].bits for n in present),
                    math.gcd(*(own[n].group for n in present)),
                    table="f32" if any(own[n].table == "f32" for n in present) else "f16",
                    fmt="GGUF " + "/".join(sorted({own[n].fmt.removeprefix("GGUF ") for n in present})),
                )
                for n in present:
                    out[n] = widest
        return out

    def _fused_groups(self, parts: tuple[str, ...]) -> Iterator[list[str]]:
        """Per layer, Hugging Face's names of the modules that form one fused projection of `parts`."""
        prefixes = {m.rsplit(".", 1)[0] for m in (n.removesuffix(".weight") for n in self.names)}
        for prefix in prefixes:
            yield [f"{prefix}.{p}" for p in parts]

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(Hugging Face's name, tensor) of every tensor, quantised linears as q and their table."""
        fd = os.open(self.where, os.O_RDONLY)
        try:
            for hf, e in sorted(self._by_hf.items(), key=lambda kv: kv[1].offset):
                raw = np.frombuffer(os.pread(fd, e.nbytes, e.offset), dtype=np.uint8)
                if len(raw) != e.nbytes:
                    raise CheckpointError(f"tensor {e.name!r} in {self.where}: the file ends inside it")
                module = hf.removesuffix(".weight")
                if module in self.modules:
                    yield from self._quantised(hf, module, e, raw)
                elif gguf_quants.supported(e.type_name):  # not a linear batchq keeps quantised
                    qt = gguf_quants.decode(raw.reshape(e.shape[0], -1), e.type_name, e.shape[1])
                    yield hf, self._rows(hf, torch.from_numpy(gguf_quants.dequantize(qt)))
                else:
                    yield hf, self._rows(hf, self._float(e, raw))
        finally:
            os.close(fd)

    def _float(self, e: _Tensor, raw: np.ndarray) -> Tensor:
        if e.type_name == "BF16":
            return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(e.shape)
        dtype = FLOAT_TYPES.get(e.type_name)
        if dtype is None:
            raise CheckpointError(
                f"tensor {e.name!r} in {self.where}: GGUF type {e.type_name} where a float is expected"
            )
        t = torch.from_numpy(raw.view(dtype).copy()).reshape(e.shape)
        if self.arch in ("gemma", "gemma2", "gemma3") and e.name.endswith("norm.weight"):
            t = t.float() - 1  # the converter stored 1 + w
        return t

    def _quantised(self, hf: str, module: str, e: _Tensor, raw: np.ndarray) -> Iterator[tuple[str, Tensor]]:
        n, k = e.shape
        qt = gguf_quants.decode(raw.reshape(n, -1), e.type_name, k)
        want = self.modules[module]
        q, s, o = qt.q, qt.s, qt.o
        if qt.bits != want.bits:  # 4-bit values as 8-bit q: the same integers
            q = q.astype(np.int8)
        if qt.group != want.group:  # each group's s and o repeated over its sub-groups
            rep = qt.group // want.group
            s, o = np.repeat(s, rep, axis=1), np.repeat(o, rep, axis=1)
        table_dtype = torch.float16 if want.table == "f16" else torch.float32
        yield hf, self._rows(hf, torch.from_numpy(np.ascontiguousarray(q)))
        table = torch.stack(
            (torch.from_numpy(s.astype(np.float32)), torch.from_numpy(o.astype(np.float32))), -1
        )
        yield module + ".group_table", self._rows(hf, table.to(table_dtype))

    def _rows(self, hf: str, t: Tensor) -> Tensor:
        """A llama-architecture file's q and k rows in Hugging Face's order (llama.cpp's converter permutes
        each head's rows so that the rotary halves interleave)."""
        if self.arch != "llama" or not (hf.endswith("q_proj.weight") or hf.endswith("k_proj.weight")):
            return t
        heads = self._heads if "q_proj" in hf else self._kv_heads
        rows = t.shape[0]
        idx = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)
        return t[idx].contiguous()
