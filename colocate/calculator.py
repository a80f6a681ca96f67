"""A calculator tool that is safe on model-written input: its own arithmetic parser, no eval/exec.

Grammar (recursive descent over a token list): numbers (digits, an optional decimal part),
+ - * / ** ^ (power), unary minus, parentheses. Everything else - names, attributes, calls,
strings - is a syntax error. Bounds keep a hostile expression cheap: its length, the nesting
depth, the size of every intermediate value (digits) and of a power's exponent are checked before
the work is done, so `9**9**9` or a thousand parentheses is an error message, not a hang.
Exact arithmetic on fractions; the result is an integer, or a decimal rounded to 10 places.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_CHARS = 200
MAX_DEPTH = 32
MAX_DIGITS = 60          # of any intermediate value (numerator or denominator)
TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(\*\*|[-+*/^()]))")


class CalculatorError(ValueError):
    """An expression the calculator refuses; its message is what the policy reads."""


def tokenize(expression: str) -> list[str]:
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    tokens, pos = [], 0
    expression = expression.rstrip()
    while pos < len(expression):
        m = TOKEN.match(expression, pos)
        if m is None:
            raise CalculatorError(f"unexpected {expression[pos:pos + 10]!r}: only numbers, + - * / ** and ()")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    return tokens


def _bounded(value: Fraction) -> Fraction:
    for part in (value.numerator, value.denominator):
        if part and math.log10(abs(part)) > MAX_DIGITS:
            raise CalculatorError(f"a value has more than {MAX_DIGITS} digits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents")
    n = exponent.numerator
    if base == 0 and n < 0:
        raise CalculatorError("division by zero")
    size = max(abs(base.numerator), abs(base.denominator))
    if size > 1 and abs(n) * math.log10(size) > MAX_DIGITS:  # checked before the power is computed
        raise CalculatorError(f"the power has more than {MAX_DIGITS} digits")
    return _bounded(base ** n)


class Parser:
    """expr := term (('+'|'-') term)*; term := unary (('*'|'/') unary)*;
    unary := '-' unary | power; power := atom (('**'|'^') unary)?; atom := number | '(' expr ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalculatorError("the expression ends too early")
        self.pos += 1
        return tok

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = _bounded(value + self.term() if self.take() == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.unary()
            if op == "/" and rhs == 0:
                raise CalculatorError("division by zero")
            value = _bounded(value * rhs if op == "*" else value / rhs)
        return value

    def unary(self) -> Fraction:
        if self.peek() == "-":
            self.take()
            return -self._nested(self.unary)
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() in ("**", "^"):
            self.take()
            return _power(base, self._nested(self.unary))
        return base

    def atom(self) -> Fraction:
        tok = self.take()
        if tok == "(":
            value = self._nested(self.expr)
            if self.take() != ")":
                raise CalculatorError("unbalanced parentheses")
            return value
        if tok[0].isdigit():
            if len(tok) > MAX_DIGITS:
                raise CalculatorError(f"a number has more than {MAX_DIGITS} digits")
            return Fraction(tok)
        raise CalculatorError(f"unexpected {tok!r}")

    def _nested(self, rule) -> Fraction:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"nested deeper than {MAX_DEPTH}")
        try:
            return rule()
        finally:
            self.depth -= 1


def evaluate(expression: str) -> Fraction:
    parser = Parser(tokenize(expression))
    value = parser.expr()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r}")
    return value


def format_value(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10f}".rstrip("0").rstrip(".")


def calculator(expression: str) -> str:
    """
    Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / ** and parentheses, e.g. "12 * (3 + 4)".

    Returns:
        The value, exactly for whole numbers.
    """
    return format_value(evaluate(str(expression)))
