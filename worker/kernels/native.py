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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from worker.cache_dir import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
LINEAR_SOURCE = Path(__file__).with_name("linear.c")
# decode_stack.c calls into the other two: the three are linked into one library
STACK_SOURCES = (Path(__file__).with_name("decode_stack.c"), LINEAR_SOURCE, SOURCE)
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


def _build(cc: str, source: Path | tuple[Path, ...], extra_flags: tuple[str, ...] = ()) -> Path:
    """The library built from `source` (one file, or several linked into one library) for this machine
    (extra_flags: e.g. a narrower -march, in tests)."""
    sources = (source,) if isinstance(source, Path) else source
    flags = FLAGS + (X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else []) + list(extra_flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    headers = sorted(sources[0].parent.glob("*.h"))  # what the sources #include
    texts = [f.read_text() for f in (*sources, *headers)]
    key = hashlib.sha256("\0".join([*texts, cc, version, *flags, _cpu_features()]).encode()).hexdigest()[:16]
    target = cache_dir() / "native" / f"{sources[0].stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, *map(str, sources), "-o", tmp], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {sources[0].name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: another worker sees the whole library or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU kernel %s: %s", sources[0].name, target)
    return target


@functools.cache
def _load(source: Path | tuple[Path, ...], what: str) -> ctypes.CDLL | None:
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


def cache_supported(k_cache: Tensor) -> bool:
    """Whether the kernel reads this cache [KVH, NB, BS, D]: on the CPU, float32, bfloat16 or FP8 E4M3,
    head_dim a multiple of 16 up to MAX_D."""
    d = k_cache.shape[3]
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in ELEMENT_TYPES
        and d % 16 == 0
        and d <= MAX_D
        and library() is not None
    )


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the kernel handles this call: a cache it reads (cache_supported), CPU queries, at most
    MAX_G query heads per kv head."""
    return q.device.type == "cpu" and q.shape[1] // k_cache.shape[0] <= MAX_G and cache_supported(k_cache)


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
PANEL = 32  # linear.c's PANEL: output columns per panel of a packed weight


def pack(weight: Tensor) -> Tensor:
    """nn.Linear's weight [N, K] -> linear.c's packed layout [ceil(N / PANEL), K, PANEL] (same dtype):
    panel p holds outputs p * PANEL .. p * PANEL + PANEL - 1, K rows of PANEL contiguous values, zeros
    past N."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack(packed: Tensor, n: int) -> Tensor:
    """pack's inverse: [panels, K, PANEL] -> [n, K]."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:n].contiguous()


def packed_rows(packed: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` of the unpacked weight [N, K], gathered from the packed one: [T] -> [T, K]."""
    return packed[ids // PANEL, :, ids % PANEL]


def linear_supports(x: Tensor, weight: Tensor) -> bool:
    """Whether linear.c handles y = x W^T: float32 x on the CPU, a float32, bfloat16 or int8 weight."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and weight_supported(weight)


def weight_supported(weight: Tensor) -> bool:
    """Whether linear.c takes this weight [N, K] (once packed): on the CPU, float32, bfloat16 or int8."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in WEIGHT_TYPES
        and linear_library() is not None
    )


