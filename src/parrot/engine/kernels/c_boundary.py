"""The Python side of Parrot's C ops, derived from their one header, ``csrc/parrot_ops.h``.

The header is the only declaration of what crosses between Python and C.  The
compiler checks every definition in the C sources against it (:mod:`parrot.engine.kernels.native`
builds with flags that make a conflicting or missing prototype an error), and this
module reads it to give the ctypes side, so nothing is declared twice:

* :func:`bind` sets every ``parrot_*`` function's ``argtypes`` and ``restype`` on a
  loaded library (raising if the library lacks one);
* :func:`struct` is the :class:`ctypes.Structure` of a struct of the header;
* :func:`layout_check_source` is C that the build compiles with the ops: one
  ``_Static_assert`` per struct size, alignment and field offset as ctypes lays them
  out, so a struct ctypes would lay out differently from the compiler fails the build.

The parser reads a restricted subset of C, the one the header's opening comment
documents; anything else raises :class:`HeaderError` naming the statement, so the
header cannot grow a construct the bindings would misread:

* comments and preprocessor lines are skipped; statements end at ``;`` (outside braces);
* ``typedef struct { FIELDS } Name;`` with FIELDS ``[const] TYPE [*]name[, [*]name];``;
* ``RET parrot_name(PARAMS);`` with PARAMS ``void`` or ``[const] TYPE [*]name, ...``;
* TYPE: ``void``, ``int``, ``int64_t``, ``float``, ``uint16_t`` or a struct declared
  above; by value only ``int``, ``int64_t``, ``float`` (and ``void`` as a return
  type); at most one ``*``.

ctypes types: ``int`` -> ``c_int``, ``int64_t`` -> ``c_int64``, ``float`` ->
``c_float``, ``void`` (return) -> None; a pointer to a header struct ->
``POINTER(its Structure)`` (ctypes then refuses an int or any other struct); every
other pointer -> ``c_void_p`` (callers pass ``tensor.data_ptr()``, or None for NULL).
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from importlib import resources

__all__ = [
    "HEADER",
    "Boundary",
    "CType",
    "Decl",
    "Function",
    "HeaderError",
    "Struct",
    "bind",
    "boundary",
    "ctypes_structs",
    "layout_check_source",
    "parse",
    "signature",
    "struct",
]

HEADER = "parrot_ops.h"  # in parrot/engine/kernels/csrc/

_SCALARS: dict[str, type] = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_POINTEES = frozenset({"void", "int", "int64_t", "float", "uint16_t"})
_IDENT = r"[A-Za-z_]\w*"
# `\b` after a type name: "intx" is one (unknown) name, never "int" and "x"
_DECL = re.compile(rf"(?P<const>const\s+)?(?P<base>{_IDENT})\b\s*(?P<star>\*?)\s*(?P<name>{_IDENT})")
_BASE = re.compile(rf"(?P<const>const\s+)?(?P<base>{_IDENT})\b\s*(?P<rest>.*)", re.S)
_DECLARATOR = re.compile(rf"(?P<star>\*?)\s*(?P<name>{_IDENT})")
_STRUCT = re.compile(rf"typedef\s+struct\s*\{{(?P<body>[^{{}}]*)\}}\s*(?P<name>{_IDENT})", re.S)
_FUNCTION = re.compile(rf"(?P<ret>[^()]*?)\s*\b(?P<name>{_IDENT})\s*\((?P<params>[^()]*)\)", re.S)


class HeaderError(ValueError):
    """The header holds something outside the subset this parser reads."""


@dataclass(frozen=True)
class CType:
    """A C type of the subset: ``base`` (a type name), ``pointer`` (one ``*``)."""

    base: str
    pointer: bool = False
    const: bool = False


@dataclass(frozen=True)
class Decl:
    """A named parameter or struct field."""

    name: str
    type: CType


@dataclass(frozen=True)
class Function:
    """A prototype: ``returns name(params)``."""

    name: str
    returns: CType
    params: tuple[Decl, ...]


@dataclass(frozen=True)
class Struct:
    """A ``typedef struct { fields } name``, fields in declaration order."""

    name: str
    fields: tuple[Decl, ...]


@dataclass(frozen=True)
class Boundary:
    """Everything the header declares, in header order."""

    structs: tuple[Struct, ...]
    functions: tuple[Function, ...]


# ------------------------------------------------------------------------- parsing


def _strip(text: str) -> str:
    """``text`` without comments and preprocessor lines (comments become a space)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"^[ \t]*#[^\n]*", " ", text, flags=re.M)


