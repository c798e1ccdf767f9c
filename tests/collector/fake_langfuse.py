"""A local HTTP server for exactly the Langfuse endpoints the collector uses, and the one that deletes a score.

A real Langfuse server needs ClickHouse, PostgreSQL and Redis, which this machine does not run,
so the Langfuse tests talk to this server instead. It follows Langfuse's published public API
(the Fern definition the `langfuse` SDK is generated from, as shipped in `langfuse/api/scores`)
and, where the collector's correctness depends on it, Langfuse's server code
(`web/src/features/public-api/server/scores-api-v3.ts` in github.com/langfuse/langfuse):

* `GET /api/public/v3/scores`: Basic auth; `limit` (an integer from 1 to 100, default 50; anything
  else → 400), `cursor`, comma-separated `id` / `name` / `source` and `dataType` (both
  case-insensitive) / `traceId` filters, `fields` (`details`, `subject`, `annotation`; anything
  else → 400), `fromTimestamp` (inclusive) and `toTimestamp` (exclusive). Answers
  `{"data": [...], "meta": {"limit": n, "cursor": "..."}}`, newest `timestamp` first, then the
  greater `id`. The cursor is Langfuse's keyset cursor: base64url JSON
  `{"v": 1, "lastTimestamp", "lastId"}` of a page's last score, and the next page holds the scores
  with (`timestamp`, `id`) below it, so a score added or deleted between pages shifts none of the
  others; one that is no base64url JSON → 400 `{"message": "Invalid cursor format"}`, one of
  another shape → 400 `{"message": "Invalid request data", "error": [...]}`, as for a bad `limit`
  or `fields`. The cursor is left out on the last page (a full last page too). Langfuse drops from
  a page the scores it cannot convert, after paging: set `dropped` to drop some, and such a page
  comes shorter than `limit`, with a cursor. Times are ISO 8601 in UTC with milliseconds
  (`2026-01-02T03:04:05.678Z`), as Langfuse writes them. A self-hosted Langfuse serves this
  endpoint only when started with `LANGFUSE_ENABLE_SCORES_V3_API=true` (Langfuse Cloud has it
  on); set `v3_enabled = False` for one without it: after auth it answers 404
  `{"message": "Not Found", "error": "LangfuseNotFoundError"}`
  (`web/src/pages/api/public/v3/scores/index.ts`). A score's
  `value` is the one `add_score` was given: `None` makes a NUMERIC score with a null value (as
  JavaScript's JSON writes a NaN or an infinity), which the API definition does not allow (it types
  the value a number) and the SDK's model rejects; not seen from a real Langfuse.
* `POST /api/public/scores`: Basic auth; a JSON list of scores; 202 `{"message": "Accepted"}`
  when all are valid, else 207 `{"accepted", "rejected", "errors": [{"message"}]}` (`CreateScoreBatchResults`:
  an error names no score). Set `refused_traces` to have it reject the scores of some traces too, as Langfuse
  rejects a score its validation refuses. Accepted scores are kept in `created` exactly as Langfuse keeps them:
  a score is identified by its `id`, its `name` and the UTC date of its `timestamp` (the time of the request
  where it has none), and one sent again replaces the stored one only when all three match; with another name or
  a timestamp on another date it is a second score beside the first, of the same id
  (https://langfuse.com/faq/all/tracing-data-updates, "Updating scores"; the SDK's `CreateScoreRequest.timestamp`:
  "To update an existing score, send it again with the same id and timestamp"; Langfuse's ClickHouse `scores`
  table is a ReplacingMergeTree ordered by `(project_id, toDate(timestamp), name, id)`,
  `packages/shared/clickhouse/migrations/canonical/0003_scores.up.sql`). `created` is keyed so (`score_key`). For
  a limited time (its docs have said 30 and 60 days) Langfuse may also merge a score sent again with the same id
  into the stored one, keeping its timestamp; that is deprecated, its docs say not to rely on it, and this server
  does not do it, so that a push that would rely on it fails here.
* `DELETE /api/public/scores/{scoreId}`: Basic auth; 202 `{"message": "Score deletion queued
  successfully"}`, for an unknown id too (Langfuse queues the deletion without looking the score
  up: `web/src/pages/api/public/scores/[scoreId].ts`; the SDK's
  `scores.delete`). This server deletes at once every score of that id, those in `created` too.

Where it does less than Langfuse: the GET endpoint never lists the scores in `created`; its other
filters (`environment`, `configId`, `queueId`, `authorUserId`, `value`, `valueMin`, `valueMax`,
`sessionId`, `observationId`, `experimentId`) are not applied, and `add_score` keeps one score per id.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

PUBLIC, SECRET = "pk-lf-test", "sk-lf-test"
_FIELD_GROUPS = {"details": ("comment", "configId", "metadata"), "subject": ("subject",),
                 "annotation": ("authorUserId", "queueId")}


def _iso(value: dt.datetime) -> str:
    return value.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_time(value: str) -> dt.datetime:
    """An ISO 8601 time; one without an offset is UTC."""
    parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def score_key(score: dict[str, Any]) -> tuple[str, str, dt.date]:
    """What identifies a score `POST /api/public/scores` stored (`FakeLangfuse.created`): its id, its name and the
    UTC date of its timestamp."""
    return score["id"], score["name"], _parse_time(score["timestamp"]).astimezone(dt.UTC).date()


def _limit(text: str) -> int | None:
    """The `limit` of a listing as Langfuse reads it (a number that is an integer from 1 to 100); None for another."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() and 1 <= value <= 100 else None


