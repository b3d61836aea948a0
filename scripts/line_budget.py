"""The package's size, folder by folder, against the budget in ``pyproject.toml``.

    python scripts/line_budget.py          # the table; exit status 1 past the budget

Lines counted are lines of code: not blank, not comments, not docstrings. The budget
(``[tool.keraunos.line_budget]``) holds the whole package, each function (``function``) and each
class (``class``): a module that grows past one reading, or a function past one screen, is seen in
CI before it lands, not after. C++ sources are counted the same way, comments left out.
"""
from __future__ import annotations

import ast
import io
import pathlib
import sys
import tokenize
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keraunos"


def code_lines(source: str) -> set[int]:
    """The lines of ``source`` that hold code (a docstring's lines are not code)."""
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines.difference_update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def cpp_lines(source: str) -> int:
    count, in_block = 0, False
    for line in source.splitlines():
        text = line.strip()
        if in_block:
            in_block = "*/" not in text
            continue
        if text.startswith("/*"):
            in_block = "*/" not in text
            continue
        if text and not text.startswith("//"):
            count += 1
    return count


def oversized(path: pathlib.Path, source: str, lines: set[int], budget: dict) -> list[str]:
    """Functions and classes past their budget, as ``path:line name (n lines)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            limit = budget["class" if isinstance(node, ast.ClassDef) else "function"]
            n = len([i for i in lines if node.lineno <= i <= node.end_lineno])
            if n > limit:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines, "
                             f"budget {limit})")
    return found


def main() -> int:
    budget = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["keraunos"][
        "line_budget"]
    folders: dict[str, int] = {}
    over: list[str] = []
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".cpp") or "__pycache__" in path.parts:
            continue
        source = path.read_text()
        if path.suffix == ".py":
            lines = code_lines(source)
            n = len(lines)
            over += oversized(path, source, lines, budget)
        else:
            n = cpp_lines(source)
        rel = path.relative_to(PACKAGE)
        folder = rel.parts[0] if len(rel.parts) > 1 else "(loose modules)"
        folders[folder] = folders.get(folder, 0) + n
    total = sum(folders.values())
    width = max(map(len, folders))
    for folder, n in sorted(folders.items(), key=lambda kv: -kv[1]):
        print(f"{folder:<{width}}  {n:>6}")
    print(f"{'total':<{width}}  {total:>6}  (budget {budget['package']})")
    failed = False
    if total > budget["package"]:
        print(f"line_budget: the package has {total} lines of code, past its budget of "
              f"{budget['package']}", file=sys.stderr)
        failed = True
    for o in over:
        print("  " + o)
    if over:
        print(f"line_budget: {len(over)} function(s) or class(es) past their budget",
              file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