def _statements(text: str) -> list[str]:
    """The ``;``-ended statements of stripped ``text``, whitespace collapsed; ``;`` inside
    braces does not end one.  Raises on unbalanced braces or a trailing fragment."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{}":
            depth += 1 if ch == "{" else -1
            if depth < 0:
                raise HeaderError(f"unbalanced '}}' near {text[start : i + 1].strip()!r}")
        elif ch == ";" and depth == 0:
            out.append(" ".join(text[start:i].split()))
            start = i + 1
    if depth or text[start:].strip():
        raise HeaderError(f"unterminated statement: {' '.join(text[start:].split())!r}")
    return [s for s in out if s]


def _check_type(t: CType, known: set[str], where: str, *, is_return: bool = False) -> CType:
    """``t`` if the subset allows it (by value: a scalar, or void as a return type; by
    pointer: a scalar, void, uint16_t or a struct in ``known``), else raises."""
    if t.pointer:
        ok = t.base in _POINTEES or t.base in known
    else:
        ok = t.base in _SCALARS or (is_return and t.base == "void")
    if not ok:
        shown = ("const " if t.const else "") + t.base + (" *" if t.pointer else "")
        raise HeaderError(f"{where}: type {shown!r} is outside the parsed subset")
    return t


def _param(text: str, known: set[str], where: str) -> Decl:
    """One ``[const] TYPE [*]name`` declaration."""
    m = _DECL.fullmatch(text.strip())
    if m is None:
        raise HeaderError(f"{where}: cannot read parameter {text.strip()!r}")
    t = CType(m["base"], bool(m["star"]), bool(m["const"]))
    return Decl(m["name"], _check_type(t, known, f"{where}({m['name']})"))


def _fields(line: str, known: set[str], where: str) -> list[Decl]:
    """The fields of one ``[const] TYPE [*]a, [*]b`` struct member line."""
    m = _BASE.fullmatch(line.strip())
    if m is None or not m["rest"].strip():
        raise HeaderError(f"{where}: cannot read field {line.strip()!r}")
    out = []
    for part in m["rest"].split(","):
        d = _DECLARATOR.fullmatch(part.strip())
        if d is None:
            raise HeaderError(f"{where}: cannot read declarator {part.strip()!r}")
        t = CType(m["base"], bool(d["star"]), bool(m["const"]))
        out.append(Decl(d["name"], _check_type(t, known, f"{where}.{d['name']}")))
    return out


def _struct(m: re.Match[str], known: set[str]) -> Struct:
    name = m["name"]
    lines = [s for s in (x.strip() for x in m["body"].split(";")) if s]
    if not lines or m["body"].strip()[-1:] != ";":
        raise HeaderError(f"struct {name}: no fields, or a field without ';'")
    fields = tuple(f for line in lines for f in _fields(line, known, f"struct {name}"))
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        raise HeaderError(f"struct {name}: a field name repeats")
    return Struct(name, fields)


def _function(statement: str, known: set[str]) -> Function:
    m = _FUNCTION.fullmatch(statement)
    if m is None:
        raise HeaderError(f"cannot read declaration {statement!r}")
    name = m["name"]
    if not name.startswith("parrot_"):
        raise HeaderError(f"{name}: exported functions are named parrot_*")
    ret = _BASE.fullmatch(m["ret"])
    if ret is None or ret["rest"].strip() not in ("", "*"):
        raise HeaderError(f"{name}: cannot read return type {m['ret']!r}")
    returns = CType(ret["base"], ret["rest"].strip() == "*", bool(ret["const"]))
    _check_type(returns, known, f"{name} return", is_return=True)
    text = m["params"].strip()
    if not text:
        raise HeaderError(f"{name}: '()' declares no prototype; write '(void)'")
    params = () if text == "void" else tuple(_param(p, known, name) for p in text.split(","))
    return Function(name, returns, params)


def parse(text: str) -> Boundary:
    """The structs and prototypes of header ``text``; raises :class:`HeaderError` on
    anything outside the subset (see the module docstring) or a name declared twice."""
    structs: list[Struct] = []
    functions: list[Function] = []
    for statement in _statements(_strip(text)):
        known = {s.name for s in structs}
        m = _STRUCT.fullmatch(statement)
        if m is not None:
            structs.append(_struct(m, known))
        elif statement.startswith("typedef") or "{" in statement:
            raise HeaderError(f"only 'typedef struct {{...}} Name;' is read: {statement!r}")
        else:
            functions.append(_function(statement, known))
    names = [x.name for x in (*structs, *functions)]
    if len(set(names)) != len(names):
        raise HeaderError("a name is declared twice")
    return Boundary(tuple(structs), tuple(functions))


# -------------------------------------------------------------------------- ctypes


def _ctype(t: CType, structs: dict[str, type[ctypes.Structure]]) -> type:
    """The ctypes type of a checked (non-void) C type."""
    if not t.pointer:
        return _SCALARS[t.base]
    if t.base in structs:
        return ctypes.POINTER(structs[t.base])
    return ctypes.c_void_p


def ctypes_structs(b: Boundary) -> dict[str, type[ctypes.Structure]]:
    """A fresh :class:`ctypes.Structure` subclass per struct of ``b``, fields in header
    order (so ctypes lays them out as the C compiler does; the build checks it)."""
    out: dict[str, type[ctypes.Structure]] = {}
    for s in b.structs:
        fields = [(f.name, _ctype(f.type, out)) for f in s.fields]
        out[s.name] = type(
            s.name,
            (ctypes.Structure,),
            {"_fields_": fields, "__doc__": f"C struct {s.name}", "__module__": __name__},
        )
    return out


def signature(fn: Function, structs: dict[str, type[ctypes.Structure]]) -> tuple[list[type], type | None]:
    """``fn``'s ctypes (argtypes, restype)."""
    restype = None if fn.returns == CType("void") else _ctype(fn.returns, structs)
    return [_ctype(p.type, structs) for p in fn.params], restype


