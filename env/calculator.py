"""The built-in tool: a calculator over numbers, written as a restricted interpreter of Python's arithmetic.

It parses the call with :mod:`ast` and evaluates only numbers, ``+ - * / // % **``, unary signs and parentheses:
no names, calls, attributes or subscripts, so a model's call cannot reach anything but arithmetic. Work is bounded
too (an exponent above 64, numbers above 10**100, or a call longer than 200 characters are refused), so a call
cannot spend the worker's time or memory; the pool's time and memory limits are the last line behind that.

A refused or malformed call raises ValueError, which ends the episode with the reason ``exception`` (see
env/environment.py): the model is rewarded for calls that work.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

_MAX_CHARS = 200
_MAX_EXPONENT = 64
_MAX_ABS = 10**100

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(call: str) -> str:
    """``"37*48"`` → ``"1776"``; a whole float prints without its ``.0`` (``"7/7"`` → ``"1"``)."""
    text = call.strip()
    if not text or len(text) > _MAX_CHARS:
        raise ValueError(f"a call of {len(text)} characters (1 to {_MAX_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not arithmetic: {text!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"an exponent of {right} (at most {_MAX_EXPONENT})")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("a number out of range") from None
    raise ValueError(f"{type(node).__name__} is not arithmetic")


def _bounded(value: Any) -> Any:
    if isinstance(value, complex) or abs(value) > _MAX_ABS:
        raise ValueError("a number out of range")
    return value
