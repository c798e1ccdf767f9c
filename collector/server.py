"""HTTP layer of the collector: thin FastAPI handlers over a `Store`.

Every failure answers the `ErrorResponse` envelope. With an API key configured, write
endpoints (`POST`) need `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from collector import assembly, otlp
from collector.auth import bearer_matches
from collector.config import CollectorSettings, validation_problem
from collector.engine import driver_reason
from collector.errors import CollectorError, NotFound
from collector.protocol import (
    IDEMPOTENCY_KEY_HEADER,
    AckRequest,
    AckResponse,
    Batch,
    BatchRequest,
    ErrorResponse,
    GroupState,
    GroupStatus,
    Name,
    ReleaseRequest,
    ReleaseResponse,
    ReopenResponse,
    RewardAccepted,
    RewardIn,
    Trajectory,
    request_route,
)
from collector.scoring_api import install as install_scoring
from collector.store import SqlStore
from collector.store_base import Store

__all__ = ["create_app"]

log = logging.getLogger(__name__)

_ERRORS = {
    400: {"model": ErrorResponse},
    401: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    409: {"model": ErrorResponse},
}


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=code, message=message).model_dump(), status_code=status, headers=headers)


class _Rejected(CollectorError):
    """A request refused before it reaches the store (auth, encoding)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message, code=code)
        self.status = status


_OTLP_STATUS = {"malformed_body": 400, "body_too_large": 413, "unsupported_media_type": 415}


class _BodyLimit:
    """ASGI middleware: a request body past `limit` bytes, declared or as it streams in, is refused with 413
    `body_too_large` before it is held whole, on every route."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            too_large = f"body of {declared} bytes exceeds the limit of {self.limit} bytes"
            await _error(413, "body_too_large", too_large)(scope, receive, send)
            return
        size = 0

        async def bounded() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > self.limit:  # an HTTPException: FastAPI passes it on from reading a body, to `_http`
                raise StarletteHTTPException(413, f"body exceeds the limit of {self.limit} bytes")
            return message

        await self.app(scope, bounded, send)


class _RequestRoute:
    """ASGI middleware: sets `request_route` (`POST /v1/batches`) while a request is served, for the warning that
    names a body's unknown fields (`RequestBody`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = request_route.set(f"{scope['method']} {scope['path']}")
        try:
            await self.app(scope, receive, send)
        finally:
            request_route.reset(token)


PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'self'"
)
"""The web page's Content-Security-Policy: it runs only its own app.js and style.css and reads only this
collector, so recorded text that ever got into its markup could neither run script nor load anything."""


class _PageHeaders:
    """ASGI middleware: every answer under `/ui` (the web page) carries `PAGE_POLICY` and `nosniff`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/ui"):
            await self.app(scope, receive, send)
            return

        async def with_policy(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["Content-Security-Policy"] = PAGE_POLICY
                headers["X-Content-Type-Options"] = "nosniff"
            await send(message)

        await self.app(scope, receive, with_policy)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body (`_BodyLimit` bounds it as sent), refused with 413 past `limit` bytes after gunzip."""
    body = await request.body()
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("gzip", "x-gzip"):  # x-gzip: RFC 9110 asks a recipient to read it as gzip
        return otlp.gunzip(body, limit)
    if encoding not in ("", "identity"):
        raise _Rejected(
            415, "unsupported_encoding", f"Content-Encoding {encoding!r} is not supported; use gzip or none"
        )
    return body


def _authorize(request: Request) -> None:
    """Require `Authorization: Bearer <api_key>` when the app has an API key."""
    secret = request.app.state.settings.api_key
    if secret is None:
        return
    if not bearer_matches(request.headers.get("authorization", ""), secret.get_secret_value()):
        raise _Rejected(401, "unauthorized", "send `Authorization: Bearer <ART_API_KEY>`")


Auth = Annotated[None, Depends(_authorize)]


def _unreadable(request: Request, cause: ValueError | RecursionError) -> str:
    """Why a JSON request body could not be read, for its 400."""
    why = "it nests too deeply" if isinstance(cause, RecursionError) else str(cause)
    message = f"the body is not JSON that can be read: {why}"
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        message += f"; Content-Encoding {encoding!r} is read on POST /v1/traces only"
    return message


NUL_REFUSED = "holds a NUL character, which is in no id or name the collector stores"
"""Why a path parameter or query value with a NUL is refused (`_refuse_nul`)."""


async def _refuse_nul(request: Request) -> None:
    """A dependency of every route: a path parameter or query value holding a NUL is a 400 `invalid_request` naming
    each (`path.batch_id: ...`, as `validation_problem` names a field), before the route reads the store. Ingest and
    the request bodies refuse a NUL in every id and name, so such a value matches nothing; PostgreSQL could not even
    look it up (its text holds no NUL), while SQLite answered 404 or `[]`. A coroutine, though it awaits nothing:
    FastAPI runs a plain function in its thread pool, some 80 us per request for a check of about 1 us."""
    places = [("path", name) for name, value in request.path_params.items() if "\x00" in str(value)]
    places += [("query", name) for name, value in request.query_params.multi_items() if "\x00" in value]
    if places:
        raise RequestValidationError(
            [{"type": "value_error", "loc": place, "msg": NUL_REFUSED} for place in dict.fromkeys(places)]
        )


