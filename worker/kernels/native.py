"""The CPU kernels in C, compiled on first use for this machine and loaded by ctypes.

paged_decode.c, decode attention: the torch decode path copies every sequence's K/V blocks into a
workspace and then reads them again in two batched matmuls; decode is memory-bound, so that copy is most
of its time. The C kernel reads each block in place, once, on torch's OpenMP threads. On 2 Ice Lake
cores, float32, SmolLM2-135M's heads (9 over 3 kv heads, dim 64), 64 sequences of 100-850 tokens in
shuffled blocks, 30 layers' caches so reads come from DRAM: 5.9 ms per layer against 16.1 ms for the
torch path, 2.2-2.7x from 8 to 64 sequences
(`python benchmarks/kernel_bench.py --cpu --heads 9 --kv-heads 3 --head-dim 64 --dtype float32`).

linear.c, the linear layers (y = x W^T + b, W in nn.Linear's [out, in] layout, float32, bfloat16 or
int8 with a scale per output row): each weight row is streamed once per call and multiplied with every
row of x from registers, where MKL's sgemm runs far below memory bandwidth at decode sizes
(`python benchmarks/kernel_bench.py --linear`).

Building needs a C compiler (`$CC`, else cc, gcc or clang on PATH). Each library is cached under
$BATCHQ_CACHE_DIR/native, keyed by the source, the compiler, its flags and this CPU's features, and
written atomically, so concurrent workers share one build. Without a compiler, when the build fails,
or with BATCHQ_NATIVE_KERNELS=0, the torch paths run instead (one warning says why);
BATCHQ_NATIVE_LINEAR=0 turns off the linear kernel alone (to compare the two paths).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from worker.cache_dir import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
LINEAR_SOURCE = Path(__file__).with_name("linear.c")
MAX_D, MAX_G = 256, 16  # paged_decode.c's limits
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",  # needs libgomp.so.1: torch's own copy is already loaded, so its thread pool is reused
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=fast",
    "-shared",
    "-fPIC",
    "-lm",
]
X86_FLAGS = ["-mprefer-vector-width=512"]  # where AVX-512 exists, use all of it (ignored elsewhere)


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str, source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The library built from `source` for this machine (extra_flags: e.g. a narrower -march, in tests)."""
    flags = FLAGS + (X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else []) + list(extra_flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), cc, version, *flags, _cpu_features()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "native" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, str(source), "-o", tmp], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: another worker sees the whole library or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU kernel %s: %s", source.name, target)
    return target