def _invalid(field: str, message: str) -> dict[str, Any]:
    """The body of Langfuse's 400 for a query whose `field` its schema rejects."""
    return {"message": "Invalid request data", "error": [{"path": [field], "message": message}]}


def _cursor(score: dict[str, Any]) -> str:
    """Langfuse's cursor of the page that ends with `score`."""
    position = {"v": 1, "lastTimestamp": score["timestamp"], "lastId": score["id"]}
    return base64.urlsafe_b64encode(json.dumps(position).encode()).decode().rstrip("=")


def _position(cursor: str) -> tuple[dt.datetime, str] | dict[str, Any]:
    """The (timestamp, id) a cursor holds, or the body of Langfuse's 400 for one it cannot read."""
    try:
        position = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except ValueError:
        return {"message": "Invalid cursor format", "error": "InvalidRequestError"}
    try:
        if not isinstance(position, dict) or position.get("v") != 1 or not isinstance(position.get("lastId"), str):
            raise ValueError("not a cursor of version 1")
        return _parse_time(position["lastTimestamp"]), position["lastId"]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return _invalid("cursor", str(exc))


def _is_time(value: object) -> bool:
    """Whether `value` is an ISO 8601 time, as a score's `timestamp` must be."""
    try:
        _parse_time(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, AttributeError):
        return False
    return True


def _trace(subject: dict[str, Any]) -> str | None:
    """The trace id of a score's subject (None for session scores), as the `traceId` filter matches it."""
    return subject["id"] if subject["kind"] == "trace" else subject.get("traceId")