def is_packed(weight: Tensor, n: int, k: int) -> bool:
    """Whether `weight` is a packed [n, k] weight linear.c can read."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in WEIGHT_TYPES
        and weight.shape == (-(-n // PANEL), k, PANEL)
        and weight.is_contiguous()
    )


def linear(x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, n: int) -> Tensor:
    """y = x W^T (* scale per output) (+ bias). x: [M, K] float32; weight: W [n, K] packed (`pack`);
    scale, bias: [n] float32 or None (scale required for int8). -> [M, n] float32. Called once per
    linear layer per step, so it checks only what is cheap."""
    lib = linear_library()
    assert lib is not None and (scale is not None) == (weight.dtype == torch.int8)
    m, k = x.shape
    assert weight.dim() == 3 and weight.shape[1] == k and weight.shape[0] * PANEL >= n, "pack() the weight"
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.batchq_linear(
        x.data_ptr(), weight.data_ptr(), None if scale is None else scale.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), m, k, n, WEIGHT_TYPES[weight.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, f"linear.c refused [{m}, {k}] x [{n}, {k}] {weight.dtype}"
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
    for fn in (_load, library, linear_library, stack_library):
        fn.cache_clear()


# --------------------------------------------------------------------------- the fused decode stack
class _Lin(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("elem", ctypes.c_int),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Lin),
        ("o", _Lin),
        ("gate_up", _Lin),
        ("down", _Lin),
        *((name, ctypes.c_void_p) for name in ("ln1", "ln2", "q_norm", "k_norm", "k_cache", "v_cache")),
        *((name, ctypes.c_float) for name in ("q_scale", "k_scale", "v_scale")),
    ]


class _Spec(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_int)
            for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter")
        ),
        ("eps", ctypes.c_float),
        *((name, ctypes.c_int) for name in ("kv_elem", "num_blocks", "block_size")),
        ("final_norm", ctypes.c_void_p),
    ]


@functools.cache
def stack_library() -> ctypes.CDLL | None:
    """The loaded decode stack (decode_stack.c with linear.c and paged_decode.c), or None where it cannot
    be built or is switched off (BATCHQ_NATIVE_STACK=0 alone, or with the linear kernel)."""
    if os.environ.get("BATCHQ_NATIVE_STACK", "1") == "0" or linear_library() is None:
        log.info("the decode stack runs layer by layer")
        return None
    lib = _load(STACK_SOURCES, "the decode stack")
    if lib is None:
        return None
    lib.batchq_decode_stack.restype = ctypes.c_int
    lib.batchq_decode_stack.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 5
    lib.batchq_decode_stack.argtypes += [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int]
    lib.batchq_decode_stack_workspace.restype = ctypes.c_long
    lib.batchq_decode_stack_workspace.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 3
    return lib


STACK_CACHE_TYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)  # decode_stack.c writes these


@dataclass
class StackLinear:
    weight: Tensor  # packed [out, in] (pack)
    scale: Tensor | None  # [out] float32, int8 weights only
    bias: Tensor | None  # [out] float32


@dataclass
class StackLayer:
    qkv: StackLinear  # q, k, v stacked as rows
    o: StackLinear
    gate_up: StackLinear  # gate rows, then up rows
    down: StackLinear
    input_norm: Tensor  # [hidden] float32
    post_attention_norm: Tensor
    q_norm: Tensor | None  # [head_dim] (Qwen3)
    k_norm: Tensor | None
    k_cache: Tensor  # [kv_heads, num_blocks, block_size, head_dim]: float32, bfloat16 or FP8 E4M3
    v_cache: Tensor
    q_scale: float  # what q is multiplied by: the softmax scale times k_scale (llama.py's Attention's)
    k_scale: float = 1.0  # the cache holds K / k_scale, V / v_scale (FP8's calibrated scales)
    v_scale: float = 1.0


class DecodeStack:
    """Every layer of a decode step in one call of decode_stack.c: pointers to the weights, norms and caches
    are gathered once; the call passes the step's rows and metadata. Check `stack_supported` first."""

    def __init__(
        self,
        layers: list[StackLayer],
        final_norm: Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> None:
        lib = stack_library()
        assert lib is not None
        self._lib = lib
        self._keep = (layers, final_norm)  # the pointers below stay valid while these live
        first = layers[0]
        _, nb, bs, _ = first.k_cache.shape
        self.hidden = first.input_norm.shape[0]
        self.spec = _Spec(
            len(layers), self.hidden, heads, kv_heads, head_dim, first.down.weight.shape[1], eps,
            ELEMENT_TYPES[first.k_cache.dtype], nb, bs, final_norm.data_ptr(),
        )  # fmt: skip

        def opt(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        def lin(x: StackLinear) -> _Lin:
            return _Lin(x.weight.data_ptr(), opt(x.scale), opt(x.bias), WEIGHT_TYPES[x.weight.dtype])

        self.layers = (_Layer * len(layers))(
            *(
                _Layer(
                    lin(x.qkv),
                    lin(x.o),
                    lin(x.gate_up),
                    lin(x.down),
                    x.input_norm.data_ptr(),
                    x.post_attention_norm.data_ptr(),
                    opt(x.q_norm),
                    opt(x.k_norm),
                    x.k_cache.data_ptr(),
                    x.v_cache.data_ptr(),
                    x.q_scale,
                    x.k_scale,
                    x.v_scale,
                )
                for x in layers
            )
        )
        self._workspace = torch.empty(0, dtype=torch.float32)

    def __call__(
        self, h: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, block_tables: Tensor, context_lens: Tensor
    ) -> Tensor:
        """h: [M, hidden] float32, the embedded tokens (updated in place: the residual stream); cos, sin:
        [M, head_dim]; slots: [M] int64; block_tables: [M, W] int32; context_lens: [M] int32.
        -> [M, hidden]: the final norm of the last layer's output."""
        m = h.shape[0]
        threads = torch.get_num_threads()
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        slots = slots.to(torch.int64).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        max_len = max(int(lens.max()), 1) if m else 1
        need = self._lib.batchq_decode_stack_workspace(ctypes.byref(self.spec), m, max_len, threads)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(max(need, 2 * self._workspace.numel()), dtype=torch.float32)
        out = torch.empty(m, self.hidden, dtype=torch.float32)
        rc = self._lib.batchq_decode_stack(
            ctypes.byref(self.spec), self.layers, h.data_ptr(), out.data_ptr(), m, cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1], max_len,
            self._workspace.data_ptr(), threads,
        )  # fmt: skip
        assert rc == 0
        return out


def stack_supported(layers: list[StackLayer], heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether decode_stack.c takes these layers: every linear packed for linear.c in the shape the heads
    imply, float32 norms, scales and biases, one float32, bfloat16 or FP8 cache layout in the
    kv-head-major order, and paged_decode.c's head limits."""
    if stack_library() is None or not layers:
        return False
    cache = layers[0].k_cache
    hidden, q_size = layers[0].input_norm.shape[0], heads * head_dim
    nqkv, inter = q_size + 2 * kv_heads * head_dim, layers[0].down.weight.shape[1]
    shapes = ((nqkv, hidden), (hidden, q_size), (2 * inter, hidden), (hidden, inter))

    def vector(t: Tensor | None, n: int) -> bool:  # absent, or n contiguous float32 values
        return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.shape == (n,))

    for x in layers:
        for lin, (n, k) in zip((x.qkv, x.o, x.gate_up, x.down), shapes, strict=True):
            if not is_packed(lin.weight, n, k) or (lin.scale is not None) != (lin.weight.dtype == torch.int8):
                return False
            if not (vector(lin.scale, n) and vector(lin.bias, n)):
                return False
        norms = (
            (x.input_norm, hidden),
            (x.post_attention_norm, hidden),
            (x.q_norm, head_dim),
            (x.k_norm, head_dim),
        )
        if not all(vector(t, n) for t, n in norms):
            return False
        caches = (x.k_cache, x.v_cache)
        if any(
            c.dtype not in STACK_CACHE_TYPES or not c.is_contiguous() or c.device.type != "cpu"
            for c in caches
        ):
            return False
        if any(c.shape != cache.shape or c.dtype != cache.dtype for c in caches):
            return False
    if cache.shape[0] != kv_heads or cache.shape[3] != head_dim:
        return False
    return head_dim % 16 == 0 and head_dim <= MAX_D and heads % kv_heads == 0 and heads // kv_heads <= MAX_G
