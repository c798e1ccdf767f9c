"""A local OTLP/HTTP receiver for export tests: decodes protobuf (gzip), can fail or stall.

It stands in for endpoints that cannot run here (Langfuse's `/api/public/otel/v1/traces`) and
for a collector that is down or slow. It follows the OTLP/HTTP spec: protobuf
`ExportTraceServiceRequest` bodies, answered with an empty `ExportTraceServiceResponse`.
"""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class LocalServer:
    """An HTTP server on a free localhost port, serving on a daemon thread; `url` is its base URL."""

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


class Receiver(LocalServer):
    """Records every request; `fail_next` answers `fail_status` (503) that many times; `delay` stalls each answer;
    `reject` makes each 200 a partial success that reports that many spans rejected."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], ExportTraceServiceRequest]] = []
        self.fail_next = 0
        self.fail_status = 503
        self.failures = 0
        self.delay = 0.0
        self.reject = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(receiver.delay)
                if receiver.fail_next > 0:
                    receiver.fail_next -= 1
                    receiver.failures += 1
                    self.send_response(receiver.fail_status)
                    self.end_headers()
                    return
                headers = {k.lower(): v for k, v in self.headers.items()}
                if headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.requests.append((self.path, headers, ExportTraceServiceRequest.FromString(body)))
                answer = ExportTraceServiceResponse()
                if receiver.reject:
                    answer.partial_success.rejected_spans = receiver.reject
                    answer.partial_success.error_message = f"{receiver.reject} spans rejected: no rollout id"
                payload = answer.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self._serve(Handler)

    def spans(self) -> list:
        """Every span received so far."""
        return [s for _, _, r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]

