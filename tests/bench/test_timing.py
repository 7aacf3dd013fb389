"""Alternated timing: warm-up untimed, rounds alternate, medians."""

import pytest

from tfdist.bench.timing import alternate, medians


def test_rounds_alternate_after_untimed_warmup():
    calls = []

    def variant(name, value):
        def run():
            calls.append(name)
            return value

        return run

    samples = alternate({"a": variant("a", 1.0), "b": variant("b", 2.0)}, repeats=4, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert samples == {"a": [1.0] * 4, "b": [2.0] * 4}


def test_medians():
    assert medians({"a": [3.0, 1.0, 2.0], "b": [4.0]}) == {"a": 2.0, "b": 4.0}


def test_repeats_must_be_positive():
    with pytest.raises(ValueError, match="`repeats` must be >= 1"):
        alternate({"a": lambda: 1.0}, repeats=0)
