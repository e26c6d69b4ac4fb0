"""The small document model of the study's pages (the report, the sizing page): a list of blocks whose text is
inline Markdown (``**bold**``, ``*italic*``, backticks), rendered once to Markdown and once to one self-contained
HTML page, so the two always carry the same tables and sentences; and figures written atomically.

The HTML page is laid out for a desktop browser window (1280 px wide): headers wrap at about nine characters' width,
text cells and a number's ``± spread`` wrap at spaces (a number itself never breaks), folded tables are set smaller,
and a table that is still wider than the page scrolls inside its own box rather than the page.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from envs.files import atomic_write

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn
    from matplotlib.figure import Figure

FIGURE_DPI = 110
"""Resolution of every PNG figure of the pages."""


def atomic_savefig(fig: Figure, path: Path) -> Path:
    """Save ``fig`` as a PNG at :data:`FIGURE_DPI` to ``path`` atomically (:func:`envs.files.atomic_write`); returns
    ``path``."""
    return atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=FIGURE_DPI, bbox_inches="tight"))


def format_number(value: object, decimals: int) -> str:
    """Number for a Markdown cell: thousands separators, ``decimals`` places, an en dash for NaN/None."""
    if value is None:
        return "–"
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(v):
        return "–"
    return f"{v:,.{decimals}f}"


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Paragraph:
    text: str


@dataclass(frozen=True)
class Note:
    """A quoted remark (Markdown ``>``; an HTML ``<blockquote>``)."""

    text: str


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Definitions:
    """What the names of a page mean, each defined once: ``(term, definition)`` pairs, both inline Markdown; a list
    of ``**term**: definition`` items in Markdown, an HTML ``<dl>`` (``id``, when given, names it in report.html)."""

    items: tuple[tuple[str, str], ...]
    id: str = ""


@dataclass(frozen=True)
class Table:
    """Rows of formatted cells; ``align`` is ``"left"`` or ``"right"`` per column; ``id``, when given, names the
    table's box in report.html (``<div class="table-wrap" id=...>``)."""

    header: tuple[str, ...]
    align: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    id: str = ""


@dataclass(frozen=True)
class FigureRef:
    """A PNG in the report folder: a link in report.md, embedded as a ``data:`` URI in report.html."""

    file: str
    alt: str
    caption: str


@dataclass(frozen=True)
class Details:
    """Blocks folded under a one-line summary: an HTML ``<details>`` (closed until the reader opens it); in
    Markdown, which has no fold, the summary as a bold line followed by the blocks."""

    summary: str
    blocks: tuple[Heading | Paragraph | Note | Bullets | Definitions | Table | FigureRef, ...]


Block = Heading | Paragraph | Note | Bullets | Definitions | Table | FigureRef | Details


def _cell(value: object) -> str:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    return format_number(value, 3).rstrip("0").rstrip(".") if not math.isnan(float(value)) else "–"


def frame_table(frame: pd.DataFrame) -> Table:
    """A DataFrame as a :class:`Table`: one column per DataFrame column (a named index becomes
    the first columns), numbers right-aligned with thousands separators and at most 3 decimals."""
    df = frame.reset_index() if any(n is not None for n in frame.index.names) else frame
    numeric = [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) for c in df.columns]
    return Table(
        header=tuple(str(c) for c in df.columns),
        align=tuple("right" if n else "left" for n in numeric),
        rows=tuple(tuple(_cell(v) for v in row) for row in df.itertuples(index=False, name=None)),
    )


def markdown_table(table: Table) -> str:
    """A :class:`Table` as a Markdown pipe table."""
    sep = "|" + "|".join("---:" if a == "right" else "---" for a in table.align) + "|"
    lines = ["| " + " | ".join(table.header) + " |", sep]
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    return "\n".join(lines)


