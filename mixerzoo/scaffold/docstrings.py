"""Options described from signatures and docstrings: the text shared by the recipe reference (docs/recipes.md,
:mod:`.recipe_reference`) and ``mixerzoo plugins NAME`` (:func:`mixerzoo.cli.print_plugin`).

Imports nothing of mixerzoo, so both may import it.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Any

__all__ = ["MIXER_EXTRA", "cell_text", "parse_args_section", "lightning_default", "format_type", "value_text"]

# options of the core mixers without an Args entry in their class docstring
MIXER_EXTRA = {
    "window": "Tokens a query sees: itself and the previous `window - 1` (the cache keeps `window - 1`).",
    "chunk_len": "Block length: a query sees its own block causally plus the previous `n_bswa_chunks - 1` "
                 "blocks.",
    "n_bswa_chunks": "Blocks visible to a query, its own included.",
    "layer_idx": "Set by the LM (index of the layer); not a recipe option.",
    "sink_len": "The first `sink_len` tokens of the sequence stay visible to every query and in the cache "
                "(attention sinks, StreamingLLM; TOVA's `window+4` baseline is 4).",
}



def cell_text(text: str, limit: int = 240) -> str:
    """One table cell: RST roles and literals as Markdown code, no ``Default:`` sentences (the default column
    has it), cut after the sentence that crosses ``limit`` characters."""
    text = re.sub(r":(?:class|func|meth|attr|data|mod|paramref):`~?([\w.]+)`",
                  lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\s*Default: `[^`]*`\.?", "", text).strip()
    sentences, out = re.split(r"(?<=[.;])\s+(?=[A-Z`(])", text), ""
    for sentence in sentences:
        out = f"{out} {sentence}".strip()
        if len(out) >= limit:
            break
    return out.replace("|", "\\|")


def parse_args_section(doc: str | None) -> dict[str, str]:
    """``{name: first paragraph}`` from a Google-style ``Args:`` section; ``a, b: text`` gives both names."""
    if not doc:
        return {}
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    indent, current, buf, para_done = None, [], [], False
    for line in lines[start + 1:]:
        if not line.strip():
            para_done = bool(buf)
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        m = re.match(r"([\w*]+(?:, *[\w*]+)*):(?:\s|$)(.*)", line.strip()) if depth == indent else None
        if m:
            for name in current:
                out.setdefault(name, cell_text(" ".join(buf)))
            current, buf, para_done = [n.strip() for n in m.group(1).split(",")], [m.group(2)], False
        elif not para_done and not line.strip().startswith((".. ", "Example", "Default:")):
            buf.append(line.strip())
        else:
            para_done = True
    for name in current:
        out.setdefault(name, cell_text(" ".join(buf)))
    return out


def lightning_default(doc_text: str) -> str | None:
    m = re.search(r"Default: ``([^`]+)``", doc_text or "")
    return m.group(1) if m else None


def format_type(t: Any) -> str:
    """A compact readable type: ``int | None``, ``list[str]``, ``Logger | bool | None``."""
    if t is inspect.Parameter.empty:
        return ""
    if isinstance(t, str):
        return t.replace("typing.", "").replace("|", "\\|")
    if t is type(None):
        return "None"
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        parts = list(dict.fromkeys(format_type(a) for a in args))
        return " \\| ".join(p for p in parts if p != "None") + (" \\| None" if "None" in parts else "")
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(format_type(a) for a in args)}]"
    return getattr(t, "__name__", str(t))


def value_text(v: Any) -> str:
    if v is inspect.Parameter.empty:
        return "(required)"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    if isinstance(v, dict) and "class_path" in v:
        return v["class_path"].split(".")[-1] + "(" + ", ".join(
            f"{k}={value_text(x)}" for k, x in (v.get("init_args") or {}).items() if x not in (None, "")) + ")"
    return str(v).replace("|", "\\|")
