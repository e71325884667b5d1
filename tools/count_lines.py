"""Count lines of Python files: total, and code only (no blank, comment or docstring lines).

Usage: ``python tools/count_lines.py FILE...`` prints one row per file and a total row.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize


def docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers covered by module, class and function docstrings."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """Lines holding at least one token that is not a comment, a docstring or layout."""
    skip = docstring_lines(ast.parse(source))
    layout = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in layout:
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in skip:
                lines.add(line)
    return len(lines)


def main(paths: list[str]) -> None:
    total = code = 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        n, c = source.count("\n"), code_lines(source)
        total, code = total + n, code + c
        print(f"{n:6d} {c:6d}  {path}")
    print(f"{total:6d} {code:6d}  total (lines, code lines)")


if __name__ == "__main__":
    main(sys.argv[1:])