def _lease_answer(batch: Batch) -> Response:
    """The JSON answer of `POST /v1/batches`, the bytes of `batch.model_dump_json()`, encoded in the route (not by
    FastAPI once it returned), so that a failure to encode it meets `_release_unsent`.

    Encoded a group at a time, each taken out of `batch.groups` once encoded: a large batch's assembled objects take
    several times its JSON's size, and so its bytes replace them instead of being made beside them."""
    shell = batch.model_copy(update={"groups": []}).model_dump_json().encode()
    head, _, tail = shell.partition(b'"groups":[]')  # only the id comes before it, with its quotes escaped
    groups: list[bytes] = []  # each group after a comma
    while batch.groups:
        groups += [b",", batch.groups.pop(0).model_dump_json().encode()]
    return Response(b"".join([head, b'"groups":[', *groups[1:], b"]", tail]), media_type="application/json")


def _release_unsent(store: Store, batch_id: str, leased: int, cause: Exception) -> None:
    """Give back the `leased` groups of the committed lease `batch_id` whose answer could not be sent (`cause`): no
    trainer got its id to ack or release it, so they would stay leased until it expires. As failed: a group whose
    stored data fails every answer is skipped after `max_failed_attempts`, not leased and failed again forever. Not
    after a `MemoryError`: the server's want of memory, or a batch too large to answer (fewer `max_groups`), is no
    fault of each group's data, and counting it skipped good data. A release that fails is logged; the caller answers
    `cause`."""
    if not leased:  # nothing leased: no batch stored
        return
    why = f"{type(cause).__name__}: {cause}"
    failed = not isinstance(cause, MemoryError)
    log.error("the answer of lease %s could not be sent (%s): releasing its %d groups%s", batch_id, why, leased,
              "" if failed else ", no failed attempt counted")
    try:
        store.release(batch_id, ReleaseRequest(reason=f"its answer could not be sent: {why}", failed=failed))
    except Exception:
        log.exception("lease %s could not be released: its groups stay leased until it expires", batch_id)


STORE_RETRY_AFTER_S = 5
"""`Retry-After` of a 503 `store_unavailable` answer."""


