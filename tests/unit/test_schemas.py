"""Hostile review of ``service.schemas`` (issue 12, item 6: values keep their exact meaning)."""

from __future__ import annotations

import math

import pytest

from service.schemas.common import check_metadata


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, [1, {"x": math.inf}]])
def test_metadata_holding_nan_or_an_infinity_is_refused_not_stored_as_null(value: object) -> None:
    # The request reader turns 1e400 into inf and lets NaN through; orjson wrote them as null (silently changed).
    with pytest.raises(ValueError, match="NaN or an infinity"):
        check_metadata({"k": value})


def test_metadata_with_null_and_finite_numbers_is_kept() -> None:
    metadata = {"a": None, "b": -0.0, "c": [1.5e308, None]}
    assert check_metadata(metadata) is metadata
