"""A shutdown's grace for a running step's engine calls (`ShutdownGrace`): the gate's eval and retention's unloads,
against a vLLM that takes them and never answers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from collector.protocol import Batch
from tests.trainer_service.builders import NoProcessVLLM, group, make_service
from trainer_service.evaluation import Evaluator
from trainer_service.protocol import ServiceError, TrainResponse
from trainer_service.service import TrainerService
from trainer_service.step_bookkeeping import SHUTDOWN_GRACE_S

_CHAT = "/v1/chat/completions"
_UNLOAD = "/v1/unload_lora_adapter"


class _VLLM(ThreadingHTTPServer):
    """A vLLM that answers adapter loads and unloads, and chat completions (`ok` for each sample); once `hanging` is
    set, it takes the requests to the routes `hung` and never answers them (until `released`)."""

    daemon_threads = True

    def __init__(self, hung: set[str]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hung = hung
        self.hanging = threading.Event()
        self.released = threading.Event()
        self.asked: dict[str, threading.Event] = {route: threading.Event() for route in hung}
        """Set once a request to a hung route arrived while `hanging`."""


class _Handler(BaseHTTPRequestHandler):
    server: _VLLM

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.server.hanging.is_set() and self.path in self.server.hung:
            self.server.asked[self.path].set()
            self.server.released.wait()
            return
        answer = {"choices": [{"message": {"content": "ok"}}] * body["n"]} if self.path == _CHAT else {}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def _vllm(hung: set[str]) -> Iterator[_VLLM]:
    server = _VLLM(hung)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.released.set()
        server.shutdown()
        server.server_close()


async def _rows() -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": "3 + 4?"}]}]


def _service(tmp_path: Path, batches: list[Batch], vllm: _VLLM) -> TrainerService:
    """A service whose engine and evaluator call `vllm`, keeping the 2 newest checkpoints."""
    port = vllm.server_address[1]
    evaluator = Evaluator(_rows, lambda row, completion: 1.0, f"http://127.0.0.1:{port}")
    service = make_service(tmp_path, batches, [], evaluator=evaluator, keep_last=2)
    engine = NoProcessVLLM("tiny-llama", "base-model", port, log_path=tmp_path / "vllm.log")
    service.engine = service.retention.engine = engine
    return service


@pytest.mark.parametrize("hung", [{_CHAT}, {_UNLOAD}], ids=["eval", "unload"])
async def test_shutdown_waits_for_a_steps_eval_and_unloads_only_the_grace_and_keeps_what_was_saved(
    tmp_path: Path, hung: set[str]
) -> None:
    """A step at its gate's eval, or at retention's unload of a dropped checkpoint, against a vLLM that takes the
    request and never answers held `aclose` for the eval's 600 s timeout, or each unload's 120 s. Now both are given
    up within the grace (3 s) of the shutdown's start: the step stays served (not promoted when its eval was given
    up), `promotion.json` holds its decision, the dropped checkpoint stays on disk (after a given-up eval its unload
    is not even asked: the grace is over), and the next start serves what was saved, dropping that one."""
    batches: list[Batch] = []
    with _vllm(hung) as vllm:
        service = _service(tmp_path, batches, vllm)
        assert service.trainer is not None
        for batch_id in ("b1", "b2", "b3"):
            batches.append(Batch(id=batch_id, groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        for _ in range(2):  # agent@1 and agent@2, each promoted
            await service.train_once()
        vllm.hanging.set()
        step = asyncio.create_task(service.train_once())
        first = _CHAT if _CHAT in hung else _UNLOAD  # the gate comes before retention
        assert await asyncio.to_thread(vllm.asked[first].wait, 60), f"the step never asked vLLM for {first}"
        started = time.monotonic()
        await asyncio.wait_for(service.aclose(), 30)  # was the eval's 600 s, or an unload's 120 s
        assert time.monotonic() - started < 10
        answer = await step
    assert isinstance(answer, TrainResponse) and answer.step == 3 and answer.model == "agent@3"
    promoted = _CHAT not in hung
    assert answer.promotion.promoted == promoted
    assert promoted or "given up: the service is shutting down" in answer.promotion.reason
    checkpoints = tmp_path / "checkpoints"
    assert sorted(path.name for path in checkpoints.glob("step-*")) == ["step-1", "step-2", "step-3"]
    saved = json.loads((checkpoints / "promotion.json").read_text())
    assert saved["latest"] == (3 if promoted else 2) and saved["decision"]["step"] == 3
    with _vllm(set()) as answering:
        restarted = _service(tmp_path, [], answering)  # retention drops agent@1 at start
    assert restarted.served_models() == ["base-model", "agent@2", "agent@3", "agent@latest"]
    assert restarted.latest_model == ("agent@3" if promoted else "agent@2")
    assert sorted(path.name for path in checkpoints.glob("step-*")) == ["step-2", "step-3"]
    await restarted.aclose()


async def test_a_step_that_trains_past_the_grace_is_not_hot_loaded_and_the_next_start_serves_it(tmp_path: Path) -> None:
    """The grace runs from the shutdown's start, for every engine call together: a step still training when it ended
    was hot-loaded all the same (3 s more), then evaluated without a bound. Now it asks vLLM nothing: saved, acked
    and recorded, not served, and the next start serves it."""
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    train = service.trainer.train

    def past_the_grace(*args: Any) -> Any:
        service.closing.wait(30)
        time.sleep(SHUTDOWN_GRACE_S + 0.5)
        return train(*args)

    service.trainer.train = past_the_grace  # type: ignore[method-assign]
    loads: list[str] = []
    service.engine.load_adapter = lambda name, path: loads.append(name)  # type: ignore[method-assign]
    step = asyncio.create_task(service.train_once())
    while not service.step_running:
        await asyncio.sleep(0.01)
    await service.aclose()
    with pytest.raises(ServiceError) as info:
        await step
    assert info.value.status == 503 and info.value.body.error.code == "shutting_down"
    assert loads == [] and acks == [("b1", {"policy_step": 1})]
    restarted = make_service(tmp_path, [], [])
    assert restarted.served_models() == ["base-model", "agent@1", "agent@latest"]
    await restarted.aclose()
