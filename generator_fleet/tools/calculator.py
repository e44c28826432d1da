"""Arithmetic for the model: numbers, + - * / // % **, unary signs and parentheses, nothing else.

The expression is parsed with `ast` and walked by hand (never `eval`), and every intermediate
integer is kept under `max_digits`, so `9**9**9` is refused before any big number is computed.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from generator_fleet.tools.base import ToolContext, ToolResult

MAX_EXPRESSION_CHARS = 1000
"""Longer inputs are refused: they bound the parser's work and the depth of the tree walk."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ALLOWED = "only numbers, + - * / // % ** and parentheses are allowed"


class CalculatorError(ValueError):
    """A message for the model (without the 'error: ' prefix)."""


class Calculator:
    name = "calculator"

    def __init__(self, max_digits: int = 100) -> None:
        if max_digits < 1:
            raise ValueError(f"max_digits must be >= 1, got {max_digits}")
        self.max_digits = max_digits
        # Compared against, not converted: str(n) is quadratic and capped at 4300 digits.
        self._limit = 10**max_digits

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Evaluate an arithmetic expression, e.g. '(12 + 30) * 2 / 7'. "
                "Supports + - * / // % ** and parentheses.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "The expression."}},
                    "required": ["expression"],
                },
            },
        }

    async def call(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        expression = arguments.get("expression")
        if isinstance(expression, int | float) and not isinstance(expression, bool):
            expression = str(expression)
        if not isinstance(expression, str):
            return ToolResult(text="error: argument 'expression' must be a string", ok=False)
        try:
            return ToolResult(text=format_number(self.evaluate(expression)))
        except CalculatorError as e:
            return ToolResult(text=f"error: {e}", ok=False)

    def evaluate(self, expression: str) -> int | float:
        """The value of `expression`; raises CalculatorError with a message for the model."""
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise CalculatorError(f"invalid expression ({_ALLOWED})") from None
        try:
            return self._eval(tree.body)
        except RecursionError:
            raise CalculatorError("expression is nested too deeply") from None

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            value = node.value
            # bool is an int subclass and complex is a number, but neither is arithmetic here.
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CalculatorError(_ALLOWED)
            return self._checked(value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                result = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result too large") from None
            return self._checked(result)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise CalculatorError("use ** for powers (^ is not supported)")
        raise CalculatorError(_ALLOWED)

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        """Refuse integer powers whose result would exceed max_digits, before computing them."""
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            # digits(base**e) = floor(e * log10|base|) + 1. The float estimate only has to stop
            # hopeless powers early (one digit of slack); _checked applies the exact limit after.
            if exponent * math.log10(abs(base)) > self.max_digits + 1:
                raise CalculatorError(f"result too large (more than {self.max_digits} digits)")

    def _checked(self, value: Any) -> int | float:
        if isinstance(value, int):
            if abs(value) >= self._limit:
                raise CalculatorError(f"result too large (more than {self.max_digits} digits)")
            return value
        if isinstance(value, float):
            if not math.isfinite(value):
                raise CalculatorError("result too large" if math.isinf(value) else "result is not a number")
            return value
        # A negative base to a fractional power gives a complex number.
        raise CalculatorError("result is not a real number")


def format_number(value: int | float) -> str:
    """Ints as ints; floats with 12 significant digits, so 0.1 + 0.2 reads 0.3 and 6 / 3 reads 2."""
    if isinstance(value, int):
        return str(value)
    # Integral floats below 2**53 are exact integers; print them without a trailing '.0'.
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return format(value, ".12g")
