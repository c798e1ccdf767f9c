"""A settings error never shows a key: pydantic quoted every input of a model-level check in its message (the
`input_value` dict, keys and all), which the CLIs print and apps log."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import BaseModel, ValidationError

from art_langgraph._settings import Settings
from collector.config import CollectorSettings
from collector.scoring_config import JudgeSettings, LangfuseSettings
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
