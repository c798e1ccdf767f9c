"""The real service: vLLM with the bundled model, the LoRA trainer, a mock collector.

One uvicorn server (ports 18000/18001) for the whole module; the tests run in file order.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from collector.protocol import Batch, Group, Sequence, Trajectory

from trainer_service.config import GRPOConfig, TrainerSettings
from trainer_service.server import build_service, create_app

pytestmark = pytest.mark.vllm

PORT, VLLM_PORT, KEY = 18000, 18001, "test-key"
BASE = "SmolLM2-135M-Instruct"


class FakeCollector:
    """Serves queued batches on `POST /v1/batches` and records acks."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.acks: list[tuple[str, dict[str, Any]]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/batches":
            batch = self.batches.pop(0) if self.batches else Batch(id="empty", groups=[], lease_expires_at=0)
            return httpx.Response(200, json=batch.model_dump())
        if path.endswith("/ack"):
            self.acks.append((path.split("/")[3], json.loads(request.content)))
            return httpx.Response(200, json={"ok": True})
        return httpx.Response(404, json={"error": "not_found", "message": path})


@pytest.fixture(scope="module")
def collector() -> FakeCollector:
    return FakeCollector()


@pytest.fixture(scope="module")
def service_url(tmp_path_factory: pytest.TempPathFactory, collector: FakeCollector) -> Iterator[str]:
    out = tmp_path_factory.mktemp("run")
    settings = TrainerSettings(port=PORT, vllm_port=VLLM_PORT, output_dir=out, api_key=KEY, kv_cache_gib=1,
                               max_model_len=1024)
    grpo = GRPOConfig(learning_rate=1e-4)
    app = create_app(service=build_service(settings, grpo, collector_transport=httpx.MockTransport(collector.handle)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=PORT, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 600
    while not server.started:
        if not thread.is_alive():
            pytest.fail(f"the service failed to start; see {out / 'vllm.log'}")
        if time.monotonic() > deadline:
            pytest.fail("the service did not start within 600 s")
        time.sleep(0.5)
    try:
        yield f"http://127.0.0.1:{PORT}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture()
def client(service_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as c:
        yield c


def chat(client: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 6, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_api_key_required(service_url: str) -> None:
    response = httpx.get(f"{service_url}/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_models_and_chat_through_proxy(client: httpx.Client) -> None:
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == [BASE, "agent@latest"]
    response = chat(client, "agent@latest")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == BASE  # no checkpoint yet: latest is the base model
    assert body["choices"][0]["message"]["content"]

    missing = chat(client, "agent@7")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_streaming_passthrough(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/chat/completions", json={
        "model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
    }) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_train_without_batch_is_409(client: httpx.Client) -> None:
    response = client.post("/v1/train")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "no_batch_ready"


def sampled_trajectory(client: httpx.Client, index: int, reward: float) -> Trajectory:
    """Sample a completion through the proxy and turn it into a trajectory, token-exact."""
    body = chat(client, BASE, logprobs=True, return_token_ids=True, temperature=1.0, seed=index).json()
    choice = body["choices"][0]
    prompt, completion = body["prompt_token_ids"], choice["token_ids"]
    lps = [item["logprob"] for item in choice["logprobs"]["content"]]
    return Trajectory(
        id=f"t{index}", trace_id=f"{index:032x}", group_id="g1", reward=reward,
        sequences=[Sequence(token_ids=prompt + completion, logprobs=[None] * len(prompt) + lps,
                            assistant_mask=[0] * len(prompt) + [1] * len(completion))],
    )


def test_train_step_serves_new_checkpoint(client: httpx.Client, collector: FakeCollector) -> None:
    trajectories = [sampled_trajectory(client, i, float(i % 2)) for i in range(4)]
    collector.batches.append(Batch(id="b1", groups=[Group(id="g1", trajectories=trajectories)], lease_expires_at=0))

    response = client.post("/v1/train")
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["step"] == 1 and result["model"] == "agent@1" and result["batch_id"] == "b1"
    metrics = result["metrics"]
    # The engine (fp32) and the trainer agree: the first update is on-policy.
    assert metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert collector.acks == [("b1", {"policy_step": 1})]
    checkpoint = Path(result["checkpoint"])
    assert (checkpoint / "manifest.json").is_file() and checkpoint.name == "step-1"
    lines = (checkpoint.parent.parent / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 1

    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == [BASE, "agent@1", "agent@latest"]
    answered = chat(client, "agent@1")
    assert answered.status_code == 200, answered.text
    assert answered.json()["model"] == "agent@1"
    assert chat(client, "agent@latest").json()["model"] == "agent@1"

    status = client.get("/v1/status").json()
    assert status["step"] == 1 and status["latest_model"] == "agent@1"
    assert status["engine"]["healthy"] is True
    print(f"step time: {metrics['time/step_s']:.2f} s for {metrics['data/tokens']:.0f} tokens; "
          f"publish {metrics['time/publish_s']:.2f} s")