@functools.cache
def boundary() -> Boundary:
    """The parsed header shipped with the package (read once)."""
    text = resources.files(__package__).joinpath("csrc", HEADER).read_text()
    return parse(text)


@functools.cache
def _structs() -> dict[str, type[ctypes.Structure]]:
    return ctypes_structs(boundary())


def struct(name: str) -> type[ctypes.Structure]:
    """The ctypes Structure of the header's struct ``name`` (one class per process, the
    one :func:`bind` uses in argument types)."""
    return _structs()[name]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with every declared function's argtypes and restype set; raises
    AttributeError naming a declared function the library does not export."""
    for fn in boundary().functions:
        f = getattr(lib, fn.name)
        f.argtypes, f.restype = signature(fn, _structs())
    return lib


def layout_check_source(structs: dict[str, type[ctypes.Structure]] | None = None) -> str:
    """C source asserting, at compile time, that each struct's size, alignment and field
    offsets equal what ctypes computes for ``structs`` (default: the header's)."""
    structs = _structs() if structs is None else structs
    lines = [
        f"/* Generated by parrot.engine.kernels.c_boundary: the ctypes layout of {HEADER}'s structs. */",
        "#include <stddef.h>",
        f'#include "{HEADER}"',
    ]
    for name, cls in structs.items():
        checks = [
            (f"sizeof({name})", ctypes.sizeof(cls)),
            (f"_Alignof({name})", ctypes.alignment(cls)),
            *((f"offsetof({name}, {f})", getattr(cls, f).offset) for f, _ in cls._fields_),
        ]
        lines += [f'_Static_assert({expr} == {n}, "ctypes has {expr} == {n}");' for expr, n in checks]
    return "\n".join(lines) + "\n"