def create_app(settings: CollectorSettings | None = None, store: Store | None = None) -> FastAPI:
    """Build the collector's app; creates (and migrates) the store unless one is given."""
    settings = settings or CollectorSettings()
    if store is None:
        store = SqlStore(settings)
    store.setup()
    app = FastAPI(
        title="art-langgraph collector", version="0.1.0", responses=_ERRORS, dependencies=[Depends(_refuse_nul)]
    )
    app.state.settings, app.state.store = settings, store
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(_RequestRoute)
    app.add_middleware(_PageHeaders)
    @app.exception_handler(CollectorError)
    async def _collector_error(_: Request, exc: CollectorError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc.status, exc.code, exc.message, headers)

    @app.exception_handler(otlp.OtlpError)
    async def _otlp_error(_: Request, exc: otlp.OtlpError) -> JSONResponse:
        return _error(_OTLP_STATUS.get(exc.code, 400), exc.code, str(exc))

    async def _unauthorized(request: Request) -> JSONResponse | None:
        """The 401 of a write without the key, which FastAPI's reading of a JSON body comes before (`Auth` runs
        after it): a body that is not JSON answers 401 too without the key."""
        if request.method == "GET":
            return None
        try:
            _authorize(request)
        except _Rejected as rejected:
            return await _collector_error(request, rejected)
        return None

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if unauthorized := await _unauthorized(request):
            return unauthorized
        details = "; ".join(validation_problem(error) for error in exc.errors())
        return _error(400, "invalid_request", details or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, ValueError | RecursionError):
            # FastAPI could not read the JSON body (not UTF-8, say gzip, an integer past Python's 4300 digits,
            # nesting past the recursion limit) and said only "There was an error parsing the body"
            return await _unauthorized(request) or _error(400, "invalid_request", _unreadable(request, exc.__cause__))
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))

    @app.exception_handler(OperationalError)
    async def _store_unavailable(request: Request, exc: OperationalError) -> JSONResponse:
        # a full disk, a lock held past the timeout, a lost database connection: the transaction rolled
        # back, so nothing was stored and the client may send the same request again (OTLP exporters retry 503)
        log.error("store unavailable on %s %s: %s", request.method, request.url.path, exc)
        return _error(503, "store_unavailable", f"the store could not complete the request ({driver_reason(exc)}); "
                      "nothing was stored, try again", headers={"Retry-After": str(STORE_RETRY_AFTER_S)})

    @app.exception_handler(DataError)
    async def _value_refused(request: Request, exc: DataError) -> JSONResponse:
        # a value of the request the database cannot hold that no check before it refused (a NUL in the URL is
        # refused by `_refuse_nul`); the transaction rolled back
        log.warning("store refused a value on %s %s: %s", request.method, request.url.path, driver_reason(exc))
        return _error(400, "invalid_request", f"the store cannot hold a value of this request ({driver_reason(exc)})")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")

    @app.get("/health")
    def health() -> dict[str, str]:
        """Liveness: answers 200 while the service runs."""
        return {"status": "ok"}

    @app.post("/v1/traces", response_class=Response)
    async def export_traces(request: Request, _: Auth) -> Response:
        """OTLP/HTTP trace export (protobuf or JSON, optionally gzip). 200 only after commit.

        Spans that cannot be stored (invalid ids, non-finite rewards, over-long ids) are rejected one by one: the
        answer is then a `partial_success` that counts and explains them.
        """
        body = await _read_body(request, settings.max_body_bytes)
        content_type = request.headers.get("content-type")
        decoded = otlp.decode_request(body, content_type)
        accepted, rejected = [], list(decoded.rejected)
        for record in decoded.spans:
            if problem := assembly.span_problem(record):
                rejected.append(f"span {record.name!r} ({record.span_id}): {problem}")
            else:
                accepted.append(record)
        await run_in_threadpool(store.add_spans, accepted)
        if rejected:
            log.warning("export: %d spans stored or known, %d rejected (%s)", len(accepted), len(rejected), rejected[0])
        payload, media_type = otlp.encode_response(content_type, rejected)
        return Response(payload, media_type=media_type)

    @app.post("/v1/rewards")
    def post_reward(reward: RewardIn, _: Auth) -> RewardAccepted:
        """Attach a named reward to a trajectory (by rollout id or trace id)."""
        return store.add_reward(reward)

    @app.post("/v1/batches", response_model=Batch)
    def lease_batch(
        _: Auth, request: BatchRequest | None = None,
        idempotency_key: Annotated[Name | None, Header(alias=IDEMPOTENCY_KEY_HEADER)] = None,
    ) -> Response:
        """Lease up to `max_groups` ready groups; `groups` is empty when none are ready. Sent again with the same
        `Idempotency-Key` while the lease lasts, the same batch (409 `idempotency_key_used` once it ended). A
        lease whose answer cannot be encoded is released as failed before the 500."""
        request = request or BatchRequest()
        if idempotency_key is not None:
            if request.idempotency_key not in (None, idempotency_key):
                raise _Rejected(400, "invalid_request", f"the {IDEMPOTENCY_KEY_HEADER} header and the body's "
                                "idempotency_key differ; send one of them")
            request = request.model_copy(update={"idempotency_key": idempotency_key})
        batch = store.lease(request)
        leased = len(batch.groups)  # `_lease_answer` takes them out as it encodes them
        try:
            return _lease_answer(batch)
        except Exception as exc:
            _release_unsent(store, batch.id, leased, exc)
            raise

    @app.post("/v1/batches/{batch_id}/ack")
    def ack_batch(batch_id: str, _: Auth, body: AckRequest | None = None) -> AckResponse:
        """Mark the batch's groups trained (404 unknown batch; 409 when its groups were re-leased or it was
        released)."""
        return store.ack(batch_id, body.policy_step if body else None)

    @app.post("/v1/batches/{batch_id}/release")
    def release_batch(batch_id: str, _: Auth, body: ReleaseRequest) -> ReleaseResponse:
        """Give the batch's groups back untrained, now; with `failed` each counts a failed attempt, and a group at
        the limit is skipped (404 unknown batch; 409 when acked). Releasing it again answers the same."""
        return store.release(batch_id, body)

    @app.post("/v1/groups/{group_id:path}/reopen")
    def reopen_group(group_id: str, _: Auth) -> ReopenResponse:
        """Put a skipped or expired group back in the pool, its failed attempts reset (404 unknown group; 409 when
        it is open, leased or trained)."""
        return store.reopen(group_id)

    @app.get("/v1/trajectories")
    def list_trajectories(
        group: str | None = None, task: str | None = None, split: str | None = None
    ) -> list[Trajectory]:
        """Trajectories, filtered by group (id or key), task and split."""
        return store.trajectories(group=group, task=task, split=split)

    @app.get("/v1/trajectories/{trajectory_id:path}")
    def get_trajectory(trajectory_id: str) -> Trajectory:
        """One trajectory by id (rollout id, or trace id for calls outside a rollout)."""
        found = store.trajectory(trajectory_id)
        if found is None:
            raise NotFound(f"no trajectory {trajectory_id!r}")
        return found

    @app.get("/v1/groups")
    def list_groups(state: Annotated[list[GroupState] | None, Query()] = None) -> list[GroupStatus]:
        """Every group with its size, completeness, rewards and state; `?state=ready` (repeatable): only those."""
        return store.groups(states=state)

    install_scoring(app, store, _authorize)  # RULER, Langfuse, read API, web page (collector/scoring_api.py)
    return app
