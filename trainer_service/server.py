"""HTTP layer of the trainer service: thin FastAPI handlers over `TrainerService`.

* `POST /v1/chat/completions`, `POST /v1/completions`: proxied to vLLM (streaming passthrough),
  with `name@latest` / `name` rewritten to the newest checkpoint; a shutdown waits for vLLM's answers only its grace.
* `GET /v1/models`: the base model, every `name@N` and `name@latest`.
* `POST /v1/train`: one GRPO step now; `POST /v1/sft`: one supervised warm-start step.
* `POST /v1/pause`, `POST /v1/resume`: stop and restart training (scheduled and manual).
  These four control routes take no parameters (no query string; no body, or `{}`): their settings are the
  trainer's flags.
* `GET /v1/status`: step, queue depth, schedule, promotion, metrics, engine health.

With an API key set, every route needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from collector.auth import bearer_matches
from collector.listen import AnnouncedServer, serve_on
from trainer_service.base_model import check_base_model, resolve_base_model, served_base_name
from trainer_service.config import TrainerSettings
from trainer_service.core_lending import CoreLender
from trainer_service.distributed import TrainLauncher
from trainer_service.engine import VLLMEngine
from trainer_service.grpo_config import GRPOConfig
from trainer_service.protocol import ServiceError, StatusResponse, TrainResponse
from trainer_service.proxy import (
    CLIENT_CLOSED_REQUEST,
    DROPPED_HEADERS,
    EngineWaits,
    relay,
    send_unless_client_leaves,
    streams,
)
from trainer_service.service import TrainerService
from trainer_service.training import LoRATrainer
from trainer_service.vllm_cpu_matmul import matmul_dtype
from trainer_service.vllm_cpu_threads import EngineThreads

__all__ = ["build_service", "create_app", "serve"]

logger = logging.getLogger(__name__)

_ENGINE_CONNECTIONS = 128
"""Most concurrent requests the proxy sends to vLLM; the rest wait in the proxy's pool (queued, not failed)."""
_RETRY_AFTER_S = 10
"""`Retry-After` of every 503: the engine's watchdog looks every 10 s, so a restart or an adapter re-load is under
way by then (OpenAI clients wait what it says, up to 60 s, before they retry)."""
_NO_PARAMETERS = re.compile(rb"[ \t\r\n]*(\{[ \t\r\n]*\})?[ \t\r\n]*")
"""The bodies a control route (`/v1/train`, `/v1/pause`, ...) takes: none, or JSON's empty object."""
_NO_PARAMETERS_READ = 4096
"""Bytes of a control route's body read at most: any it takes fits (`{}` amid whitespace); a longer one is refused
without reading the rest."""


