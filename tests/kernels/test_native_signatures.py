"""The ctypes signatures of the C kernels against their C prototypes.

ctypes trusts what Python declares: an argument declared c_int where the C function takes a long, or one
argument too few, is no exception but a corrupt call (a segfault at best). Each binding module declares
the signature of every C function it calls, once (SIGNATURES); this test reads the exported `batchq_*`
definitions from the C sources and checks each declaration's return type and arguments, kind and width,
in order; and every struct a binding declares (STRUCTS) against its C typedef, field by field.
"""

from __future__ import annotations

import ctypes
import re
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from worker.kernels import (
    native_attention,
    native_build,
    native_linear,
    native_lora,
    native_moe,
    native_stack,
)

BINDINGS = (native_attention, native_linear, native_lora, native_moe, native_stack)
# C scalar types -> the ctypes type of that width; every pointer is passed as c_void_p
SCALARS: dict[str, Any] = {
    "void": None,
    "int": ctypes.c_int,
    "long": ctypes.c_long,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "size_t": ctypes.c_size_t,
}
DEFINITION = re.compile(r"^(?!static\b)([A-Za-z_][\w \t\*]*?)\b(batchq_\w+)\s*\(([^)]*)\)\s*\{", re.MULTILINE)
STRUCT = re.compile(r"typedef\s+struct\s*(?:\w+\s*)?\{([^}]*)\}\s*(\w+)\s*;")  # with a tag or without


def without_comments(source: str) -> str:
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.DOTALL)
    source = re.sub(r"//[^\n]*", " ", source)
    return re.sub(r"^\s*#[^\n]*", " ", source, flags=re.MULTILINE)  # preprocessor lines


def ctype(declaration: str) -> Any:
    """One C declaration without its name ('const float *', 'int') -> its ctypes type."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = [w for w in declaration.split() if w not in ("const", "volatile", "unsigned", "signed")]
    assert len(words) == 1 and words[0] in SCALARS, f"no ctypes type for C type {declaration!r}"
    return SCALARS[words[0]]


def parameter(param: str) -> Any:
    """'const float *x' -> c_void_p; 'int M' -> c_int."""
    match = re.fullmatch(r"(.*?)(\w+)\s*", param.strip())
    assert match is not None, param
    return ctype(match.group(1))


def prototypes(source: str) -> dict[str, tuple[Any, list[Any]]]:
    """Every exported (non-static) batchq_* function defined in a C source: name -> (restype, argtypes)."""
    out = {}
    for ret, name, params in DEFINITION.findall(without_comments(source)):
        args = [] if params.strip() in ("", "void") else [parameter(p) for p in params.split(",")]
        out[name] = (ctype(ret), args)
    return out


def type_name(t: Any) -> str:
    return "void" if t is None else str(t.__name__)


def mismatches(signatures: dict[str, native_build.Signature], sources: tuple[Path, ...]) -> list[str]:
    """Each declared signature that disagrees with the C definition of its function (or has none)."""
    defined: dict[str, tuple[Any, list[Any]]] = {}
    for path in sources:
        defined.update(prototypes(path.read_text()))
    bad = []
    for name, sig in signatures.items():
        if name not in defined:
            bad.append(f"{name}: not defined in {[p.name for p in sources]}")
            continue
        restype, argtypes = defined[name]
        if sig.restype != restype:
            bad.append(f"{name}: returns {type_name(restype)}, declared {type_name(sig.restype)}")
        if len(sig.argtypes) != len(argtypes):
            bad.append(f"{name}: takes {len(argtypes)} arguments, declared {len(sig.argtypes)}")
        for i, (want, got) in enumerate(zip(argtypes, sig.argtypes, strict=False)):
            if want != got:
                bad.append(f"{name}: argument {i} is {type_name(want)}, declared {type_name(got)}")
    return bad


@pytest.mark.parametrize("module", BINDINGS, ids=lambda m: m.__name__.rpartition(".")[2])
def test_every_declared_signature_matches_its_c_definition(module: ModuleType) -> None:
    assert module.SIGNATURES, "a binding that calls no C function"
    assert mismatches(module.SIGNATURES, module.SOURCES) == []


def test_the_parser_reads_every_exported_function() -> None:
    found: dict[str, tuple[Any, list[Any]]] = {}
    for path in sorted(native_build.KERNELS.glob("*.c")):
        found.update(prototypes(path.read_text()))
    assert {"batchq_paged_decode", "batchq_linear", "batchq_decode_stack", "batchq_linear_part_w"} <= set(
        found
    )
    assert found["batchq_rotary"] == (
        None,
        [ctypes.c_void_p, *[ctypes.c_int] * 2, *[ctypes.c_long] * 2, *[ctypes.c_void_p] * 2, ctypes.c_int],
    )


def test_a_wrong_declaration_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "fake.c"
    path.write_text(
        textwrap.dedent(
            """
        /* a comment: int batchq_fake(int x) { */
        long batchq_sum(const float *x, long n, int threads, float eps) {
            return 0;
        }
        static void batchq_hidden(int a) { }
        """
        )
    )
    sig = native_build.Signature
    good = {"batchq_sum": sig(ctypes.c_long, [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float])}
    bad = {
        "batchq_sum": sig(ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]),
        "batchq_hidden": sig(None, [ctypes.c_int]),  # static: not exported
    }
    assert set(prototypes(path.read_text())) == {"batchq_sum"}
    assert mismatches(good, (path,)) == []
    assert mismatches(bad, (path,)) == [
        "batchq_sum: returns c_long, declared c_int",
        "batchq_sum: takes 4 arguments, declared 3",
        "batchq_sum: argument 1 is c_long, declared c_int",
        "batchq_hidden: not defined in ['fake.c']",
    ]


def c_structs(source: str) -> dict[str, list[tuple[str, Any]]]:
    """The typedef'd structs of a C source: name -> [(field, its ctypes type, or its struct's name)]."""
    out = {}
    for body, name in STRUCT.findall(without_comments(source)):
        fields: list[tuple[str, Any]] = []
        for decl in filter(str.strip, body.split(";")):
            match = re.fullmatch(r"\s*(?:const\s+)?(\w+)\s+(.*)", decl, flags=re.DOTALL)
            assert match is not None, decl
            kind, declarators = match.groups()  # "float", "*ln1, *ln2"
            for d in declarators.split(","):
                field = d.strip().lstrip("*").strip()
                fields.append((field, ctypes.c_void_p if "*" in d else SCALARS.get(kind, kind)))
        out[name] = fields
    return out


def headers_and(sources: tuple[Path, ...]) -> dict[str, list[tuple[str, Any]]]:
    """The typedef'd structs of `sources` and of every header beside them (what they #include)."""
    structs: dict[str, list[tuple[str, Any]]] = {}
    for path in (*sources, *sorted(native_build.KERNELS.glob("*.h"))):
        structs.update(c_structs(path.read_text()))
    return structs


