"""A test whose prerequisite is missing (``tests.conftest.missing``) skips, or is an expected failure, on a
developer's machine, and fails under ``CI=true``, where ``deploy/local.sh`` installs every prerequisite."""

from __future__ import annotations

import pytest

import tests.conftest as conftest
from tests.conftest import missing


def outcome(problem: str, xfail: bool) -> BaseException:
    """What ``missing`` raises (pytest's skip, xfail and fail outcomes: BaseExceptions; xfail's is a fail's)."""
    with pytest.raises(BaseException) as raised:
        missing(problem, xfail=xfail)
    return raised.value


@pytest.mark.parametrize("xfail", [False, True])
def test_a_missing_prerequisite_fails_under_ci(monkeypatch: pytest.MonkeyPatch, xfail: bool) -> None:
    monkeypatch.setenv("CI", "true")
    raised = outcome("no openssl here", xfail)
    assert type(raised) is pytest.fail.Exception and "no openssl here" in str(raised)


def test_a_missing_prerequisite_skips_or_xfails_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert not conftest.in_ci()
    assert type(outcome("port busy", xfail=False)) is pytest.skip.Exception
    assert type(outcome("bfcl-eval missing", xfail=True)) is pytest.xfail.Exception
