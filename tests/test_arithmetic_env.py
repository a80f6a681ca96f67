"""The synthetic addition task: answers are parsed with ASCII digits only."""
import pytest

from colocate.envs.arithmetic import parse_answer


@pytest.mark.parametrize("text,value", [(" 12", 12), ("7 ", 7), ("-3", -3), (" 0", 0)])
def test_ascii_answers_parse(text, value):
    assert parse_answer(text) == value


@pytest.mark.parametrize("text", [" ७", " ７", "1٢", "+4", "1 2", "", " ", "12a", "٣"])
def test_other_digits_and_garbage_score_as_no_answer(text):
    assert parse_answer(text) is None
