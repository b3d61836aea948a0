"""The code blocks of a markdown page, run as its reader would run them.

The rule is the fence's language: a ```python block is code that runs; an ```output block right
after it (nothing but blank lines between) is what that code prints, compared line by line;
every other fence (```bash, ```text) is not run. The blocks of one page run in order in one
namespace, as a reader pasting them into one session would. In an ```output block, ``...``
stands for any text (as doctest's ELLIPSIS): timings, paths, addresses. A block that raises
prints ``module.Type: message`` as its last line, as a traceback would end.

Tests import it as a sibling module (pytest puts ``tests/`` on ``sys.path``)::

    from doc_examples import python_blocks, run_page
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import linecache
import pathlib
import re
import traceback

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


@dataclasses.dataclass
class Block:
    code: str
    line: int  # of the fence, in the page
    output: str | None  # what the page says it prints, or None


def blocks(text: str) -> list[Block]:
    """The page's ```python blocks, each with the ```output block that follows it."""
    found = []
    fences = list(FENCE.finditer(text))
    for i, fence in enumerate(fences):
        if fence.group(1) != "python":
            continue
        output = None
        after = fences[i + 1] if i + 1 < len(fences) else None
        if after is not None and after.group(1) == "output" and \
                not text[fence.end():after.start()].strip():
            output = after.group(2)
        found.append(Block(fence.group(2), text.count("\n", 0, fence.start()) + 1, output))
    return found


def python_blocks(text: str) -> list[str]:
    """The code of every ```python block of ``text``."""
    return [b.code for b in blocks(text)]


def fences(text: str) -> list[str]:
    """Every fence's language, in order ("" for a bare fence)."""
    return [fence.group(1) for fence in FENCE.finditer(text)]


def matches(expected: str, actual: str) -> bool:
    """``actual`` is ``expected`` with each ``...`` standing for any text; trailing spaces and
    blank lines at either end do not count."""
    def tidy(text):
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
    pattern = ".*?".join(re.escape(part) for part in tidy(expected).split("..."))
    return re.fullmatch(pattern, tidy(actual), re.S) is not None


def run_block(block: Block, namespace: dict, filename: str) -> str:
    """Runs one block in ``namespace``; what it printed (and its exception's last line)."""
    name = f"{filename}:{block.line}"
    linecache.cache[name] = (len(block.code), None, block.code.splitlines(True), name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            exec(compile(block.code, name, "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - the page shows the error
            if block.output is None:
                raise
            print(traceback.format_exception_only(type(e), e)[-1].strip()
                  if type(e).__module__ == "builtins" else
                  f"{type(e).__module__}.{type(e).__qualname__}: {e}")
    return printed.getvalue()


def run_page(path: pathlib.Path) -> list[str]:
    """Runs every ```python block of the page in order; the failures, as messages."""
    namespace: dict = {"__name__": "__doc_example__"}
    failures = []
    for block in blocks(path.read_text()):
        printed = run_block(block, namespace, path.name)
        if block.output is not None and not matches(block.output, printed):
            failures.append(f"{path.name}, the block at line {block.line} printed:\n{printed}\n"
                            f"where the page shows:\n{block.output}")
    return failures
