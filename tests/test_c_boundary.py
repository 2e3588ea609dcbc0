"""The C boundary declared once (csrc/parrot_ops.h, parrot.engine.kernels.c_boundary,
parrot.engine.kernels.native).

The header parses into every function and struct, and the ctypes side is derived
from it; the library exports exactly the declared functions; a definition or a call
that differs from the header fails to compile with the build's flags (so a mismatch
is a build error, not silent memory corruption); and the ctypes Structures lay out
the structs as the C compiler does (checked by a compiled program here, and by the
generated static assertions in every build).
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest
import torch

from parrot.engine.kernels import c_boundary, native
from parrot.engine.kernels.c_boundary import CType, Function, HeaderError

CSRC = Path(str(resources.files("parrot.engine.kernels").joinpath("csrc")))


@pytest.fixture(scope="module")
def cc() -> str:
    found = shutil.which("cc")
    if found is None:
        pytest.fail("no C compiler ('cc') on this machine: the C boundary cannot be checked")
    return found


def _compile(cc: str, tmp_path: Path, source: str, *, out: str = "x.o", link: bool = False) -> str:
    """Compile ``source`` (which may include parrot_ops.h) with the build's flags: ''
    when it compiles, else the compiler's messages."""
    path = tmp_path / "x.c"
    path.write_text(source)
    args = [cc, *native.compile_flags(), f"-I{CSRC}", str(path), "-o", str(tmp_path / out)]
    run = subprocess.run(args if link else [*args, "-c"], capture_output=True, text=True, timeout=120)
    return "" if run.returncode == 0 else run.stderr or "failed without a message"


def _c(t: CType) -> str:
    return ("const " if t.const else "") + t.base + (" *" if t.pointer else " ")


def _definition(fn: Function, returns: CType | None = None, params: list[str] | None = None) -> str:
    """A C definition of ``fn`` (or of a variant of it), with an empty body."""
    returns = fn.returns if returns is None else returns
    if params is None:
        params = [_c(p.type) + p.name for p in fn.params]
    body = "{ return 0; }" if returns != CType("void") else "{}"
    return f"{_c(returns)}{fn.name}({', '.join(params) or 'void'}) {body}\n"


_HEADER = '#include "parrot_ops.h"\n'


# ---------------------------------------------------------------- the header


def test_the_header_declares_every_op_and_struct() -> None:
    b = c_boundary.boundary()
    assert [s.name for s in b.structs] == ["ParrotDecodeLayer", "ParrotDecodeShape", "ParrotDecodeAttention"]
    assert len(b.functions) == 18 and all(f.name.startswith("parrot_") for f in b.functions)
    fns = {f.name: f for f in b.functions}
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    assert c_boundary.signature(fns["parrot_rope"], {}) == ([p, i64, i64, i64, i64, p, p, i], None)
    assert c_boundary.signature(fns["parrot_bf16_packed_size"], {}) == ([i64, i64], i64)
    assert c_boundary.signature(fns["parrot_bf16_linear_best"], {}) == ([], i)
    norm = c_boundary.signature(fns["parrot_add_rms_norm"], {})[0]
    assert norm[4] is ctypes.c_float and norm[2] is i


def test_struct_pointers_are_typed_and_other_pointers_are_addresses() -> None:
    """A struct pointer takes only that struct (a wrong one is refused by ctypes); data
    pointers take addresses (tensor.data_ptr()) or None."""
    lib = native.build()
    fn = lib.parrot_decode_forward
    layer, shape, plan = (
        c_boundary.struct(n) for n in ("ParrotDecodeLayer", "ParrotDecodeShape", "ParrotDecodeAttention")
    )
    assert fn.argtypes[0] is ctypes.POINTER(layer) and fn.argtypes[2] is ctypes.POINTER(shape)
    assert fn.argtypes[11] is ctypes.POINTER(plan) and fn.argtypes[3] is ctypes.c_void_p
    assert fn.argtypes[0].from_param((layer * 2)()) is not None
    with pytest.raises(TypeError):
        fn.argtypes[2].from_param(ctypes.byref(plan()))
    shape_fields = [name for name, _ in shape._fields_]
    assert shape_fields[:3] == ["tokens", "hidden", "heads"] and shape_fields[-1] == "kv_bf16"


def test_the_parser_reads_comments_lists_and_preprocessor_lines() -> None:
    b = c_boundary.parse(
        """
        #ifndef X_H
        #define X_H
        /* a struct */ typedef struct {
            const float *a, *b; // two pointers
            int64_t n, m;
            float eps;
        } S;
        int64_t parrot_f(const S *s, void *out, uint16_t *bits, int flag);
        void parrot_g(void);
        #endif
        """
    )
    (s,) = b.structs
    assert [(f.name, f.type) for f in s.fields] == [
        ("a", CType("float", True, True)),
        ("b", CType("float", True, True)),
        ("n", CType("int64_t")),
        ("m", CType("int64_t")),
        ("eps", CType("float")),
    ]
    f, g = b.functions
    assert f.returns == CType("int64_t") and [p.type.base for p in f.params] == [
        "S",
        "void",
        "uint16_t",
        "int",
    ]
    assert g.params == () and g.returns == CType("void")
    cls = c_boundary.ctypes_structs(b)["S"]
    assert c_boundary.signature(f, {"S": cls})[0][0] is ctypes.POINTER(cls)


