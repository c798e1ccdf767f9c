"""`VLLMEngine`'s supervision around a fake vLLM (a small HTTP server speaking vLLM's adapter API, word for
word): start failures with the log's tail, restarts that re-load adapters, back-off, hangs, and stopping the
whole process group, also when the service itself is killed."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from examples.stack import free_port
from tests.trainer_service.builders import save_tiny_model
from tests.trainer_service.test_process_group import running
from trainer_service import engine_adapters
from trainer_service.config import TrainerSettings
from trainer_service.engine import HEALTH_FAILURES_BEFORE_RESTART, VLLMEngine
from trainer_service.engine_errors import EngineError
from trainer_service.grpo_config import GRPOConfig
from trainer_service.server import build_service


def test_engine_death_reports_log_tail(tmp_path: Path) -> None:
    class Dying(VLLMEngine):
        def command(self) -> list[str]:
            return [sys.executable, "-c", "print('CUDA out of cheese'); raise SystemExit(3)"]

    engine = Dying("model", "base", 18999, log_path=tmp_path / "vllm.log")
    with pytest.raises(EngineError, match=r"(?s)exited with code 3.*out of cheese"):
        engine.start()
    engine.stop()  # idempotent



async def test_a_given_kv_cache_size_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an exported VLLM_CPU_KVCACHE_SPACE silently replaced --kv-cache-gib
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    model = tmp_path / "model"
    save_tiny_model(model)  # `build_service` checks the model's config, tokenizer and modules
    spaces = []
    for given in ({"kv_cache_gib": 4}, {}):  # the flag (or ART_TRAINER_KV_CACHE_GIB), then neither
        settings = TrainerSettings(base_model=str(model), output_dir=tmp_path / "run", wandb="off", **given)
        service = build_service(settings, GRPOConfig())
        spaces.append(service.engine.environment()["VLLM_CPU_KVCACHE_SPACE"])
        await service.aclose()
    assert spaces == ["4", "8"]
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert VLLMEngine("m", "m", 8001).environment()["VLLM_CPU_KVCACHE_SPACE"] == "2"  # the README's default


async def test_a_given_kv_cache_size_is_warned_about_once_with_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Only vLLM-cpu reads VLLM_CPU_KVCACHE_SPACE: with CUDA `--kv-cache-gib` did nothing, and said nothing."""
    import torch

    model = tmp_path / "model"
    save_tiny_model(model)  # `build_service` checks the model's config, tokenizer and modules
    warnings = []
    for cuda, given in ((True, {"kv_cache_gib": 4}), (True, {}), (False, {"kv_cache_gib": 1})):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        caplog.clear()  # the flag (or ART_TRAINER_KV_CACHE_GIB), the default, then the flag on a CPU
        with caplog.at_level(logging.WARNING, logger="trainer_service.server"):
            settings = TrainerSettings(base_model=str(model), output_dir=tmp_path / "run", wandb="off", **given)
            await build_service(settings, GRPOConfig()).aclose()
        warnings.append([record.getMessage() for record in caplog.records if "kv_cache_gib" in record.getMessage()])
    assert len(warnings[0]) == 1 and "kv_cache_gib=4 (--kv-cache-gib, ART_TRAINER_KV_CACHE_GIB)" in warnings[0][0]
    assert "does nothing with CUDA: only vLLM-cpu reads" in warnings[0][0] and warnings[1:] == [[], []], warnings