def render_markdown(blocks: Iterable[Block]) -> str:
    """A Markdown page from blocks (each followed by a blank line); a :class:`Details` becomes its summary in bold
    followed by its blocks."""
    md: list[str] = []
    for b in blocks:
        if isinstance(b, Details):
            md += [f"**{b.summary}**", "", render_markdown(b.blocks).rstrip("\n")]
        elif isinstance(b, Heading):
            md += [f"{'#' * b.level} {b.text}"]
        elif isinstance(b, Paragraph):
            md += [b.text]
        elif isinstance(b, Note):
            md += [f"> {b.text}"]
        elif isinstance(b, Bullets):
            md += [f"- {item}" for item in b.items]
        elif isinstance(b, Definitions):
            md += [f"- **{term}**: {text}" for term, text in b.items]
        elif isinstance(b, Table):
            md += [markdown_table(b)]
        elif isinstance(b, FigureRef):
            md += [f"![{b.alt}]({b.file})", "", f"*{b.caption}*"]
        else:
            raise TypeError(f"unknown report block {b!r}")
        md.append("")
    return "\n".join(md)


_CODE = re.compile(r"(`[^`]+`)")
_STRONG = re.compile(r"\*\*(.+?)\*\*")
_EM = re.compile(r"(?<![\w*])\*(?=\S)([^*]+?)(?<=\S)\*(?![\w*])")
_URL = re.compile(r"https?://[^\s<>\"')]+[^\s<>\"').,;:]")


def inline_html(text: str) -> str:
    """Inline Markdown of the report's sentences to HTML: escaped text, ``**strong**``, ``*em*``, backtick
    code and bare http(s) URLs as links."""
    out = []
    for part in _CODE.split(text):
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(f"<code>{html.escape(part[1:-1], quote=False)}</code>")
            continue
        part = html.escape(part, quote=False)
        part = _STRONG.sub(r"<strong>\1</strong>", part)
        part = _EM.sub(r"<em>\1</em>", part)
        part = _URL.sub(lambda m: f'<a href="{html.escape(m.group(0))}">{m.group(0)}</a>', part)
        out.append(part)
    return "".join(out)


def _html_table(table: Table) -> str:
    def cells(tag: str, row: tuple[str, ...]) -> str:
        wrap = ("<span>", "</span>") if tag == "th" else ("", "")  # a header wraps at its span's max-width
        return "".join(
            f'<{tag} class="{"num" if a == "right" else "txt"}">{wrap[0]}{inline_html(c)}{wrap[1]}</{tag}>'
            for c, a in zip(row, table.align)
        )

    body = "\n".join(f"<tr>{cells('td', r)}</tr>" for r in table.rows)
    head = f"<thead><tr>{cells('th', table.header)}</tr></thead>"
    box = f' id="{html.escape(table.id)}"' if table.id else ""
    return f'<div class="table-wrap"{box}><table>\n{head}\n<tbody>\n{body}\n</tbody>\n</table></div>'


_HTML_STYLE = """
  body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
         color: #1f2328; background: #ffffff; margin: 0; line-height: 1.5; }
  main { max-width: 1180px; margin: 0 auto; padding: 1rem 2rem 3rem; }
  h1 { font-size: 1.6rem; margin: 0.6rem 0 0.4rem; border-bottom: 2px solid #d0d7de; padding-bottom: 0.3rem; }
  h2 { font-size: 1.35rem; margin-top: 2.2rem; border-bottom: 1px solid #d8dee4; padding-bottom: 0.2rem; }
  h1 + h2, blockquote + h2 { margin-top: 1rem; }
  h3 { font-size: 1.1rem; margin-top: 1.6rem; }
  blockquote { margin: 1rem 0; padding: 0.6rem 1rem; background: #fff8e6; border-left: 4px solid #d4a72c; }
  blockquote p { margin: 0; }
  ul { padding-left: 1.4rem; }
  dl.definitions { display: grid; grid-template-columns: max-content 1fr; gap: 0.2rem 0.8rem; margin: 0.8rem 0;
                   font-size: 0.92rem; }
  dl.definitions dt { font-weight: 600; }
  dl.definitions dd { margin: 0; }
  code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 0.9em;
         background: #f0f2f4; padding: 0.05rem 0.3rem; border-radius: 4px; }
  .table-wrap { overflow-x: auto; margin: 0.8rem 0; }
  table { border-collapse: collapse; font-size: 0.86rem; }
  th, td { border: 1px solid #d0d7de; padding: 0.3rem 0.55rem; }
  th { background: #f3f5f7; vertical-align: bottom; font-weight: 600; }
  th > span { display: inline-block; max-width: 9em; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  th.num { text-align: right; }
  td.txt, th.txt { text-align: left; }
  tbody tr:nth-child(even) { background: #fafbfc; }
  details { margin: 0.8rem 0; }
  details table { font-size: 0.78rem; }
  details th, details td { padding: 0.25rem 0.4rem; }
  summary { cursor: pointer; color: #0b5cad; }
  figure { margin: 1.5rem 0; }
  figure img { max-width: 100%; height: auto; border: 1px solid #e1e4e8; }
  figcaption { color: #57606a; font-style: italic; margin-top: 0.3rem; }
"""

