"""The formula language: a whitelist walk of Python's `ast`, straight to sympy.

Nothing is ever evaluated: a formula is parsed with `ast.parse(mode="eval")` and each node
kind is either translated or rejected with an EulerError that names the spec file, the YAML
line of the key and the key. Allowed: numbers, declared names, `pi`, + − * / ** and unary −,
calls of the functions in FUNCTIONS, `where(cond, a, b)`; comparisons and `and`/`or`/`not`
only where a condition is expected (inside where(), and in attention masks).
"""
from __future__ import annotations

import ast
from typing import Callable, Mapping

import sympy as sp
from sympy.codegen.cfunctions import log1p

from eulergen.errors import EulerError, Where, suggest
from eulergen.generator.primitives import logsumexp, sigmoid, softplus
from eulergen.generator.yaml_doc import past_float32

# name → (sympy callable, least arguments, most arguments or None for any number)
FUNCTIONS: dict[str, tuple[Callable, int, int | None]] = {
    "sqrt": (sp.sqrt, 1, 1),
    "exp": (sp.exp, 1, 1),
    "log": (sp.log, 1, 1),
    "tanh": (sp.tanh, 1, 1),
    "sigmoid": (sigmoid, 1, 1),
    "softplus": (softplus, 1, 1),
    "logsumexp": (logsumexp, 1, None),
    "log1p": (log1p, 1, 1),
    "erf": (sp.erf, 1, 1),
    "sin": (sp.sin, 1, 1),
    "cos": (sp.cos, 1, 1),
    "abs": (sp.Abs, 1, 1),
    "max": (sp.Max, 2, None),
    "min": (sp.Min, 2, None),
    "where": (lambda c, a, b: sp.Piecewise((a, c), (b, True)), 3, 3),
}
REDUCTIONS = ("sum", "mean", "max")
CONSTANTS = {"pi": sp.pi}

# Bounds on one formula, checked before it is walked (its text's length and nesting) and
# after (the sympy expression with `let` names inlined, which derive and the printers
# recurse through). Chains of + - and of * / count as one level of nesting: a 1,000-term
# sum is fine, 65 nested calls or parentheses are not.
FORMULA_MAX_CHARS = 10_000
FORMULA_MAX_DEPTH = 64
FORMULA_MAX_NODES = 20_000     # sympy nodes once lets are inlined

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
           ast.Pow: lambda a, b: a ** b}
_COMPARE = {ast.Eq: sp.Eq, ast.NotEq: sp.Ne, ast.Lt: sp.Lt, ast.LtE: sp.Le,
            ast.Gt: sp.Gt, ast.GtE: sp.Ge}
_REJECTED = {
    ast.Attribute: "attribute access", ast.Subscript: "subscripts", ast.Lambda: "lambdas",
    ast.ListComp: "comprehensions", ast.SetComp: "comprehensions",
    ast.DictComp: "comprehensions", ast.GeneratorExp: "comprehensions",
    ast.IfExp: "conditional expressions (use where(cond, a, b))",
    ast.Starred: "star arguments", ast.NamedExpr: "assignment expressions",
    ast.List: "lists", ast.Tuple: "tuples", ast.Dict: "dicts", ast.Set: "sets",
    ast.JoinedStr: "strings", ast.Await: "await", ast.Yield: "yield",
}


def number(value: int | float) -> sp.Expr:
    """A literal as an exact sympy number: 0.044715 stays 8943/200000, not a binary float."""
    if isinstance(value, bool):
        raise TypeError("booleans are not numbers here")
    return sp.Integer(value) if isinstance(value, int) else sp.Rational(repr(float(value)))


def _finite(value: int | float, where: Where) -> int | float:
    """A literal the kernels can hold."""
    fault = past_float32(value)
    if fault:
        raise where.error(f"a literal: {fault}")
    return value


