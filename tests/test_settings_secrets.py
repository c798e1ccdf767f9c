"""A settings error never shows a key: pydantic quoted every input of a model-level check in its message (the
`input_value` dict, keys and all), which the CLIs print and apps log."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from art_langgraph._settings import Settings
from collector.cli import main as collector_main
from collector.config import CollectorSettings
from collector.scoring_config import JudgeSettings, LangfuseSettings
from trainer_service.cli import main as trainer_main
from trainer_service.config import TrainerSettings

SECRET = "k3y-s3cr3t"  # short: pydantic cuts a long input short in its message


@pytest.mark.parametrize("make", [
    lambda: Settings(api_key=SECRET),  # with OTEL_EXPORTER_OTLP_TRACES_TIMEOUT=0, below
    lambda: CollectorSettings(api_key=SECRET, reward_weights={}),
    lambda: JudgeSettings(api_key=SECRET, rubric=" "),
    lambda: LangfuseSettings(host="http://langfuse.example", secret_key=SECRET),
    lambda: TrainerSettings(api_key=SECRET, vllm_args=["--enable-lora"]),
], ids=["plugin", "collector", "judge", "langfuse", "trainer"])
def test_a_settings_error_does_not_show_the_key(monkeypatch: pytest.MonkeyPatch, make: Callable[[], BaseModel]) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0")
    with pytest.raises(ValidationError) as error:
        make()
    assert error.value.errors()[0]["type"] == "value_error"  # a model-level check, which quoted every input
    assert SECRET not in str(error.value)


@pytest.mark.parametrize(("main", "variable"), [
    (collector_main, "ART_API_KEY"),
    (collector_main, "ART_COLLECTOR_JUDGE_API_KEY"),
    (trainer_main, "ART_API_KEY"),
], ids=["collector", "judge", "trainer"])
def test_a_command_line_refusing_a_key_does_not_show_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    main: Callable[[list[str]], None], variable: str,
) -> None:
    """`settings_error` quoted each refused input (`ART_API_KEY='k3y-s3cr3té': ART_API_KEY must be ASCII...`) on
    stderr: `hide_input_in_errors` hides it from the error's text, not from `errors()`, which the CLIs read. The line
    names the variable and says what is wrong, not the key."""
    monkeypatch.setenv("ART_HOME", str(tmp_path))
    monkeypatch.setenv(variable, f"{SECRET}é")
    with socket.socket() as free:  # the collector listens before it reads the judge's settings
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", str(port)])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and "must be ASCII" in error and variable in error
    assert SECRET not in error