@pytest.mark.parametrize("module", BINDINGS, ids=lambda m: m.__name__.rpartition(".")[2])
def test_every_declared_struct_matches_its_c_typedef(module: ModuleType) -> None:
    # a field in the wrong place or of the wrong width moves every field after it
    declared_structs = getattr(module, "STRUCTS", {})
    structs = headers_and(module.SOURCES)
    assert set(declared_structs) <= set(structs), set(declared_structs) - set(structs)
    for name, cls in declared_structs.items():
        declared = [
            (field, next((n for n, c in declared_structs.items() if c is kind), kind))
            for field, kind in cls._fields_
        ]
        assert declared == structs[name], name


def test_the_struct_parser_reads_tagged_and_nested_structs() -> None:
    source = """typedef struct Tuned { int a; /* a comment } */ int b; } Tuned;
                typedef struct { Tuned t; const float *p, *q; float f; } Outer;"""
    assert c_structs(source) == {
        "Tuned": [("a", ctypes.c_int), ("b", ctypes.c_int)],
        "Outer": [("t", "Tuned"), ("p", ctypes.c_void_p), ("q", ctypes.c_void_p), ("f", ctypes.c_float)],
    }
    assert set(native_linear.STRUCTS) == {"LinearWeight", "LinearTuning"}  # both of linear.h's


def test_a_bound_library_offers_its_declared_functions_only() -> None:
    lib = native_linear.library()
    if lib is None:
        pytest.skip("no C compiler here")
    assert lib.batchq_linear.argtypes == native_linear.SIGNATURES["batchq_linear"].argtypes
    with pytest.raises(AttributeError):
        lib.batchq_linear_part_w  # noqa: B018 (exported, but not for Python: undeclared, unreachable)
