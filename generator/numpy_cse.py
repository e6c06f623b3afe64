"""Printed numpy statements with each repeated subexpression computed once.

The derived code is CSE'd in sympy, but the printer expands what a fused variant put in
(x + b, or x + branch, in every place x was) and a power's base per factor, so a line can
hold `(_bias_x + x)` four times: four passes over a MiB array where one would do. Here the
printed lines are parsed as Python evaluates them and every subexpression evaluated more
than once with the same operands is bound to a name before its first use, `_c0, _c1, …`.
The same operations run on the same values in the same order, so the results are the
same bits; only repeats are left out.
"""
from __future__ import annotations

import ast
import re

_SHARED = (ast.BinOp, ast.UnaryOp, ast.Call, ast.Compare, ast.BoolOp, ast.IfExp)
_NAME = re.compile(r"\b_c\d+\b")


def shared(lines: list[str]) -> list[str]:
    """`name = expr` lines (the printer's) → the same with repeated subexpressions bound once."""
    lines, count = list(lines), 0
    while (occurrences := _largest_repeat(lines)) is not None:
        first, node = occurrences[0]
        name, count = f"_c{count}", count + 1
        definition = f"{name} = {_text(lines[first], node)}"
        for n, node in sorted(occurrences, key=lambda o: (o[0], o[1].col_offset), reverse=True):
            # from the last: the offsets of those before it hold
            lines[n] = _replace(lines[n], node, name)
        lines.insert(first, definition)
    return _in_order(lines)


def _in_order(lines: list[str]) -> list[str]:
    """The names numbered as the lines bind them (the largest repeat was named first)."""
    bound = [b for b in (line.partition(" = ")[0] for line in lines) if _NAME.fullmatch(b)]
    order = {old: f"_c{n}" for n, old in enumerate(bound)}
    return [_NAME.sub(lambda m: order[m[0]], line) for line in lines]


def _largest_repeat(lines: list[str]) -> list[tuple[int, ast.AST]] | None:
    """The occurrences (line index, node) of the largest subexpression evaluated more than
    once on the same values (its names not bound again in between); None if there is none."""
    versions: dict[str, int] = {}   # how often each name has been bound so far
    seen: dict[tuple, list] = {}
    for n, line in enumerate(lines):
        stmt = ast.parse(line).body[0]
        for node in ast.walk(stmt.value):
            if isinstance(node, _SHARED):
                names = sorted({v.id for v in ast.walk(node) if isinstance(v, ast.Name)})
                key = (ast.dump(node), tuple((v, versions.get(v, 0)) for v in names))
                seen.setdefault(key, []).append((n, node))
        target = stmt.targets[0].id
        versions[target] = versions.get(target, 0) + 1
    repeats = [occ for occ in seen.values() if len(occ) > 1]
    return max(repeats, key=lambda occ: (_size(occ[0][1]), -occ[0][0]), default=None)


def _size(node: ast.AST) -> int:
    return sum(1 for _ in ast.walk(node))


def _text(line: str, node: ast.AST) -> str:
    return line[node.col_offset:node.end_col_offset]


def _replace(line: str, node: ast.AST, name: str) -> str:
    """`line` with `node`'s text replaced by `name`, and the parentheses that only grouped
    it (not a call's) with it."""
    start, end = node.col_offset, node.end_col_offset
    while start > 0 and line[start - 1] == "(" and end < len(line) and line[end] == ")" \
            and not (start > 1 and (line[start - 2].isalnum() or line[start - 2] in "_)]")):
        start, end = start - 1, end + 1
    return line[:start] + name + line[end:]