_HTML_IMAGE_CHECK = """
  window.addEventListener("load", function () {
    var imgs = Array.prototype.slice.call(document.images);
    var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
    document.documentElement.setAttribute("data-figures-loaded", ok + "/" + imgs.length);
  });
"""


def _html_blocks(blocks: Iterable[Block], figure_dir: Path) -> list[str]:
    body: list[str] = []
    for b in blocks:
        if isinstance(b, Details):
            inner = "\n".join(_html_blocks(b.blocks, figure_dir))
            body.append(f"<details>\n<summary>{inline_html(b.summary)}</summary>\n{inner}\n</details>")
        elif isinstance(b, Heading):
            body.append(f"<h{b.level}>{inline_html(b.text)}</h{b.level}>")
        elif isinstance(b, Paragraph):
            body.append(f"<p>{inline_html(b.text)}</p>")
        elif isinstance(b, Note):
            body.append(f"<blockquote><p>{inline_html(b.text)}</p></blockquote>")
        elif isinstance(b, Bullets):
            body.append("<ul>\n" + "\n".join(f"<li>{inline_html(i)}</li>" for i in b.items) + "\n</ul>")
        elif isinstance(b, Definitions):
            box = f' id="{html.escape(b.id)}"' if b.id else ""
            items = (f"<dt>{inline_html(term)}</dt><dd>{inline_html(text)}</dd>" for term, text in b.items)
            body.append(f'<dl class="definitions"{box}>\n' + "\n".join(items) + "\n</dl>")
        elif isinstance(b, Table):
            body.append(_html_table(b))
        elif isinstance(b, FigureRef):
            data = base64.b64encode((Path(figure_dir) / b.file).read_bytes()).decode("ascii")
            body.append(
                f'<figure id="{html.escape(Path(b.file).stem)}">\n'
                f'<img src="data:image/png;base64,{data}" alt="{html.escape(b.alt)}">\n'
                f"<figcaption>{inline_html(b.caption)}</figcaption>\n</figure>"
            )
        else:
            raise TypeError(f"unknown report block {b!r}")
    return body


def render_html(blocks: Iterable[Block], title: str, figure_dir: Path) -> str:
    """One self-contained HTML page from the same blocks as :func:`render_markdown`.

    Figures are read from ``figure_dir`` and embedded as base64 ``data:`` URIs (their alt text on the
    ``<img>``); a :class:`Details` is a ``<details>`` element, closed; the style is inline and a
    Content-Security-Policy forbids any fetch. A few lines of inline script set
    ``data-figures-loaded="<decoded>/<images>"`` on ``<html>`` once the page has loaded, so a headless browser can
    check that every figure decoded.
    """
    body = _html_blocks(blocks, figure_dir)
    plain_title = _STRONG.sub(r"\1", title)
    csp = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{html.escape(plain_title)}</title>",
            f"<style>{_HTML_STYLE}</style>",
            f"<script>{_HTML_IMAGE_CHECK}</script>",
            "</head>",
            "<body>",
            "<main>",
            *body,
            "</main>",
            "</body>",
            "</html>",
            "",
        ]
    )