@functools.cache
def _load(source: Path, what: str) -> ctypes.CDLL | None:
    if os.environ.get("BATCHQ_NATIVE_KERNELS", "1") == "0":
        log.info("BATCHQ_NATIVE_KERNELS=0: %s runs on the torch path", what)
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (set CC or install gcc): %s runs on the slower torch path", what)
        return None
    try:
        return ctypes.CDLL(str(_build(cc, source)))
    except (OSError, RuntimeError) as exc:
        log.warning("CPU kernel for %s unavailable, using the torch path: %s", what, exc)
        return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded decode attention kernel, or None (with one warning) where it cannot be built or is
    switched off."""
    lib = _load(SOURCE, "decode attention")
    if lib is None:
        return None
    fn = lib.batchq_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 10
    return lib


ELEMENT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}  # paged_decode.c's `elem`


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the kernel handles this call: CPU tensors, a float32, bfloat16 or FP8 E4M3 cache, head_dim
    a multiple of 16 up to MAX_D, at most MAX_G query heads per kv head."""
    kvh, _, _, d = k_cache.shape
    return (
        q.device.type == "cpu"
        and k_cache.dtype in ELEMENT_TYPES
        and d % 16 == 0
        and d <= MAX_D
        and q.shape[1] // kvh <= MAX_G
        and library() is not None
    )


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    lse: Tensor | None = None,
) -> Tensor | None:
    """torch_attention.TorchAttention.paged_decode_attention's contract, caches [KVH, NB, BS, D] (check
    `supports` first). -> [batch, heads, head_dim] in q's dtype (float32 when `lse` is given), or None
    if the kernel could not allocate its scratch memory. `lse`: a contiguous float32 [batch, heads] that
    receives each row's log-sum-exp of its scaled scores (to merge with attention over other keys)."""
    lib = library()
    assert lib is not None
    b, h, d = q.shape
    kvh, nb, bs, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
    assert lse is None or (lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (b, h))
    qs = (q.float() * scale).contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    max_len = max(int(lens.max()), 1) if b else 1
    rc = lib.batchq_paged_decode(
        qs.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        None if lse is None else lse.data_ptr(), tables.data_ptr(), lens.data_ptr(), b, h, kvh, d, bs, nb,
        tables.shape[1], max_len, ELEMENT_TYPES[k_cache.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        return None
    return out if lse is not None else out.to(q.dtype)


@functools.cache
def linear_library() -> ctypes.CDLL | None:
    """The loaded linear kernel (linear.c), or None (with one warning) where it cannot be built or is
    switched off."""
    if os.environ.get("BATCHQ_NATIVE_LINEAR", "1") == "0":  # to compare with the torch path
        log.info("BATCHQ_NATIVE_LINEAR=0: the linear layers run on the torch path")
        return None
    lib = _load(LINEAR_SOURCE, "the linear layers")
    if lib is None:
        return None
    fn = lib.batchq_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
    lib.batchq_rmsnorm.restype = None
    lib.batchq_rmsnorm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float]
    lib.batchq_rotary.restype = None
    lib.batchq_rotary.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 2 + [ctypes.c_long] * 2
    lib.batchq_rotary.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int]
    return lib


WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # linear.c's `elem`


def linear_supports(x: Tensor, weight: Tensor) -> bool:
    """Whether linear.c handles y = x W^T: float32 x on the CPU, a float32, bfloat16 or int8 weight
    whose input size is a multiple of 16."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and weight_supported(weight)


def weight_supported(weight: Tensor) -> bool:
    """Whether linear.c takes this weight [N, K]: on the CPU, contiguous, float32, bfloat16 or int8,
    K a multiple of 16."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in WEIGHT_TYPES
        and weight.is_contiguous()
        and weight.shape[1] % 16 == 0
        and linear_library() is not None
    )


def linear(x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None) -> Tensor:
    """y = x W^T (* scale per output) (+ bias). x: [M, K] float32; weight: [N, K] (weight_supported);
    scale, bias: [N] float32 or None (scale required for int8). -> [M, N] float32. Called once per
    linear layer per step, so it checks only what is cheap."""
    lib = linear_library()
    assert lib is not None and (scale is not None) == (weight.dtype == torch.int8)
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.batchq_linear(
        x.data_ptr(), weight.data_ptr(), None if scale is None else scale.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), m, k, n, WEIGHT_TYPES[weight.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, f"linear.c refused [{m}, {k}] x [{n}, {weight.shape[1]}] {weight.dtype}"
    return out


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's RMSNorm of float32 rows x [T, D] (contiguous) with a float32 weight [D]."""
    lib = linear_library()
    assert lib is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
    x = x.contiguous()
    out = torch.empty_like(x)
    t, d = x.shape
    lib.batchq_rmsnorm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), t, d, eps)
    return out


def rotary_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate float32 x [T, H, D] in place (any row and head strides, unit stride within a head) by the
    contiguous float32 rows cos, sin [T, D]: Hugging Face's rotate-half rotary embedding."""
    lib = linear_library()
    assert lib is not None and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.stride(2) == 1
    assert cos.is_contiguous() and sin.is_contiguous()
    t, h, d = x.shape
    lib.batchq_rotary(x.data_ptr(), t, h, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), d)


def clear_caches() -> None:
    """Forget every loaded library, as a new process would (tests)."""
    for fn in (_load, library, linear_library):
        fn.cache_clear()
