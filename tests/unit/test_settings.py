"""Settings (service/settings/): a default above its maximum is refused, for every such pair, at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service.__main__ import main
from service.settings import Settings, default_ceilings

PAIRS = default_ceilings()


def test_every_default_is_paired_with_its_maximum() -> None:
    defaults = {name for name in Settings.model_fields if name.startswith("default_")}
    assert defaults <= {default for default, _ in PAIRS}, "a default_* setting has no max_* setting"
    assert set(PAIRS) >= {
        ("default_timeout_s", "max_timeout_s"),
        ("default_memory_mb", "max_memory_mb"),
        ("default_cpus", "max_cpus"),
        ("default_pids", "max_pids"),
        ("default_output_bytes", "max_output_bytes"),
        ("default_tmp_mb", "max_tmp_mb"),
        ("default_wait_s", "max_wait_s"),
        ("session_idle_timeout_s", "max_session_lifetime_s"),
        ("session_max_lifetime_s", "max_session_lifetime_s"),
    }
    for default, ceiling in PAIRS:
        assert ceiling in Settings.model_fields, (default, ceiling)


@pytest.mark.parametrize(("default", "ceiling"), PAIRS)
def test_a_default_above_its_maximum_is_refused(default: str, ceiling: str, tmp_path: Path) -> None:
    maximum = Settings.model_fields[ceiling].default
    with pytest.raises(ValidationError) as refused:
        Settings(work_dir=tmp_path, **{default: maximum * 2})
    message = str(refused.value)
    assert f"PTC_{default.upper()}" in message and f"PTC_{ceiling.upper()}" in message, message


@pytest.mark.parametrize(("default", "ceiling"), PAIRS)
def test_a_default_equal_to_its_maximum_is_taken(default: str, ceiling: str, tmp_path: Path) -> None:
    maximum = Settings.model_fields[ceiling].default
    assert getattr(Settings(work_dir=tmp_path, **{default: maximum}), default) == maximum


def test_the_documented_case_names_both_settings_and_their_values(tmp_path: Path) -> None:
    with pytest.raises(
        ValidationError, match=r"PTC_DEFAULT_TIMEOUT_S \(7200\.0\) is above PTC_MAX_TIMEOUT_S \(3600\.0\)"
    ):
        Settings(work_dir=tmp_path, default_timeout_s=7200, max_timeout_s=3600)


def test_serve_refuses_to_start_with_a_clear_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("PTC_WORK_DIR", str(tmp_path))
    monkeypatch.setenv("PTC_DEFAULT_TIMEOUT_S", "7200")
    monkeypatch.setenv("PTC_MAX_TIMEOUT_S", "3600")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptc-sandbox: refusing to start: PTC_DEFAULT_TIMEOUT_S (7200.0) is above PTC_MAX_TIMEOUT_S")
    assert "Traceback" not in err and "input_value" not in err