@pytest.mark.parametrize(
    "text",
    [
        "double parrot_f(int x);",  # a type outside the subset
        "int parrot_f(double x);",
        "int parrot_f(unsigned int x);",
        "int parrot_f(float **x);",  # two levels of pointer
        "int parrot_f(float x[4]);",  # an array
        "int parrot_f(int (*cb)(int));",  # a function pointer
        "int parrot_f(int x, ...);",  # varargs
        "int parrot_f();",  # no prototype: (void) is required
        "int parrot_f(int);",  # an unnamed parameter
        "int parrot_f(intx y);",  # an unknown type name, not 'int' and 'x'
        "int helper(int x);",  # not a parrot_* name
        "int parrot_f(const T *t);",  # a struct not declared above
        "typedef struct { int a; } S; int parrot_f(S s);",  # a struct by value
        "typedef struct { int a[2]; } S;",  # an array field
        "typedef struct Tag { int a; } S;",  # a tagged struct
        "typedef int myint;",
        "int parrot_f(int x)",  # no ';'
        "int parrot_f(int x); int parrot_f(int x);",  # declared twice
    ],
)
def test_the_parser_refuses_what_it_cannot_read(text: str) -> None:
    with pytest.raises(HeaderError):
        c_boundary.parse(text)


def test_bind_names_a_function_the_library_lacks() -> None:
    with pytest.raises(AttributeError, match="parrot_"):
        c_boundary.bind(ctypes.CDLL(None))  # this process: no parrot_* functions


# ------------------------------------------------------------ the build checks


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_the_library_exports_exactly_the_declared_functions(cc: str, portable: bool) -> None:
    del cc
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("no 'nm' (binutils) on this machine: the exports cannot be listed")
    lib = native.build(portable=portable)
    run = subprocess.run([nm, "-D", "--defined-only", lib._name], capture_output=True, text=True, check=True)
    functions = {line.split()[2] for line in run.stdout.splitlines() if line.split()[1] == "T"}
    declared = {f.name for f in c_boundary.boundary().functions}
    assert functions - {"_init", "_fini"} == declared


def test_definitions_as_parsed_compile_against_the_header(cc: str, tmp_path: Path) -> None:
    """Every prototype, rendered back from what the parser read, is a valid definition
    of the header's function: the parser and the compiler read the same types."""
    source = _HEADER + "".join(_definition(f) for f in c_boundary.boundary().functions)
    assert _compile(cc, tmp_path, source) == ""


def _swapped(t: CType) -> CType:
    """Another type of the subset for ``t``: int <-> int64_t, float -> int, a pointer's
    target changed, void (return) -> int."""
    if t.pointer:
        return CType("int64_t" if t.base != "int64_t" else "float", True, t.const)
    return CType({"int": "int64_t", "int64_t": "int", "float": "int", "void": "int"}[t.base])


def _mismatches() -> list[tuple[str, str]]:
    """(id, definition) pairs: for each function, one with an extra parameter and one with
    its first parameter's (or, without parameters, its return) type changed."""
    out = []
    for f in c_boundary.boundary().functions:
        own = [_c(p.type) + p.name for p in f.params]
        out.append((f"{f.name}-extra-param", _definition(f, params=[*own, "int extra"])))
        if f.params:
            first = _c(_swapped(f.params[0].type)) + f.params[0].name
            out.append((f"{f.name}-first-param", _definition(f, params=[first, *own[1:]])))
        else:
            out.append((f"{f.name}-return", _definition(f, returns=_swapped(f.returns))))
    return out


@pytest.mark.parametrize(("case", "definition"), _mismatches(), ids=[c for c, _ in _mismatches()])
def test_a_definition_that_differs_from_the_header_fails_to_compile(
    cc: str, tmp_path: Path, case: str, definition: str
) -> None:
    del case
    assert "conflicting types" in _compile(cc, tmp_path, _HEADER + definition)


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("int parrot_new_op(int x) { return x; }\n", "no previous prototype"),  # not in the header
        ("static int f(void) { return parrot_undeclared(1); }\n", "implicit declaration"),
        ("static int f(void) { return parrot_bf16_linear_best(1); }\n", "too many arguments"),
        ("static void f(int64_t *w) { parrot_f32_pack(w, 1, 1, 0); }\n", "incompatible pointer type"),
        ("static void f(void) { parrot_f32_pack(0, 1, 1, 5); }\n", "makes pointer from integer"),
    ],
)
def test_a_call_or_export_outside_the_header_fails_to_compile(
    cc: str, tmp_path: Path, source: str, error: str
) -> None:
    assert error in _compile(cc, tmp_path, _HEADER + source)


# ------------------------------------------------------------ struct layouts