def build_service(settings: TrainerSettings, grpo: GRPOConfig,
                  collector_transport: httpx.AsyncBaseTransport | None = None) -> TrainerService:
    """Wire a `TrainerService` from settings: the base model, the vLLM engine and the trainer.

    Raises:
        BaseModelError: the base model, its chat template, the LoRA target modules or `--max-model-len`
            (`check_base_model`).
    """
    for warning in settings.ignored_with_cuda():
        logger.warning("%s", warning)
    model_path = resolve_base_model(settings.base_model)
    # a --vllm-arg can change the length vLLM reads of the model (--hf-overrides, --config-format): vLLM checks it
    max_model_len = None if settings.vllm_args else settings.max_model_len
    check_base_model(model_path, settings.served_chat_template(), grpo.target_modules, max_model_len)
    engine_threads = EngineThreads.from_settings(settings, settings.run_dir / "vllm-threads")
    engine = VLLMEngine(
        model_path,
        served_base_name(settings.base_model),
        settings.vllm_port,
        dtype=settings.vllm_dtype,
        # a VLLM_CPU_KVCACHE_SPACE of the user's counts unless --kv-cache-gib (ART_TRAINER_KV_CACHE_GIB) is set
        kv_cache_gib=settings.kv_cache_gib if "kv_cache_gib" in settings.model_fields_set else None,
        block_size=settings.engine_block_size(),
        max_model_len=settings.max_model_len,
        max_lora_rank=settings.max_lora_rank,
        max_loras=settings.max_loras,
        cpu_matmul_dtype=matmul_dtype(settings.vllm_matmul_dtype),
        threads=engine_threads,
        extra_args=[*settings.tool_calling_args(), *settings.structured_output_args(), *settings.vllm_args],
        log_path=settings.run_dir / "vllm.log",
        startup_timeout=settings.vllm_startup_timeout,
    )
    launcher = None
    if settings.train_processes > 1:
        # The workers share the training threads; the service's own copy only holds the state.
        launcher = TrainLauncher(settings.train_processes, model_path, settings.run_dir / "train_workers.log",
                                 chat_template=settings.served_chat_template(),
                                 cpu_threads=max(1, settings.training_threads() // settings.train_processes),
                                 timeout=settings.train_step_timeout)
    lender = CoreLender.from_settings(settings, can_lend=launcher is None, engine_threads=engine_threads)

    def load_trainer() -> LoRATrainer:
        trainer = LoRATrainer.load(model_path, grpo, base_model=settings.base_model,
                                   chat_template=settings.served_chat_template(),
                                   cpu_threads=lender.own_threads, device="cpu" if launcher else None)
        lender.attach(trainer.model)
        return trainer

    return TrainerService(settings, grpo, engine, load_trainer, collector_transport=collector_transport,
                          launcher=launcher, lender=lender)


async def _body_head(request: Request) -> bytes:
    """The request's body, or its first chunks once they pass `_NO_PARAMETERS_READ` bytes (the rest left unread)."""
    head = b""
    async for chunk in request.stream():
        head += chunk
        if len(head) > _NO_PARAMETERS_READ:
            break
    return head


async def _takes_no_parameters(request: Request) -> None:
    """Refuse a control route's query string, and its body unless it is empty or `{}`: its settings are the trainer's
    flags, not parameters."""
    body = await _body_head(request)
    if request.url.query or len(body) > _NO_PARAMETERS_READ or not _NO_PARAMETERS.fullmatch(body):
        raise ServiceError(400, "unexpected_body", f"{request.method} {request.url.path} takes no parameters: send no "
                           "query string, and no body or `{}`. Training settings (`--batch-groups`, the GRPO flags, "
                           "...) are `art-trainer serve` flags, and so are its triggers (`--min-groups`, `--every`, "
                           "`--cron`); a manual step trains on what is ready now. See `art-trainer serve --help`.")


def _error(exc: ServiceError) -> JSONResponse:
    """`exc` as an answer: its envelope, with `Retry-After` on a 503 and `WWW-Authenticate` on a 401."""
    headers = {503: {"Retry-After": str(_RETRY_AFTER_S)}, 401: {"WWW-Authenticate": "Bearer"}}.get(exc.status)
    return JSONResponse(exc.body.model_dump(), status_code=exc.status, headers=headers)


def create_app(settings: TrainerSettings | None = None, grpo: GRPOConfig | None = None, *,
               service: TrainerService | None = None) -> FastAPI:
    """Build the FastAPI app. The lifespan starts vLLM and the trainer, and stops them.

    Args:
        settings: service settings (default: from the environment).
        grpo: GRPO hyper-parameters (default: `GRPOConfig()`).
        service: a prepared service (tests); built from `settings` and `grpo` when None.
    """
    settings = settings or (service.settings if service else TrainerSettings())
    svc = service or build_service(settings, grpo or GRPOConfig())
    engine_client: httpx.AsyncClient | None = None
    waits = EngineWaits()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal engine_client
        if svc.trainer is None:  # not started yet: `art-trainer serve` starts it before serving, to report its errors
            await asyncio.to_thread(svc.start)
        # Every pooled connection stays open (keep-alive = max): under 2,000 queued requests, re-opening
        # connections to a saturated vLLM timed out on connect (101 of 2,000 got 503 with the defaults).
        # A failed connect is retried (nothing was sent yet).
        limits = httpx.Limits(max_connections=_ENGINE_CONNECTIONS, max_keepalive_connections=_ENGINE_CONNECTIONS)
        engine_client = httpx.AsyncClient(
            base_url=svc.engine.base_url, timeout=httpx.Timeout(1800.0, connect=60.0),
            transport=httpx.AsyncHTTPTransport(limits=limits, retries=2),
        )
        watchdog = asyncio.create_task(svc.watch_engine())
        svc.schedule.start()
        try:
            yield
        finally:
            svc.schedule.shutdown()
            watchdog.cancel()
            await engine_client.aclose()
            await svc.aclose()

    app = FastAPI(title="art-langgraph trainer service", lifespan=lifespan)
    app.state.service = svc
    app.state.engine_waits = waits

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if settings.api_key and not bearer_matches(request.headers.get("authorization", ""), settings.api_key):
            return _error(ServiceError(401, "invalid_api_key", "Missing or wrong API key: send "
                                       "`Authorization: Bearer <ART_API_KEY>`."))
        return await call_next(request)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own errors (an unknown route, a method a route does not take) in the envelope too."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        response = _error(ServiceError(exc.status_code, code, f"{request.method} {request.url.path}: {exc.detail}",
                                       type="not_found_error" if exc.status_code == 404 else "invalid_request_error"))
        response.headers.update(exc.headers or {})  # `Allow` of a 405
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """An error no route expected: in the envelope too (it was a plain-text 500), the traceback in the log."""
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(ServiceError(500, "internal_error", f"{type(exc).__name__}: {exc}", type="server_error"))

    no_parameters = [Depends(_takes_no_parameters)]

    async def proxy(request: Request, route: str) -> Response:
        assert engine_client is not None
        try:
            body: dict[str, Any] = await request.json()
        except ValueError as exc:
            raise ServiceError(400, "invalid_json", f"The request body is not JSON: {exc}") from exc
        except RecursionError as exc:
            raise ServiceError(400, "invalid_json", "The request body is JSON nested too deeply.") from exc
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise ServiceError(400, "missing_model", "The request needs a `model` string.", param="model")
        try:
            body["model"].encode()  # a lone surrogate could not even be shown in the 404 of an unknown name
        except UnicodeEncodeError as exc:
            raise ServiceError(400, "invalid_json", f"The `model` string is not valid Unicode: {exc}.",
                               param="model") from exc
        body["model"] = svc.resolve(body["model"])
        stream = streams(body)
        try:
            upstream = engine_client.build_request("POST", route, json=body)
        except ValueError as exc:  # NaN, Infinity, 1e400, "\ud800": Python's `json` reads them, JSON text has none
            raise ServiceError(400, "invalid_json", f"The request body is not valid JSON: {exc} (NaN, Infinity, "
                               "a number out of float range or a lone UTF-16 surrogate).") from exc
        request_ticket = await svc.lender.engine_request()  # counted until vLLM's answer is through
        streaming = False
        try:
            response = await send_unless_client_leaves(request, engine_client, upstream, stream=stream, waits=waits)
            if response is None:  # nobody reads this answer (nginx's "client closed request")
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            headers = {k: v for k, v in response.headers.items() if k.lower() not in DROPPED_HEADERS}
            if stream:
                streaming = True
                return StreamingResponse(relay(response, request_ticket, waits), status_code=response.status_code,
                                         headers=headers)
            return Response(response.content, status_code=response.status_code, headers=headers)
        except httpx.HTTPError as exc:
            raise ServiceError(503, "engine_unavailable", f"The vLLM engine did not answer: {exc}. "
                               "See GET /v1/status and the vLLM log.", type="server_error") from exc
        finally:
            if not streaming:
                request_ticket.close()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions, answered by vLLM."""
        return await proxy(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI text completions, answered by vLLM."""
        return await proxy(request, "/v1/completions")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The base model, every checkpoint `name@N`, and `name@latest`; only names that resolve."""
        created = int(time.time())
        data = []
        for model_id in svc.served_models():
            try:
                target = svc.resolve(model_id)
            except ServiceError as exc:  # one lost or re-loading adapter must not hide the whole list
                if exc.body.error.code == "model_not_found":  # re-loading after a restart: back once it is loaded
                    svc.counters["unresolved_models"] += 1
                    logger.warning("%s is listed but vLLM does not serve it; left out of /v1/models", model_id)
                continue
            data.append({
                "id": model_id,
                "object": "model",
                "created": created,
                "owned_by": "art",
                "root": target,
                "parent": None if target == svc.base_name else svc.base_name,
                "max_model_len": settings.max_model_len,
            })
        return {"object": "list", "data": data}

    @app.post("/v1/train", dependencies=no_parameters)
    async def train() -> TrainResponse:
        """Run one GRPO step now on a batch from the collector."""
        return await svc.train_once()

    @app.post("/v1/sft", dependencies=no_parameters)
    async def sft() -> TrainResponse:
        """Run one supervised step now on the best trajectory of each group of a batch (SFT warm start)."""
        return await svc.train_once(kind="sft")

    @app.post("/v1/pause", dependencies=no_parameters)
    async def pause() -> dict[str, bool]:
        """Stop steps (scheduled and manual) from starting; a running step finishes."""
        svc.pause()
        return {"paused": True}

    @app.post("/v1/resume", dependencies=no_parameters)
    async def resume() -> dict[str, bool]:
        """Allow steps again."""
        svc.resume()
        return {"paused": False}

    @app.get("/v1/status")
    async def status() -> StatusResponse:
        """Step, last metrics, served models and engine health."""
        return await svc.status()

    @app.get("/health")
    async def health() -> dict[str, bool]:
        """200 while the service runs; `engine` tells whether vLLM answers."""
        return {"ok": True, "engine": await asyncio.to_thread(svc.engine.healthy)}

    return app


class _Server(AnnouncedServer):
    """uvicorn's server, which begins the service's shutdown (`TrainerService.begin_shutdown`) as soon as its own
    begins: uvicorn then waits for every open request (a streamed answer, a manual step) before the app's lifespan
    ends; no scheduled step may start meanwhile, and a manual step's hot-load vLLM does not answer is given up. So
    is a proxied request vLLM has not answered (or a stream it has not finished) once the service's grace is over
    (`EngineWaits`); uvicorn's own `timeout_graceful_shutdown` is not used, as it would cancel a manual step too."""

    def __init__(self, config: uvicorn.Config, service: TrainerService, waits: EngineWaits) -> None:
        super().__init__(config)
        self._service = service
        self._waits = waits

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._service.begin_shutdown()
        cut = asyncio.get_running_loop().call_later(self._service.grace.left(), self._waits.cut_off)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()


def serve(app: FastAPI, sock: socket.socket, *, log_level: str) -> None:
    """Serve `app` (from `create_app`) with uvicorn on `sock` (listening: `collector.listen.start_listening`) until
    SIGINT or SIGTERM, as `uvicorn.run` does, but with its service's shutdown begun as the server's begins
    (`_Server`).

    Raises:
        SystemExit: uvicorn's status 3 when the server did not start.
    """
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    serve_on(_Server(config, app.state.service, app.state.engine_waits), sock)
