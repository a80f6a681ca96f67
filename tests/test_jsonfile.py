"""The one JSON reader and writer: what each kind of bad file raises, and the atomic write."""
import os
import re

import pytest

from colocate.jsonfile import read_object, write_atomic


class Named(Exception):
    pass


def test_round_trip_and_no_tmp_left(tmp_path):
    path = str(tmp_path / "sub" / "x.json")
    write_atomic(path, {"a": [1, 2]})
    assert read_object(path) == {"a": [1, 2]} and os.listdir(tmp_path / "sub") == ["x.json"]


@pytest.mark.parametrize("text,words", [("{", "unreadable or corrupt JSON (JSONDecodeError"),
                                        ("[1, 2]", "expected a JSON object")])
def test_a_bad_file_raises_the_callers_error_naming_it(tmp_path, text, words):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(Named, match="^" + re.escape(f"{path}: {words}")):
        read_object(str(path), Named)
    with pytest.raises(Named, match="^" + re.escape(f"model.path='m': config.json: {words}")):
        read_object(str(path), Named, name="model.path='m': config.json")


def test_a_missing_file_is_an_error_unless_missing_ok(tmp_path):
    path = str(tmp_path / "none.json")
    with pytest.raises(Named, match="none.json: missing"):
        read_object(path, Named)
    assert read_object(path, Named, missing_ok=True) == {}
