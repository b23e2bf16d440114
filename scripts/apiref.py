"""The API reference, docs/api.md, made from the docstrings of every public name.

`scripts/apiref` writes it; `scripts/apiref --check` exits 1 when the file differs from what
it would write (tests/unit/test_apiref.py runs the same comparison). Public: the names in the
`__all__` of hetcomm, hetcomm.torch and hetcomm.testing; for a class, its methods and
properties whose names do not start with `_`, in source order.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"
MODULES = ("hetcomm", "hetcomm.torch", "hetcomm.testing")
HEADER = """# API reference

Every public name of `hetcomm`, `hetcomm.torch` and `hetcomm.testing` (their `__all__`), with
its signature and docstring. Made by `scripts/apiref` from the docstrings; do not edit by hand
(tests/unit/test_apiref.py fails when this file is not what the script makes). The README says
how the pieces fit together.
"""
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _signature(obj: Any) -> str:
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        # an Enum's constructor signature is the enum module's, which differs between Python
        # versions: its members say what it takes
        return "(" + " | ".join(repr(m.value) for m in obj) + ")"
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return _ADDRESS.sub("", text)


def _doc(obj: Any) -> str:
    # the object's own docstring: one inherited from torch's C++ classes would make the file
    # depend on the installed torch
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else "(no docstring)"


def _members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined by the class itself or its hetcomm bases."""
    seen: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("hetcomm"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(
                value
            ):
                seen[name] = value
    return list(seen.items())


def _member(cls: type, name: str, value: Any) -> list[str]:
    fn = value.fget if isinstance(value, property) else value
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    doc = _first(fn)
    if doc == "(no docstring)":
        # an override of a method of the torch class the class derives from, documented there;
        # named without asking the installed torch, whose classes have other methods in other
        # versions (the file would depend on it)
        base = next((b for b in cls.__mro__[1:] if b.__module__.startswith("torch")), None)
        if base is not None:
            doc = f"implements torch's `{base.__name__}.{name}` (its documentation applies)"
    if isinstance(value, property):
        return [f"- `{cls.__name__}.{name}` (property): {doc}"]
    return [f"- `{cls.__name__}.{name}{_signature(fn)}`: {doc}"]


def _first(obj: Any) -> str:
    """The docstring's first paragraph, on one line."""
    return " ".join(_doc(obj).split("\n\n")[0].split())


def _public(cls: type) -> bool:
    """Whether hetcomm's API exports `cls` (from the package or its torch layer)."""
    import hetcomm

    return cls.__name__ in getattr(hetcomm, "__all__", ()) or cls.__name__ in getattr(
        sys.modules.get("hetcomm.torch"), "__all__", ()
    )


def _entry(module: str, name: str, obj: Any) -> list[str]:
    lines = [f"### `{module}.{name}`", ""]
    if inspect.isclass(obj):
        # hetcomm's own bases only where the API names them (a mixin of internals is not)
        bases = [
            b.__name__
            for b in obj.__bases__
            if b is not object and (not b.__module__.startswith("hetcomm") or _public(b))
        ]
        kind = f"class ({', '.join(bases)})" if bases else "class"
        lines += [f"{kind}: `{name}{_signature(obj)}`", "", _doc(obj), ""]
        members = [ln for n, v in _members(obj) for ln in _member(obj, n, v)]
        if members:
            lines += [*members, ""]
    elif callable(obj):
        lines += [f"`{name}{_signature(obj)}`", "", _doc(obj), ""]
    else:
        lines += [f"`{name} = {obj!r}`", ""]
    return lines


def render() -> str:
    """The whole of docs/api.md."""
    out = [HEADER]
    for module in MODULES:
        mod = importlib.import_module(module)
        out += [f"## `{module}`", "", _first(mod), ""]
        for name in sorted(mod.__all__, key=str.lower):
            out += _entry(module, name, getattr(mod, name))
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    """Write docs/api.md, or with --check say whether it is current."""
    text = render()
    if argv[1:2] == ["--check"]:
        if OUT.read_text() != text:
            print(f"{OUT} is not current: run scripts/apiref", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