class FakeLangfuse:
    """The server's state: stored scores (as Langfuse returns them) and every request seen."""

    def __init__(self) -> None:
        self.scores: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.created: dict[tuple[str, str, dt.date], dict[str, Any]] = {}
        """The scores `POST /api/public/scores` accepted, as sent (the time of the request added where they have no
        timestamp), by what identifies them in Langfuse (`score_key`): a score sent again on another date is another."""
        self.dropped: set[str] = set()
        """Ids of scores the listing drops from its pages after paging, as Langfuse drops a score it cannot convert."""
        self.v3_enabled = True
        self.failures: list[int | None] = []
        """Statuses the next authorized GET requests answer instead, one each (a 429, an outage's 503; None: the
        request is answered as usual)."""
        self.retry_after: str | None = None
        """The `Retry-After` header of those answers, if any (Langfuse Cloud's rate limit sends whole seconds)."""
        self.refused_traces: dict[str, str] = {}
        """Trace ids whose scores `POST /api/public/scores` rejects, with the error's message."""

    def add_score(
        self, score_id: str, name: str, value: Any, *, trace_id: str | None = None, observation_id: str | None = None,
        session_id: str | None = None, source: str = "ANNOTATION", data_type: str = "NUMERIC",
        timestamp: dt.datetime | None = None, comment: str | None = None,
    ) -> None:
        """Store a score as if a person had made it in the Langfuse UI."""
        now = timestamp or dt.datetime.now(dt.UTC)
        if observation_id:
            subject = {"kind": "observation", "id": observation_id, **({"traceId": trace_id} if trace_id else {})}
        elif session_id:
            subject = {"kind": "session", "id": session_id}
        else:
            subject = {"kind": "trace", "id": trace_id}
        self.scores[score_id] = {
            "id": score_id, "projectId": "project-1", "name": name, "value": value, "dataType": data_type,
            "source": source, "timestamp": _iso(now), "environment": "default", "createdAt": _iso(now),
            "updatedAt": _iso(now), "comment": comment, "configId": None, "metadata": {}, "subject": subject,
            "authorUserId": "user-1" if source == "ANNOTATION" else None, "queueId": None,
        }

    def of_id(self, score_id: str) -> list[dict[str, Any]]:
        """The scores in `created` of the id `score_id`: one, or more where it was sent again on another date."""
        return [score for key, score in self.created.items() if key[0] == score_id]

    def delete(self, score_id: str) -> None:
        """Delete every score of the id `score_id`, as Langfuse deletes a score."""
        self.scores.pop(score_id, None)
        for key in [key for key in self.created if key[0] == score_id]:
            del self.created[key]

    def touch(self, score_id: str, value: Any) -> None:
        """Change a score's value (a person edits it): `updatedAt` moves on."""
        score = self.scores[score_id]
        score["value"] = value
        score["updatedAt"] = _iso(_parse_time(score["updatedAt"]) + dt.timedelta(seconds=1))

    # --- endpoints ----------------------------------------------------------------------
    def list_scores(self, query: dict[str, list[str]]) -> tuple[int, Any]:
        one = {key: values[-1] for key, values in query.items()}
        limit = _limit(one.get("limit", "50"))
        if limit is None:
            return 400, _invalid("limit", "an integer from 1 to 100")
        groups = [g for g in one.get("fields", "").split(",") if g]
        unknown = [g for g in groups if g not in _FIELD_GROUPS]
        if unknown:
            return 400, _invalid("fields", f"unknown field groups: {unknown}")
        rows = sorted(self.scores.values(), key=lambda s: (_parse_time(s["timestamp"]), s["id"]), reverse=True)
        if "cursor" in one:
            position = _position(one["cursor"])
            if isinstance(position, dict):
                return 400, position
            rows = [s for s in rows if (_parse_time(s["timestamp"]), s["id"]) < position]
        filters = (("id", "id", False), ("name", "name", False), ("source", "source", True),
                   ("dataType", "dataType", True), ("traceId", None, False))
        for key, field, fold in filters:
            if key in one:
                wanted = {v.upper() if fold else v for v in one[key].split(",")}
                if field is None:
                    rows = [s for s in rows if _trace(s["subject"]) in wanted]
                else:
                    rows = [s for s in rows if (s[field].upper() if fold else s[field]) in wanted]
        if "fromTimestamp" in one:
            rows = [s for s in rows if _parse_time(s["timestamp"]) >= _parse_time(one["fromTimestamp"])]
        if "toTimestamp" in one:
            rows = [s for s in rows if _parse_time(s["timestamp"]) < _parse_time(one["toTimestamp"])]
        page = rows[:limit]
        hidden = {f for group, fields in _FIELD_GROUPS.items() if group not in groups for f in fields}
        data = [{k: v for k, v in s.items() if k not in hidden} for s in page if s["id"] not in self.dropped]
        meta: dict[str, Any] = {"limit": limit}
        if len(rows) > limit:
            meta["cursor"] = _cursor(page[-1])
        return 200, {"data": data, "meta": meta}

    def create_scores(self, body: Any) -> tuple[int, Any]:
        received = dt.datetime.now(dt.UTC)
        if not isinstance(body, list):
            return 400, {"message": "body must be a list of scores"}
        errors = []
        for score in body:
            problem = None
            if not isinstance(score, dict) or not score.get("name") or "value" not in score:
                problem = "a score needs name and value"
            elif score.get("source") == "EVAL":
                problem = "source EVAL is not accepted on this endpoint"
            elif (score.get("source") == "ANNOTATION" and not score.get("configId")
                  and score.get("dataType") != "CORRECTION"):
                problem = "ANNOTATION scores need a configId"
            elif sum(bool(score.get(k)) for k in ("traceId", "sessionId", "datasetRunId")) != 1:
                problem = "exactly one of traceId, sessionId, datasetRunId is required"
            elif score.get("traceId") in self.refused_traces:
                problem = self.refused_traces[score["traceId"]]
            elif score.get("timestamp") is not None and not _is_time(score["timestamp"]):
                problem = "timestamp must be an ISO 8601 datetime"
            if problem:
                errors.append({"message": problem})
            else:
                stored = {**score, "id": score.get("id") or str(uuid.uuid4()),
                          "timestamp": score.get("timestamp") or _iso(received)}
                self.created[score_key(stored)] = stored
        if errors:
            return 207, {"accepted": len(body) - len(errors), "rejected": len(errors), "errors": errors}
        return 202, {"message": "Accepted"}


