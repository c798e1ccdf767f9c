"""Request and response models of the trainer service's HTTP API, and its error envelope.

Errors use OpenAI's envelope (`{"error": {"message", "type", "param", "code"}}`) on every
endpoint, so OpenAI clients show the message as is.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["EngineStatus", "ErrorBody", "ErrorResponse", "ServiceError", "StatusResponse", "TrainResponse"]


class ErrorBody(BaseModel):
    """The inner object of an OpenAI error."""

    message: str = Field(description="What went wrong and how to fix it.")
    type: str = Field(description="Error class, e.g. `invalid_request_error`, `not_found_error`.")
    param: str | None = Field(default=None, description="Request field at fault, if any.")
    code: str | None = Field(default=None, description="Machine-readable code, e.g. `model_not_found`.")


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorBody


class ServiceError(Exception):
    """An error with an HTTP status and an OpenAI-style body.

    Args:
        status: HTTP status code.
        code: machine-readable code.
        message: readable message with the fix.
        type: OpenAI error type.
        param: request field at fault.
    """

    def __init__(self, status: int, code: str, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))


class TrainResponse(BaseModel):
    """Result of `POST /v1/train`: one GRPO step, checkpointed and served."""

    step: int = Field(description="Policy step after this update.")
    model: str = Field(description="Model name now serving the step, e.g. `agent@3`.")
    checkpoint: str = Field(description="Folder of the checkpoint.")
    batch_id: str = Field(description="Collector batch trained on (acked).")
    metrics: dict[str, float] = Field(description="Step metrics (slash keys).")


class EngineStatus(BaseModel):
    """Health of the vLLM child process."""

    healthy: bool
    pid: int | None
    restarts: int
    url: str


class StatusResponse(BaseModel):
    """Body of `GET /v1/status`."""

    name: str
    base_model: str
    step: int = Field(description="Latest policy step (0: base model only).")
    latest_model: str = Field(description="What `name@latest` resolves to now.")
    models: list[str] = Field(description="Every served model name.")
    training: bool = Field(description="A step is running now.")
    last_metrics: dict[str, float]
    last_error: str | None = Field(description="Message of the last failed training step, if any.")
    engine: EngineStatus
