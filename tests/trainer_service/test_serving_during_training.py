"""Serving continues while a step trains and the new adapter loads (real vLLM, real collector).

Groups are fed through the real plugin (rollouts of `ARTChatModel` calls, OTLP to the
collector); then `POST /v1/train` runs while four clients keep sending chat requests.
The session trainer may have trained before (other tests): everything is compared with the
status before. On a CPU the engine runs fewer threads while the step trains than after it.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
from langchain_core.messages import HumanMessage

import art_langgraph
from examples.stack import Service

pytestmark = pytest.mark.vllm

BASE = "SmolLM2-135M-Instruct"
CLIENTS = 4
ATTEMPTS = 3


@dataclass(frozen=True)
class Answer:
    started: float
    ended: float
    status: int
    text: str


@dataclass(frozen=True)
class Step:
    started: float
    ended: float
    response: httpx.Response
    answers: list[Answer]
    statuses: list[tuple[float, bool, int | None]]
    """When a `GET /v1/status` came back, whether it said a step trains, the engine's threads."""

    def overlapping(self) -> list[Answer]:
        """Requests in flight at some moment of the step."""
        return [a for a in self.answers if a.started < self.ended and a.ended > self.started]

    def sent_and_answered_inside(self) -> list[Answer]:
        """Requests sent after the service said it trains, and answered before the step's reply."""
        training = [at for at, flag, _ in self.statuses if flag]
        return [a for a in self.answers if training and training[0] <= a.started and a.ended <= self.ended]

    @property
    def engine_threads(self) -> list[int | None]:
        return [threads for _, _, threads in self.statuses]


def feed_group(collector_url: str) -> None:
    """Four rollouts with a reward spread, so the group trains, recorded through the plugin."""
    llm = art_langgraph.init_chat_model("agent@latest", max_tokens=32, temperature=1.0)
    task, group = f"serve-{uuid.uuid4().hex[:8]}", f"serve-{uuid.uuid4().hex[:8]}"
    for attempt in range(4):
        with art_langgraph.rollout(task, group=group, group_size=4) as run:
            llm.invoke([HumanMessage("Say a number.")])
            run.reward(attempt / 3)
    assert art_langgraph.flush(timeout=30)
    collector = httpx.Client(base_url=collector_url, timeout=30)
    deadline = time.monotonic() + 60
    while not any(g["id"] == group and g["state"] == "ready" for g in collector.get("/v1/groups").json()):
        assert time.monotonic() < deadline, "the group never became ready"
        time.sleep(0.5)


def train_while_chatting(trainer_url: str) -> Step:
    """`POST /v1/train` while `CLIENTS` threads chat (adapter and base model in turn) and one polls status."""
    answers: list[Answer] = []
    statuses: list[tuple[float, bool, int | None]] = []
    stop = threading.Event()

    def chat_forever(client_index: int) -> None:
        chat = httpx.Client(base_url=trainer_url, timeout=300)
        # staggered: clients that start together are batched together by vLLM and answered together
        time.sleep(0.2 * client_index)
        turn = 0
        while not stop.is_set():
            started = time.monotonic()
            response = chat.post("/v1/chat/completions", json={
                "model": ("agent@latest", BASE)[turn % 2], "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}]})
            answers.append(Answer(started, time.monotonic(), response.status_code, response.text[:200]))
            turn += 1

    def watch_status() -> None:
        status = httpx.Client(base_url=trainer_url, timeout=30)
        while not stop.is_set():
            body = status.get("/v1/status").raise_for_status().json()
            statuses.append((time.monotonic(), body["training"], body["engine"]["threads"]))
            time.sleep(0.1)

    client = httpx.Client(base_url=trainer_url, timeout=300)
    workers = [threading.Thread(target=chat_forever, args=(i,)) for i in range(CLIENTS)]
    workers.append(threading.Thread(target=watch_status))
    for worker in workers:
        worker.start()
    try:
        started = time.monotonic()
        while True:
            response = client.post("/v1/train")
            if response.status_code != 409 or response.json()["error"]["code"] != "training_in_progress":
                break
            time.sleep(1.0)  # another test's step: wait for it
        ended = time.monotonic()
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    return Step(started, ended, response, answers, statuses)


def test_chat_requests_succeed_while_a_step_trains_and_loads(collector_service: Service,
                                                             trainer_service: Service) -> None:
    art_langgraph.configure(collector_url=collector_service.url, trainer_url=f"{trainer_service.url}/v1",
                            model="agent@latest")
    client = httpx.Client(base_url=trainer_service.url, timeout=300)
    before = client.get("/v1/status").raise_for_status().json()
    # A warm trainer's step on one group takes a few seconds and a 4-token answer ~0.3-0.7 s, so requests
    # sent once the service says it trains are answered before the step ends. (Requests sent before it
    # took its lock prove nothing: a proxy that held requests during steps passed a count of answers
    # inside the POST's window.) Once in ~10 CI runs each request lasted as long as the step: vLLM's readers
    # then slept through a dropped notification until their 5-s recheck (trainer_service/vllm_cpu_threads.py
    # now bounds that sleep to 50 ms); the attempts remain for a slow moment of a loaded machine.
    steps: list[Step] = []
    for _ in range(ATTEMPTS):
        feed_group(collector_service.url)
        step = train_while_chatting(trainer_service.url)
        steps.append(step)
        assert step.response.status_code == 200, step.response.text
        failures = [a for a in step.answers if a.status != 200]
        assert not failures, failures[:3]  # none failed: while the step trained, loaded the adapter, or after
        assert len(step.overlapping()) >= CLIENTS  # every client had a request in flight during the step
        if step.sent_and_answered_inside():
            break
    assert step.sent_and_answered_inside(), [  # answers, the step's seconds, the longest request's seconds
        (len(s.answers), round(s.ended - s.started, 1), round(max(a.ended - a.started for a in s.answers), 1))
        for s in steps]

    number = step.response.json()["step"]
    assert number > before["step"]
    answer = client.post("/v1/chat/completions", json={"model": f"agent@{number}", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 200 and answer.json()["model"] == f"agent@{number}"
    between_steps = client.get("/v1/status").raise_for_status().json()["engine"]["threads"]
    if between_steps is not None:  # vLLM-cpu borrows the step's cores between steps (--idle-vllm-threads)
        assert min([t for t in step.engine_threads if t], default=between_steps) < between_steps, \
            f"the engine kept {between_steps} threads through the step: {step.engine_threads}"