def _handler(state: FakeLangfuse) -> type[BaseHTTPRequestHandler]:
    expected = "Basic " + base64.b64encode(f"{PUBLIC}:{SECRET}".encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            payload = json.dumps(body).encode()
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _authorized(self) -> bool:
            if self.headers.get("Authorization") != expected:
                self._answer(401, {"message": "Invalid credentials"})
                return False
            return True

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            state.requests.append(("GET", self.path))
            if not self._authorized():
                return
            if url.path != "/api/public/v3/scores":
                self._answer(404, {"message": "not found"})
                return
            if not state.v3_enabled:
                self._answer(404, {"message": "Not Found", "error": "LangfuseNotFoundError"})
                return
            status = state.failures.pop(0) if state.failures else None
            if status is not None:
                retry_after = {"Retry-After": state.retry_after} if state.retry_after is not None else {}
                self._answer(status, {"message": HTTPStatus(status).phrase}, retry_after)
                return
            self._answer(*state.list_scores(parse_qs(url.query)))

        def do_POST(self) -> None:  # noqa: N802
            state.requests.append(("POST", self.path))
            if not self._authorized():
                return
            if urlparse(self.path).path != "/api/public/scores":
                self._answer(404, {"message": "not found"})
                return
            length = int(self.headers.get("Content-Length", 0))
            self._answer(*state.create_scores(json.loads(self.rfile.read(length) or b"null")))

        def do_DELETE(self) -> None:  # noqa: N802
            state.requests.append(("DELETE", self.path))
            if not self._authorized():
                return
            prefix = "/api/public/scores/"
            path = urlparse(self.path).path
            if not path.startswith(prefix) or "/" in path[len(prefix):] or path == prefix:
                self._answer(404, {"message": "not found"})
                return
            score_id = unquote(path[len(prefix):])
            state.delete(score_id)
            self._answer(202, {"message": "Score deletion queued successfully"})

        def log_message(self, *args: Any) -> None:
            return  # keep test output clean; requests are recorded in state.requests

    return Handler


@contextmanager
def running(port: int) -> Iterator[tuple[str, FakeLangfuse]]:
    """Serve a fresh `FakeLangfuse` on 127.0.0.1:`port`; yields (base URL, state)."""
    state = FakeLangfuse()
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.shutdown()
        server.server_close()
