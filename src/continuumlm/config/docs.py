"""What each setting means: the documentation below each field, printed by
``continuumlm inspect --explain``."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import fields

from .sections import SECTIONS, RunConfig
from .train import TABLES


def field_docs(cls: type) -> dict[str, str]:
    """The documentation of a dataclass's fields: the string literal right below each one (as
    in this module), read from the class's source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a class made at run time)
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and \
                isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def explain(cfg: RunConfig) -> str:
    """Every setting of ``cfg`` with its value, type, default and documentation, section by
    section, the model's component tables and [train]'s tables included (``continuumlm inspect --explain``)."""
    lines: list[str] = []

    def block(title: str, obj) -> None:
        docs = field_docs(type(obj))
        hints = typing.get_type_hints(type(obj))
        lines.append(f"[{title}]")
        for f in fields(obj):
            if f.name == "components" or dataclasses.is_dataclass(getattr(obj, f.name)):
                continue  # a table of its own, below
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING
                       else None)
            hint = getattr(hints[f.name], "__name__", None) or str(hints[f.name])
            value = getattr(obj, f.name)
            changed = "" if value == default else f"  (default {default!r})"
            lines.append(f"  {f.name} = {value!r}  [{hint}]{changed}")
            bounds = ", ".join(f"{k} {v}" for k, v in f.metadata.items())
            doc = docs.get(f.name, "")
            if doc or bounds:
                lines.append(f"      {doc}{f' ({bounds})' if bounds else ''}")
        lines.append("")

    for name in SECTIONS:
        block(name, getattr(cfg, name))
        if name == "model":
            for comp, obj in sorted(cfg.model.components.items()):
                block(f"model.{comp}", obj)
        if name == "train":
            for table in TABLES:
                block(f"train.{table}", getattr(cfg.train, table))
    return "\n".join(lines)
