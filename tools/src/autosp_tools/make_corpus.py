"""Build the shipped training text from the docstrings of the Python standard library.

Run once at data-build time (``python -m autosp_tools.make_corpus``); training only
reads the resulting file, so nothing is fetched or generated at run time.
"""

from __future__ import annotations

import argparse
import ast
import sysconfig
from pathlib import Path

DEFAULT_OUT = Path(__file__).with_name("data") / "stdlib_docstrings.txt"
# Tests, IDLE and vendored trees are mostly code-like or duplicated text.
SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "ensurepip", "__pycache__"}


def docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node)
        # Very short docstrings are mostly "Return x." noise; they add little text.
        if doc and len(doc) >= 80 and doc.isascii():
            out.append(doc.strip())
    return out


def build(limit_bytes: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts))
    chunks: list[str] = []
    size = 0
    for path in files:
        for doc in docstrings(path):
            chunk = doc + "\n\n"
            if size + len(chunk) > limit_bytes:
                return "".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
    return "".join(chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--limit-bytes", type=int, default=1_500_000)
    args = parser.parse_args()
    text = build(args.limit_bytes)
    args.out.write_text(text, encoding="ascii")
    print(f"wrote {len(text)} bytes to {args.out}")


if __name__ == "__main__":
    main()
