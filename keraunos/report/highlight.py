"""A small Python syntax highlighter for traces: the standard ``tokenize`` module, spans with
short class names, and the user-source comments (``# file.py:12: code``) shown as links back to the
user's line, their code highlighted too."""
from __future__ import annotations

import builtins
import html
import io
import keyword
import os
import re
import tokenize

_BUILTINS = frozenset(dir(builtins))
# A trace's comment naming the user line an op came from: "# /path/model.py:12: y = f(x)".
_SOURCE_COMMENT = re.compile(r"^# (?P<file>(?:/|<|[A-Za-z]:\\|\.)[^:]*):(?P<line>\d+): (?P<code>.*)$")


def highlight_lines(source: str) -> list[str]:
    """One HTML string per line of ``source`` (no line breaks inside); plain escaped text for
    lines the tokenizer cannot read."""
    lines = source.splitlines()
    out = [[] for _ in lines]
    try:
        _tokens_into(source, out, lines)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [html.escape(line) for line in lines]
    return ["".join(parts) for parts in out]


def _tokens_into(source: str, out: list[list[str]], lines: list[str]) -> None:
    row, col = 1, 0  # where the text emitted so far ends
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.ENDMARKER, tokenize.DEDENT):
            continue
        (srow, scol), (erow, ecol) = tok.start, tok.end
        if srow > len(lines):
            break
        if srow == row and scol > col:
            out[srow - 1].append(html.escape(lines[srow - 1][col:scol]))
        elif srow > row:
            if col < len(lines[row - 1]):
                out[row - 1].append(html.escape(lines[row - 1][col:]))
            if scol:
                out[srow - 1].append(html.escape(lines[srow - 1][:scol]))
        if tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT):
            if tok.type == tokenize.INDENT:
                out[srow - 1].append(html.escape(tok.string))
            row, col = erow, ecol if tok.type == tokenize.INDENT else len(lines[srow - 1])
            continue
        css = _css_class(tok, previous)
        for i, piece in enumerate(tok.string.split("\n")):  # multi-line strings
            if srow - 1 + i < len(out):
                out[srow - 1 + i].append(_span(css, piece) if css != "c" else _comment(piece))
        row, col = erow, ecol
        previous = tok


def _css_class(tok, previous) -> str:
    if tok.type == tokenize.NAME:
        if keyword.iskeyword(tok.string):
            return "k"
        if previous is not None and previous.string == "def":
            return "f"
        if tok.string in _BUILTINS and not (previous is not None and previous.string == "."):
            return "b"
        if tok.string == "torch":
            return "m"
        return ""
    if tok.type == tokenize.NUMBER:
        return "n"
    if tok.type == tokenize.STRING:
        return "s"
    if tok.type == tokenize.COMMENT:
        return "c"
    if tok.type == tokenize.OP:
        return "o"
    return ""


def _span(css: str, text: str) -> str:
    escaped = html.escape(text)
    return f'<span class="{css}">{escaped}</span>' if css and text else escaped


def _comment(text: str) -> str:
    """A comment; the user's source lines get their own look and their code is highlighted."""
    m = _SOURCE_COMMENT.match(text)
    if m is None:
        if text.startswith("# Constructed by"):
            return _span("h", text)
        return _span("c", text)
    where = f"{os.path.basename(m['file'])}:{m['line']}"
    code = m["code"]
    try:
        (highlighted,) = highlight_lines(code) or [""]
    except ValueError:
        highlighted = html.escape(code)
    return (f'<span class="src"><span class="where" title="{html.escape(m["file"])}:{m["line"]}">'
            f'# {html.escape(where)}</span> {highlighted}</span>')
