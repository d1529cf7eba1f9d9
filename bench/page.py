"""The prose of docs/results.md and docs/ablations.md lives as text in bench/pages/<page>/<part>.md
(Markdown with $placeholders, wrapped as one likes: Markdown joins a paragraph's lines); the
numbers and tables that fill it come from bench/results/ through bench/render.py. A
placeholder the renderer does not fill, or a value it fills that no template uses, is an error,
so a template and its renderer cannot drift apart silently."""

from __future__ import annotations

import re
import string
from pathlib import Path

PAGES = Path(__file__).resolve().parent / "pages"


def fill(part: str, **values) -> list[str]:
    """bench/pages/<part>.md with its $placeholders filled (a value that is a list of lines is
    joined by newlines; an empty one leaves no blank run behind), as page lines ending with a
    blank one."""
    path = PAGES / f"{part}.md"
    template = string.Template(path.read_text())
    used = {m.group("named") or m.group("braced") for m in template.pattern.finditer(
        template.template)} - {None}
    unused = set(values) - used
    if unused:
        raise ValueError(f"{path} has no ${', $'.join(sorted(unused))}: the renderer fills a "
                         f"placeholder the text does not use")
    text = template.substitute({k: "\n".join(v).strip("\n") if isinstance(v, list) else
                                str(v).strip("\n") for k, v in values.items()})
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return [*text.split("\n"), ""]


def anchor(title: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def heading(lines: list[str]) -> str:
    """The text of the first level-2 heading of a rendered part."""
    return next(line[3:] for line in lines if line.startswith("## "))


def split_table(table: str, keep) -> tuple[str, str]:
    """A Markdown table split by row: (header + rows whose cells ``keep(cells)`` accepts,
    header + the other rows); a side with no rows is the empty string."""
    if not table:
        return "", ""
    lines = table.strip("\n").split("\n")
    head, rows = lines[:2], lines[2:]

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    kept = [r for r in rows if keep(cells(r))]
    other = [r for r in rows if not keep(cells(r))]
    return ("\n".join(head + kept) if kept else "", "\n".join(head + other) if other else "")