_FAKE_VLLM = """
import http.server, json, os, subprocess, sys, time
if "--silent" in sys.argv:  # never answers: a start that times out
    time.sleep(600)
if "--with-child" in sys.argv:  # a second process in the group, as vLLM's engine core is
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("CHILD", child.pid, flush=True)
hung, mute, loaded = False, False, set()
class H(http.server.BaseHTTPRequestHandler):
    def _send(self, code, message=""):
        self.send_response(code); self.end_headers()
        self.wfile.write(json.dumps({"error": {"message": message}}).encode())
    def do_GET(self):
        if mute:  # accepts, never answers (nor anything after: one request at a time)
            print("GET", self.path, "unanswered", flush=True)
            time.sleep(600)
        self._send(503 if hung else 200)
    def do_POST(self):
        global hung, mute
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        print("POST", self.path, raw.decode(), flush=True)
        body = json.loads(raw)
        name = body.get("lora_name")
        hung = hung or self.path == "/hang"  # from now on /health fails while the process runs
        mute = mute or self.path == "/mute"  # from now on /health is never answered
        if self.path == "/v1/unload_lora_adapter":  # vLLM's answers, word for word
            if name not in loaded:
                return self._send(404, f"The lora adapter '{name}' cannot be found.")
            loaded.discard(name)
        elif name in loaded:
            return self._send(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                              "adapter in place, set 'load_inplace' to True.")
        elif "lora_path" in body:
            if not os.path.exists(body["lora_path"]):
                return self._send(400, "no such folder")
            delay = os.path.join(body["lora_path"], "answer-after")
            if os.path.exists(delay):  # a slow load, or a hung vLLM (this server answers one request at a time)
                time.sleep(float(open(delay).read()))
            loaded.add(name)
        self._send(200)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class FakeVLLM(VLLMEngine):
    """The engine's real supervision around `_FAKE_VLLM`: refuses an adapter whose folder is missing, and
    (as vLLM) loading a name it has or unloading one it has not; answers a load only after the seconds in the
    folder's `answer-after` file; `/health` fails after `POST /hang`, and is never answered after `POST /mute`;
    `fake_args` picks `--silent` or `--with-child`."""

    fake_args: list[str] = []

    def command(self) -> list[str]:
        return [sys.executable, "-c", _FAKE_VLLM, str(self.port), *self.fake_args]


def test_engine_restarts_and_reloads_adapters(tmp_path: Path) -> None:
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()
    try:
        engine.load_adapter("agent@1", tmp_path)
        assert engine.ensure_running() is False
        old_pid = engine.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        engine._proc.wait()  # type: ignore[union-attr]
        assert engine.ensure_running() is True
        assert engine.restarts == 1 and engine.pid != old_pid and engine.healthy()
        assert engine.log_tail(200).count('"lora_name":"agent@1"') == 2  # loaded, then re-loaded
    finally:
        engine.stop()
    assert not engine.is_alive()


def test_engine_reloads_every_adapter_and_retries_the_refused(tmp_path: Path) -> None:
    first, second = tmp_path / "a1", tmp_path / "a2"
    first.mkdir()
    second.mkdir()
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()
    try:
        engine.load_adapter("agent@1", first)
        engine.load_adapter("agent@2", second)
        first.rmdir()  # vLLM now refuses agent@1
        os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        engine._proc.wait()  # type: ignore[union-attr]
        with pytest.raises(EngineError) as refused:
            engine.ensure_running()
        assert engine.healthy() and engine.restarts == 1
        assert engine.log_tail(200).count('"lora_name":"agent@2"') == 2  # re-loaded after the refusal
        assert engine.adapters == {"agent@2": str(second)} and engine.pending_adapters == ["agent@1"]
        assert "re-load 1 adapter" in str(refused.value) and "agent@1" in str(refused.value)
        engine._adapter_retry.not_before = 0.0  # its back-off is over
        with pytest.raises(EngineError, match="agent@1"):  # retried, still refused
            engine.ensure_running()
        first.mkdir()
        engine._adapter_retry.not_before = 0.0
        assert engine.ensure_running() is False  # retried and loaded, no restart
        assert list(engine.adapters) == ["agent@1", "agent@2"] and engine.pending_adapters == []
        assert engine.log_tail(200).count('"lora_name":"agent@1"') == 4 and engine.restarts == 1
    finally:
        engine.stop()


def test_engine_backs_off_failing_restarts_and_adapter_retries(tmp_path: Path) -> None:
    class Crashing(FakeVLLM):
        crash = False

        def command(self) -> list[str]:
            if self.crash:
                return [sys.executable, "-c", "print('CUDA error: out of memory'); raise SystemExit(1)"]
            return super().command()

    def wait_over(retry: Any) -> None:
        retry.not_before = 0.0  # instead of sleeping until the next try

    folder = tmp_path / "a1"
    folder.mkdir()
    engine = Crashing("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()
    try:
        engine.load_adapter("agent@1", folder)
        engine.crash = True  # every start fails from now on
        os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        engine._proc.wait()  # type: ignore[union-attr]
        with pytest.raises(EngineError, match=r"(?s)exited with code 1.*out of memory.*Next restart in 10 s"):
            engine.ensure_running()
        assert engine.ensure_running() is False and engine.restarts == 1  # too early: no restart
        assert engine.next_restart_in is not None and 0 < engine.next_restart_in <= 10
        for delay in (20, 40, 80, 160, 320, 600, 600):
            wait_over(engine._restart_retry)
            with pytest.raises(EngineError, match=f"Next restart in {delay} s") as again:
                engine.ensure_running()
            assert "out of memory" not in str(again.value)  # the log's end once per streak
        assert engine.restarts == 8

        engine.crash = False
        folder.rmdir()  # vLLM now refuses agent@1
        wait_over(engine._restart_retry)
        with pytest.raises(EngineError, match="retried in 10 s"):
            engine.ensure_running()
        assert engine.healthy() and engine.restarts == 9 and engine._restart_retry.failures == 0
        assert engine.next_restart_in is None
        loads = engine.log_tail(500).count('"lora_name":"agent@1"')
        assert engine.ensure_running() is False and engine.log_tail(500).count('"lora_name":"agent@1"') == loads
        wait_over(engine._adapter_retry)
        with pytest.raises(EngineError, match="retried in 20 s"):
            engine.ensure_running()
        folder.mkdir()
        wait_over(engine._adapter_retry)
        assert engine.ensure_running() is False and engine.pending_adapters == []
        assert engine._adapter_retry.failures == 0 and engine.restarts == 9
    finally:
        engine.stop()


def test_engine_takes_an_adapter_vllm_has_already_as_loaded(tmp_path: Path) -> None:
    # A load that timed out on our side (or whose connection dropped) may have completed in vLLM.
    first, second = tmp_path / "a1", tmp_path / "a2"
    first.mkdir()
    second.mkdir()
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()

    def load_behind_our_back(name: str, folder: Path) -> None:
        body = {"lora_name": name, "lora_path": str(folder)}
        assert httpx.post(f"{engine.base_url}/v1/load_lora_adapter", json=body).status_code == 200

    try:
        engine.load_adapter("agent@1", first)
        first.rmdir()  # the restart's re-load is refused: agent@1 stays pending
        os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        engine._proc.wait()  # type: ignore[union-attr]
        with pytest.raises(EngineError, match="agent@1"):
            engine.ensure_running()
        first.mkdir()
        load_behind_our_back("agent@1", first)
        engine._adapter_retry.not_before = 0.0  # its back-off is over
        assert engine.ensure_running() is False and engine.pending_adapters == []
        assert engine.adapters == {"agent@1": str(first)}

        load_behind_our_back("agent@2", second)  # maybe other weights than the folder holds now: loaded again
        engine.load_adapter("agent@2", second)
        assert engine.log_tail(200).count('unload_lora_adapter {"lora_name":"agent@2"}') == 1
        assert list(engine.adapters) == ["agent@1", "agent@2"]

        engine.unload_adapter("agent@2")
        engine.unload_adapter("agent@2")  # vLLM does not have it (any more): nothing to do
        assert engine.adapters == {"agent@1": str(first)}
        engine._adapters._pending.add("agent@1")  # pending, yet vLLM has it (its re-load answered too late)
        engine.unload_adapter("agent@1")
        assert engine.adapters == {} and engine.pending_adapters == []
        load_behind_our_back("agent@1", first)  # vLLM no longer has it: no "already loaded"
    finally:
        engine.stop()


def test_engine_retries_a_restart_that_timed_out(tmp_path: Path) -> None:
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=2)
    engine.start()
    try:
        os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        engine._proc.wait()  # type: ignore[union-attr]
        engine.fake_args = ["--silent"]
        with pytest.raises(EngineError, match="did not become healthy"):
            engine.ensure_running()
        assert not engine.is_alive()
        engine.fake_args = []  # it could start now
        engine._restart_retry.not_before = 0.0  # its back-off is over
        assert engine.ensure_running() is True
        assert engine.healthy() and engine.restarts == 2 and engine.last_restart_reason == "its last start failed"
    finally:
        engine.stop()
    assert engine.ensure_running() is False and not engine.is_alive()  # stopped: no longer supervised


def test_engine_backs_off_a_restart_whose_process_cannot_start(tmp_path: Path) -> None:
    """An `OSError` of the launch (its log cannot be opened; no memory or file handle left) is a failed restart
    like any other: an `EngineError`, backed off, not a restart at every call."""
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()
    log_path = engine.log_path
    try:
        os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        engine._proc.wait()  # type: ignore[union-attr]
        (tmp_path / "not-a-folder").touch()
        engine.log_path = tmp_path / "not-a-folder" / "vllm.log"
        with pytest.raises(EngineError, match=r"(?s)could not be started: FileExistsError.*Next restart in 10 s"):
            engine.ensure_running()
        assert engine.ensure_running() is False and engine.restarts == 1  # too early: no restart
        engine.log_path = log_path
        engine._restart_retry.not_before = 0.0  # its back-off is over
        assert engine.ensure_running() is True and engine.healthy() and engine.restarts == 2
    finally:
        engine.stop()


def test_engine_refuses_a_port_another_process_holds(tmp_path: Path) -> None:
    """Another server on vLLM's port answered our `/health` checks while vLLM loaded (a start that "succeeded"
    before vLLM failed to bind); the start, and a restart (backed off), now name the port instead."""
    port = free_port()
    engine = FakeVLLM("model", "base", port, log_path=tmp_path / "vllm.log", startup_timeout=30)
    with socket.create_server(("127.0.0.1", port)):
        with pytest.raises(EngineError, match=f"^vLLM's port {port} on 127.0.0.1 is in use by another process"):
            engine.start()
        assert engine.pid is None
    engine.start()
    try:
        os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        engine._proc.wait()  # type: ignore[union-attr]
        engine._stop_group()
        with socket.create_server(("127.0.0.1", port)):  # taken while vLLM was down
            with pytest.raises(EngineError, match=f"(?s)port {port} on 127.0.0.1 is in use.*Next restart in 10 s"):
                engine.ensure_running()
        engine._restart_retry.not_before = 0.0  # its back-off is over
        assert engine.ensure_running() is True and engine.healthy()
    finally:
        engine.stop()


def test_engine_log_is_rotated_at_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each (re)start appended to `vllm.log` for good: a crash loop over days grew it without end."""
    monkeypatch.setattr("trainer_service.vllm_launch._LOG_ROTATE_BYTES", 100)
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()
    try:
        for restart in (1, 2):
            engine.load_adapter(f"agent@{restart}", tmp_path)  # its POST is logged: over 100 bytes
            os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
            engine._proc.wait()  # type: ignore[union-attr]
            assert engine.ensure_running() is True
            assert f'"lora_name":"agent@{restart}"' in (tmp_path / "vllm.log.1").read_text()
        assert sorted(path.name for path in tmp_path.glob("vllm.log*")) == ["vllm.log", "vllm.log.1"]
        assert (tmp_path / "vllm.log.1").read_text().count('"lora_name":"agent@1"') == 1  # the second run's re-load
    finally:
        engine.stop()