def _layout_program() -> str:
    """C printing ``struct field offset`` lines, with ``sizeof`` and ``alignof`` as fields."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", _HEADER, "int main(void) {"]
    for s in c_boundary.boundary().structs:
        n = s.name
        lines.append(f'    printf("{n} sizeof %zu\\n", sizeof({n}));')
        lines.append(f'    printf("{n} alignof %zu\\n", _Alignof({n}));')
        lines += [f'    printf("{n} {f.name} %zu\\n", offsetof({n}, {f.name}));' for f in s.fields]
    return "\n".join([*lines, "    return 0;", "}", ""])


def test_ctypes_lays_out_the_structs_as_the_compiler_does(cc: str, tmp_path: Path) -> None:
    assert _compile(cc, tmp_path, _layout_program(), out="layout", link=True) == ""
    run = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True, timeout=60)
    from_c = {tuple(line.split()[:2]): int(line.split()[2]) for line in run.stdout.splitlines()}
    from_ctypes = {}
    for name, cls in c_boundary.ctypes_structs(c_boundary.boundary()).items():
        from_ctypes[name, "sizeof"] = ctypes.sizeof(cls)
        from_ctypes[name, "alignof"] = ctypes.alignment(cls)
        from_ctypes.update({(name, f): getattr(cls, f).offset for f, _ in cls._fields_})
    assert from_c == from_ctypes and len(from_c) == 3 * 2 + 9 + 12 + 13


def test_the_build_rejects_a_ctypes_layout_the_compiler_does_not_have(cc: str, tmp_path: Path) -> None:
    """The generated static assertions compile for the header's Structures and fail for
    one whose fields ctypes would place elsewhere."""
    assert _compile(cc, tmp_path, c_boundary.layout_check_source()) == ""
    good = c_boundary.struct("ParrotDecodeShape")
    fields = [(n, ctypes.c_double if n == "scale" else t) for n, t in good._fields_]
    wrong = type("ParrotDecodeShape", (ctypes.Structure,), {"_fields_": fields})
    assert "static assertion failed" in _compile(
        cc, tmp_path, c_boundary.layout_check_source({"ParrotDecodeShape": wrong})
    )


# ------------------------------------------------------------ the portable build


def test_the_portable_build_targets_the_compilers_default_cpu() -> None:
    native_flags, portable_flags = native.compile_flags(), native.compile_flags(portable=True)
    assert "-march=native" in native_flags
    assert not any(f.startswith(("-march", "-mcpu", "-mtune")) for f in portable_flags)
    assert "-DPARROT_PORTABLE" in portable_flags
    strict = [f for f in native_flags if f.startswith("-Werror")]
    assert len(strict) == 4 and all(f in portable_flags for f in strict)


def _vector_registers(path: str) -> set[str]:
    """The AVX (ymm), AVX-512 (zmm) and AMX (tmm) registers the library's code names."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.fail("no 'objdump' (binutils) on this machine: the code cannot be inspected")
    run = subprocess.run([objdump, "-d", path], capture_output=True, text=True, check=True, timeout=120)
    return {kind for kind in ("ymm", "zmm", "tmm") if f"%{kind}" in run.stdout}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="inspects x86-64 machine code")
def test_the_portable_build_has_no_avx_code_and_the_native_one_has_this_cpus(cc: str) -> None:
    del cc
    assert _vector_registers(native.build(portable=True)._name) == set()
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512f" in cpu:  # the check can fail: the native build of this CPU has AVX-512 code
        assert "zmm" in _vector_registers(native.build()._name)


def _layer_ops(lib: ctypes.CDLL) -> list[torch.Tensor]:
    """RMSNorm (with a residual add), RoPE and SiLU-mul of fixed inputs through ``lib``."""
    gen = torch.Generator().manual_seed(0)
    h, delta, w, x, cos, sin, gu = (
        torch.randn(shape, generator=gen)
        for shape in [(5, 40), (5, 40), (40,), (5, 48), (5, 16), (5, 16), (5, 74)]
    )
    norm, act = torch.empty(5, 40), torch.empty(5, 37)
    lib.parrot_add_rms_norm(
        h.data_ptr(), delta.data_ptr(), 0, w.data_ptr(), 1e-5, 5, 40, norm.data_ptr(), 0, 2
    )
    lib.parrot_rope(x.data_ptr(), 5, 3, 16, 48, cos.data_ptr(), sin.data_ptr(), 2)
    lib.parrot_silu_mul(gu.data_ptr(), 0, 5, 37, act.data_ptr(), 0, 2)
    return [h, norm, x, act]


def test_both_builds_load_bind_and_compute_alike() -> None:
    """The native and the portable library each load with every binding, and their layer
    ops agree to fp32 rounding (the vector and the portable C sum in other orders)."""
    native_out, portable_out = (_layer_ops(native.build(portable=p)) for p in (False, True))
    for a, b in zip(native_out, portable_out, strict=True):
        assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert native_out[0].equal(portable_out[0])  # the residual add is one rounding either way