def parse(text: object, names: Mapping[str, sp.Basic], where: Where, *,
          condition: bool = False) -> sp.Basic:
    """Parse one formula. `names` maps every declared name to its symbol (or, for `let`
    names, its expression). condition=True parses a boolean (an attention mask)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if condition:
            raise where.error("expected a condition such as 'j <= i', got a number")
        return number(_finite(text, where))
    if isinstance(text, bool):
        if condition:
            return sp.true if text else sp.false
        raise where.error(f"expected a formula, got {text!r}")
    if not isinstance(text, str):
        raise where.error(f"expected a formula (a string), got {type(text).__name__}")
    tree = _parse_bounded(text, where)
    walker = _Walker(names, where)
    try:
        expr = walker.condition(tree.body) if condition else walker.value(tree.body)
    except (TypeError, ValueError, ZeroDivisionError) as err:
        # sympy refusing what it was built from: a comparison with zoo, 1/0 inside where()…
        raise where.error(f"formula {text.strip()!r} is not a real expression: {err}") from None
    if isinstance(expr, sp.Expr) and expr.has(sp.zoo, sp.nan, sp.oo, -sp.oo):
        raise where.error(f"formula {text.strip()!r} divides by zero or is not finite")
    _check_expanded(expr, where)
    return expr


def _parse_bounded(text: str, where: Where) -> ast.Expression:
    """`ast.parse` of a formula within the bounds above (Python's parser itself recurses
    on long chains, so the length is checked first)."""
    text = text.strip()
    if len(text) > FORMULA_MAX_CHARS:
        raise where.error(f"formula of {len(text):,} characters: at most "
                          f"{FORMULA_MAX_CHARS:,} (split it with `let` names)")
    odd = next((c for c in text if not c.isascii()), None)
    if odd is not None:
        raise where.error(f"character {odd!r} (U+{ord(odd):04X}): formulas are ASCII, names "
                          "[A-Za-z_][A-Za-z0-9_]*")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise where.error(f"syntax error in formula {_short(text)!r}: {err.msg}") from None
    except (RecursionError, MemoryError):
        raise where.error(f"formula of {len(text):,} characters nests too deeply to parse "
                          f"(at most {FORMULA_MAX_DEPTH} levels)") from None
    deepest = 0
    stack = [(tree.body, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        for child in ast.iter_child_nodes(node):
            # a chain of one operator family (a + b - c, a * b / c) is one level
            same = (isinstance(node, ast.BinOp) and isinstance(child, ast.BinOp)
                    and _family(node.op) is not None and _family(node.op) == _family(child.op)
                    and child is node.left)
            leaf = isinstance(child, _LEAVES)
            stack.append((child, depth if same or leaf else depth + 1))
    if deepest > FORMULA_MAX_DEPTH:
        raise where.error(f"formula nests {deepest} levels deep: at most {FORMULA_MAX_DEPTH}")
    return tree


def _check_expanded(expr: sp.Basic, where: Where) -> None:
    """The sympy tree's size and depth with every shared subexpression counted where it
    occurs (`let` names used twice in each of several lets double each time), counted once
    per distinct subexpression."""
    size: dict = {}
    depth: dict = {}
    stack = [(expr, False)]
    while stack:
        e, ready = stack.pop()
        if e in size:
            continue
        if ready or not e.args:
            size[e] = 1 + sum(size[a] for a in e.args)
            depth[e] = 1 + max((depth[a] for a in e.args), default=0)
            if size[e] > FORMULA_MAX_NODES:
                raise where.error(f"formula expands (its `let` names inlined) to more than "
                                  f"{FORMULA_MAX_NODES:,} terms and operators")
            if depth[e] > 4 * FORMULA_MAX_DEPTH:
                raise where.error(f"formula expands (its `let` names inlined) to more than "
                                  f"{4 * FORMULA_MAX_DEPTH} levels of nesting")
            continue
        stack.append((e, True))
        stack.extend((a, False) for a in e.args if a not in size)


_LEAVES = (ast.Name, ast.Constant, ast.operator, ast.unaryop, ast.boolop, ast.cmpop,
           ast.expr_context)


def _family(op: ast.operator) -> str | None:
    return {ast.Add: "+", ast.Sub: "+", ast.Mult: "*", ast.Div: "*"}.get(type(op))


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:60] + "…"


def parse_reduction(text: object, names: Mapping[str, sp.Basic], where: Where) -> tuple[str, sp.Expr]:
    """`sum(expr)`, `mean(expr)` or `max(expr)` → (op, per-element expr)."""
    if not isinstance(text, str):
        raise where.error(f"expected sum(...), mean(...) or max(...), got {text!r}")
    call = _parse_bounded(text, where).body
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id in REDUCTIONS):
        raise where.error(f"a reduction must be sum(...), mean(...) or max(...), got {text.strip()!r}")
    if len(call.args) != 1 or call.keywords:
        raise where.error(f"{call.func.id}() takes exactly one argument")
    expr = _Walker(names, where).value(call.args[0])
    _check_expanded(expr, where)
    return call.func.id, expr


class _Walker:
    def __init__(self, names: Mapping[str, sp.Basic], where: Where):
        self.names = names
        self.where = where

    def _reject(self, node: ast.AST) -> EulerError:
        what = _REJECTED.get(type(node), f"'{type(node).__name__}' expressions")
        return self.where.error(f"{what} are not allowed in a formula")

    def value(self, node: ast.AST) -> sp.Expr:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
                return number(_finite(node.value, self.where))
            raise self.where.error(f"only numbers may appear as literals, got {node.value!r}")
        if isinstance(node, ast.Name):
            return self._name(node.id)
        if isinstance(node, ast.BinOp):
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise self.where.error(f"operator '{ast.unparse(node)}' is not allowed "
                                       "(use + - * / **)")
            if _family(node.op) is None:
                return op(self.value(node.left), self.value(node.right))
            # a left-leaning chain a + b - c …, walked as a loop (no recursion per term),
            # its operations applied in the order the recursion would apply them
            family, links = _family(node.op), []
            while isinstance(node, ast.BinOp) and _family(node.op) == family:
                links.append((_BINOPS[type(node.op)], node.right))
                node = node.left
            result = self.value(node)
            for apply, right in reversed(links):
                result = apply(result, self.value(right))
            return result
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.USub):
                return -self.value(node.operand)
            if isinstance(node.op, ast.UAdd):
                return self.value(node.operand)
            raise self.where.error(f"'{ast.unparse(node)}' is a condition, not a value")
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, (ast.Compare, ast.BoolOp)):
            raise self.where.error(f"comparison '{ast.unparse(node)}' is only allowed as the "
                                   "condition of where(cond, a, b)")
        raise self._reject(node)

    def condition(self, node: ast.AST) -> sp.Basic:
        if isinstance(node, ast.Compare):
            parts, left = [], self.value(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                rel = _COMPARE.get(type(op))
                if rel is None:
                    raise self.where.error(f"comparison '{ast.unparse(node)}' is not allowed "
                                           "(use == != < <= > >=)")
                right = self.value(right_node)
                parts.append(rel(left, right, evaluate=False))
                left = right
            return sp.And(*parts) if len(parts) > 1 else parts[0]
        if isinstance(node, ast.BoolOp):
            args = [self.condition(v) for v in node.values]
            return sp.And(*args) if isinstance(node.op, ast.And) else sp.Or(*args)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return sp.Not(self.condition(node.operand))
        if isinstance(node, ast.Constant) and isinstance(node.value, bool):
            return sp.true if node.value else sp.false
        raise self.where.error(f"expected a condition (a comparison), got '{ast.unparse(node)}'")

    def _name(self, name: str) -> sp.Basic:
        if name in self.names:
            return self.names[name]
        if name in CONSTANTS:
            return CONSTANTS[name]
        if name in FUNCTIONS or name in REDUCTIONS:
            raise self.where.error(f"'{name}' is a function; call it as {name}(...)")
        known = set(self.names) | set(CONSTANTS)
        raise self.where.error(f"unknown name '{name}'{suggest(name, known)}")

    def _call(self, node: ast.Call) -> sp.Expr:
        if not isinstance(node.func, ast.Name):
            raise self.where.error(f"only named functions may be called, not "
                                   f"'{ast.unparse(node.func)}'")
        name = node.func.id
        if node.keywords:
            raise self.where.error(f"{name}() takes no keyword arguments")
        if name in REDUCTIONS and name not in FUNCTIONS:
            raise self.where.error(f"{name}() is a reduction; it is only allowed as a whole "
                                   "`reduce:` entry of a row op")
        if name not in FUNCTIONS:
            raise self.where.error(f"unknown function '{name}'"
                                   f"{suggest(name, set(FUNCTIONS) | set(REDUCTIONS))}")
        func, least, most = FUNCTIONS[name]
        n = len(node.args)
        if n < least or (most is not None and n > most):
            want = str(least) if least == most else (f"at least {least}" if most is None
                                                     else f"{least} to {most}")
            raise self.where.error(f"{name}() takes {want} argument{'s' * (want != '1')}, got {n}")
        if name == "where":
            return func(self.condition(node.args[0]), self.value(node.args[1]),
                        self.value(node.args[2]))
        return func(*(self.value(a) for a in node.args))