def test_engine_stop_interrupts_a_restart(tmp_path: Path) -> None:
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=60)
    engine.start()
    os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
    engine._proc.wait()  # type: ignore[union-attr]
    engine.fake_args = ["--silent"]  # the restarted vLLM never answers /health
    errors: list[EngineError] = []

    def watchdog() -> None:
        try:
            engine.ensure_running()
        except EngineError as exc:
            errors.append(exc)

    restart = threading.Thread(target=watchdog)
    restart.start()
    while engine.restarts == 0 or not engine.is_alive():
        time.sleep(0.05)
    started = time.monotonic()
    engine.stop()
    assert time.monotonic() - started < 10, "stop() waited for the restart's start-up timeout"
    restart.join()
    assert not engine.is_alive() and len(errors) == 1 and "stopped while starting" in str(errors[0])
    assert engine.ensure_running() is False and engine.restarts == 1


def test_stop_during_the_re_load_of_adapters_loads_no_more(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restart re-loads every adapter under the lock `stop` waits for, each load allowed 120 s: against a vLLM that
    no longer answers, a shutdown waited that long for each adapter."""
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()
    try:
        for name in ("agent@1", "agent@2", "agent@3"):
            engine.load_adapter(name, tmp_path)
        os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        engine._proc.wait()  # type: ignore[union-attr]
        loaded: list[str] = []
        real_load = engine_adapters.load_lora

        def load_then_stop_arrives(base_url: str, name: str, path: str, stopping: threading.Event) -> bool:
            loaded.append(name)
            answer = real_load(base_url, name, path, stopping)
            engine._stopping.set()  # what `stop` does first, before it waits for the lock
            return answer

        monkeypatch.setattr(engine_adapters, "load_lora", load_then_stop_arrives)
        assert engine.ensure_running() is True
        assert loaded == ["agent@1"] and engine.pending_adapters == ["agent@2", "agent@3"]
    finally:
        engine.stop()


def _adapter_folder(tmp_path: Path, name: str, answer_after: float | None = None) -> Path:
    """An adapter folder for `FakeVLLM`, whose loads it answers after `answer_after` seconds (None: at once)."""
    folder = tmp_path / name
    folder.mkdir()
    if answer_after is not None:
        (folder / "answer-after").write_text(str(answer_after))
    return folder


def _stop_while_loading(engine: FakeVLLM, folder: Path, stops: int = 1) -> float:
    """Once vLLM got a load of `folder`, call `engine.stop` from `stops` threads at once; seconds until all returned."""
    while f'"lora_path":"{folder}"' not in engine.log_tail(5):
        time.sleep(0.05)
    threads = [threading.Thread(target=engine.stop) for _ in range(stops)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - started


def test_stop_gives_up_an_adapter_load_vllm_does_not_answer(tmp_path: Path) -> None:
    """A load under way held the lock `stop` waits for: against a vLLM that never answered it, `stop` (once, or twice
    at once) took the load's 120 s timeout. A slow load that no one stops is still waited for."""
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    slow, hung = _adapter_folder(tmp_path, "slow", answer_after=1.0), _adapter_folder(tmp_path, "hung", 600)
    engine.start()
    try:
        engine.load_adapter("agent@1", slow)
        assert engine.adapters == {"agent@1": str(slow)}
        errors: list[EngineError] = []

        def load_hung() -> None:
            with pytest.raises(EngineError) as given_up:
                engine.load_adapter("agent@2", hung)
            errors.append(given_up.value)

        load = threading.Thread(target=load_hung)
        load.start()
        assert _stop_while_loading(engine, hung, stops=2) < 10, "stop() waited for the load's timeout"
        load.join()
        assert len(errors) == 1 and "the engine is stopping" in str(errors[0]) and "'agent@2'" in str(errors[0])
        assert engine.adapters == {"agent@1": str(slow)} and not engine.is_alive()
    finally:
        engine.stop()


def test_stop_gives_up_a_restarts_re_load_vllm_does_not_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The watchdog's restart re-loads adapters under the lock `stop` waits for: a re-load vLLM never answered made a
    shutdown wait its 120 s. It is given up, logged once, and its adapter stays pending with the rest."""
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    first, second = _adapter_folder(tmp_path, "a1"), _adapter_folder(tmp_path, "a2")
    engine.start()
    try:
        engine.load_adapter("agent@1", first)
        engine.load_adapter("agent@2", second)
        (first / "answer-after").write_text("600")  # the restarted vLLM hangs on agent@1's re-load
        os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        engine._proc.wait()  # type: ignore[union-attr]
        restarted: list[bool] = []
        watchdog = threading.Thread(target=lambda: restarted.append(engine.ensure_running()))
        with caplog.at_level(logging.WARNING, logger="trainer_service.engine_adapters"):
            watchdog.start()
            while engine.log_tail(200).count('"lora_name":"agent@1"') < 2:  # loaded, then its re-load sent
                time.sleep(0.05)
            assert _stop_while_loading(engine, first) < 10, "stop() waited for the re-load's timeout"
            watchdog.join()
        assert restarted == [True] and engine.pending_adapters == ["agent@1", "agent@2"] and not engine.is_alive()
        given_up = [record.getMessage() for record in caplog.records if "not re-loaded" in record.getMessage()]
        assert len(given_up) == 1 and "adapter agent@1" in given_up[0] and "the engine is stopping" in given_up[0]
    finally:
        engine.stop()


def test_stop_gives_up_the_watchdogs_health_check_vllm_does_not_answer(tmp_path: Path) -> None:
    """The watchdog's health check waits up to 10 s for `/health` under the lock `stop` waits for: against a vLLM that
    accepts but never answers, a shutdown waited those 10 s (9.2 s measured). It is given up, counted as no failed
    check, and no restart follows."""
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()
    try:
        httpx.post(f"{engine.base_url}/mute", json={})
        restarted: list[bool] = []
        watchdog = threading.Thread(target=lambda: restarted.append(engine.ensure_running()))
        watchdog.start()
        while "GET /health unanswered" not in engine.log_tail(5):
            time.sleep(0.05)
        started = time.monotonic()
        engine.stop()
        assert time.monotonic() - started < 3, "stop() waited for the health check's timeout"
        watchdog.join()
        assert restarted == [False] and engine.restarts == 0 and engine._failed_health_checks == 0
        assert not engine.is_alive()
    finally:
        engine.stop()


def test_engine_restarts_a_hung_engine(tmp_path: Path) -> None:
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()
    try:
        engine.load_adapter("agent@1", tmp_path)
        hung_pid = engine.pid
        assert hung_pid is not None
        httpx.post(f"{engine.base_url}/hang", json={})
        for _ in range(HEALTH_FAILURES_BEFORE_RESTART - 1):  # a few failed checks are tolerated
            assert engine.ensure_running() is False and engine.pid == hung_pid
        assert engine.ensure_running() is True
        assert engine.pid != hung_pid and not running(hung_pid) and engine.healthy()
        assert engine.restarts == 1 and "health checks in a row" in (engine.last_restart_reason or "")
        assert engine.log_tail(200).count('"lora_name":"agent@1"') == 2 and engine.pending_adapters == []
    finally:
        engine.stop()


def test_engine_restart_stops_the_old_process_group(tmp_path: Path) -> None:
    # vLLM's API server can die while its engine core child lives on, holding the port and the memory.
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.fake_args = ["--with-child"]
    engine.start()
    child = int(engine.log_tail().split("CHILD ")[1].split()[0])
    try:
        assert running(child)
        os.kill(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        engine._proc.wait()  # type: ignore[union-attr]
        assert engine.ensure_running() is True
        assert not running(child), "the old engine's child outlived the restart"
    finally:
        engine.stop()
        if running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_engine_stops_beside_a_process_whose_name_is_not_utf8(tmp_path: Path) -> None:
    # /proc/PID/stat holds the raw process name cut at 15 bytes: "abcdefghijklmn" and half of "é".
    named = ("import ctypes, time; ctypes.CDLL(None).prctl(15, 'abcdefghijklmné'.encode(), 0, 0, 0); "
             "print(flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", named], stdout=subprocess.PIPE)
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    try:
        assert other.stdout is not None and other.stdout.readline()
        assert Path(f"/proc/{other.pid}/stat").read_bytes().startswith(b"%d (abcdefghijklmn\xc3)" % other.pid)
        engine.start()
        engine.stop()
        assert not engine.is_alive()
    finally:
        if engine.is_alive():
            os.killpg(engine.pid, signal.SIGKILL)  # type: ignore[arg-type]
        other.kill()
        other.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_engine_stops_when_the_service_is_killed(tmp_path: Path) -> None:
    # A service process starts the (fake) engine, then is killed with SIGKILL: no stop() runs,
    # and the engine, in its own session, must still go away instead of holding its port.
    service = textwrap.dedent(f"""
        import sys, time
        from trainer_service.engine import VLLMEngine
        class Fake(VLLMEngine):
            def command(self):
                return [sys.executable, "-c", {_FAKE_VLLM!r}, str(self.port)]
        engine = Fake("model", "base", 18995, log_path={str(tmp_path / "vllm.log")!r}, startup_timeout=30)
        engine.start()
        print(engine.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", service], stdout=subprocess.PIPE, text=True)
    engine_pid = 0
    try:
        assert parent.stdout is not None
        engine_pid = int(parent.stdout.readline())
        assert running(engine_pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while running(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(engine_pid), "the engine outlived the service that started it"
    finally:
        parent.kill()
        if engine_pid and running(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


class SlowVLLM(FakeVLLM):
    """`_FAKE_VLLM`, binding its port only a second after it started (vLLM imports and reads its flags first)."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import sys, time; time.sleep(1); exec(sys.argv.pop(1))", _FAKE_VLLM,
                str(self.port), *self.fake_args]


def test_vllms_port_stays_the_engines_while_vllm_starts(tmp_path: Path) -> None:
    """vLLM's port was bound for a moment before vLLM started: meanwhile a connection's local end (our `/health`
    checks) or another program could take it, and vLLM then failed to bind it."""
    port = free_port()
    engine = SlowVLLM("model", "base", port, log_path=tmp_path / "vllm.log", startup_timeout=30)
    tries: list[int] = []

    def take_the_port() -> None:
        with socket.socket() as other:
            tries.append(_bind_errno(other, port))

    taker = threading.Timer(0.3, take_the_port)  # before the fake binds it, after the engine started it
    taker.start()
    engine.start()
    try:
        taker.join()
        assert tries == [errno.EADDRINUSE] and engine.healthy()
    finally:
        engine.stop()
    assert engine._port._port_hold is None  # let go at stop (a plain bind may still fail: the fake's closed sockets)


def _bind_errno(sock: socket.socket, port: int) -> int:
    """0 when `sock` could bind 127.0.0.1:`port` (without `SO_REUSEADDR`, as a connection's local end), else the
    errno."""
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        return exc.errno or -1
    return 0


def test_a_stop_that_fails_still_lets_vllms_port_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that outlived SIGKILL failed `stop`, and the engine kept vLLM's port bound until a second `stop`."""
    engine = FakeVLLM("model", "base", free_port(), log_path=tmp_path / "vllm.log", startup_timeout=30)
    engine.start()
    real_stop_group = engine._stop_group

    def stuck(timeout: float = 30.0) -> None:
        real_stop_group(timeout)
        raise EngineError("vLLM's process group still runs")

    monkeypatch.setattr(engine, "_stop_group", stuck)
    with pytest.raises(EngineError):
        engine.stop()
    assert engine._port._port_hold is None
