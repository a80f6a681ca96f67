"""The calculator tool on model-written input: right answers, and hostile expressions become a tool
error (not a crash, a hang or an effect)."""
import time

import pytest

from colocate.calculator import CalculatorError, calculator
from colocate.tools import ToolCall, ToolRunner, ToolRunnerSettings


@pytest.mark.parametrize("expression, value", [
    ("47 + 85", "132"), ("123*456", "56088"), ("2 ** 10", "1024"), ("-(3 - 10) * 2", "14"),
    ("7 / 2", "3.5"), ("2^3^2", "512"), ("((1))", "1"), ("1/3", "0.3333333333")])
def test_calculator_answers(expression, value):
    assert calculator(expression) == value


HOSTILE = ["__import__('os').system('touch /tmp/pwned')", "9**9**9", "(" * 500 + "1" + ")" * 500,
           "-" * 1000 + "1", "1" * 300, "open('/etc/passwd').read()", "2 ** -99999", "1/0", "10**59 * 10**59 * 10",
           "lambda: 1", "().__class__", "1 +", ""]


@pytest.mark.parametrize("expression", HOSTILE)
def test_hostile_expressions_are_tool_errors(expression):
    t0 = time.perf_counter()
    with pytest.raises(CalculatorError):
        calculator(expression)
    assert time.perf_counter() - t0 < 0.5
    runner = ToolRunner(ToolRunnerSettings(timeout_s=2.0))
    result = runner.call(calculator, ToolCall("calculator", {"expression": expression}))
    assert result.error == "raised" and result.content.startswith("error: CalculatorError")


def test_no_effect_from_an_import_attempt():
    import os
    path = "/tmp/colocate-calculator-pwned"
    with pytest.raises(CalculatorError):
        calculator(f"__import__('os').system('touch {path}')")
    assert not os.path.exists(path)
