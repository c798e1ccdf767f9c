"""Ingest benchmark: spans/s over OTLP/HTTP, end to end, art-collector vs Arize Phoenix.

Both receive the same pre-serialized OTLP/HTTP protobuf exports on this machine in the same
run. The clock starts at the first export and stops when every span is persisted and
queryable: rows counted in the collector's database (SQLite, and PostgreSQL with
`--postgres URL`) and in Phoenix's SQLite file. The collector answers 200 only once a batch is
committed; Phoenix answers first and writes from a queue, so it is polled until its count is
complete.

Realistic spans: per trace a root (`rollout`) span and six children, three of them LLM calls
with ~1 KB of input messages, ~300 B of output and the prompt/completion token ids and
logprobs, three graph-node/tool spans.

    .venv/bin/python bench/ingest.py [--traces 1000] [--traces-per-export 64] [--concurrency 4]
                                     [--postgres postgresql+psycopg://...] [--skip-phoenix]

Phoenix (`arize-phoenix` from PyPI) is installed by this script into `bench/.phoenix-venv`
(gitignored) on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from art_langgraph import semconv as sc  # noqa: E402  (after the path set-up)
from bench.options import database_url, positive_int  # noqa: E402
from examples.stack import free_port  # noqa: E402

PHOENIX_VENV = ROOT / "bench" / ".phoenix-venv"
SPANS_PER_TRACE = 7
_RESOURCE = Resource({"service.name": "bench-agent"})


def _text(rng: random.Random, size: int) -> str:
    words = ["the", "agent", "adds", "numbers", "tool", "result", "answer", "graph", "node", "state", "sum", "reply"]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < size:
        out.append(rng.choice(words))
    return " ".join(out)[:size]


def _context(trace_id: int, rng: random.Random) -> SpanContext:
    """A new sampled span id in trace `trace_id`."""
    return SpanContext(trace_id, rng.getrandbits(64), is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def make_trace(n: int, rng: random.Random) -> list[ReadableSpan]:
    """One trace: a rollout root span and six children (3 LLM calls, 2 graph nodes, 1 tool)."""
    trace_id = rng.getrandbits(128)
    root_context = _context(trace_id, rng)
    start = time.time_ns()
    rollout = f"bench-{n}"
    root = ReadableSpan(
        "rollout", root_context, resource=_RESOURCE, start_time=start, end_time=start + 9_000_000,
        attributes={sc.SPAN_KIND: sc.SPAN_KIND_ROLLOUT, sc.ROLLOUT_ID: rollout, sc.TASK: "bench",
                    sc.GROUP: f"g{n // 4}", sc.GROUP_SIZE: 4, sc.SPLIT: "train"},
        events=[Event(sc.REWARD_EVENT, {sc.REWARD_NAME: "reward", sc.REWARD_VALUE: rng.random()}, start + 8_000_000)],
    )
    children = []
    prompt: list[int] = [rng.randrange(49152) for _ in range(250)]
    for turn in range(3):
        messages = [{"role": "system", "content": _text(rng, 300)}, {"role": "user", "content": _text(rng, 650)}]
        output = [{"role": "assistant", "content": _text(rng, 260)}]
        completion = [rng.randrange(49152) for _ in range(75)]
        t0 = start + (turn + 1) * 2_000_000
        children.append(ReadableSpan(
            "chat agent@0", _context(trace_id, rng), parent=root_context, resource=_RESOURCE,
            start_time=t0, end_time=t0 + 1_000_000,
            attributes={
                sc.SPAN_KIND: sc.SPAN_KIND_LLM, sc.ROLLOUT_ID: rollout, sc.GEN_AI_OPERATION_NAME: "chat",
                sc.GEN_AI_REQUEST_MODEL: "agent@latest", sc.GEN_AI_RESPONSE_MODEL: "agent@0",
                sc.GEN_AI_INPUT_MESSAGES: json.dumps(messages), sc.GEN_AI_OUTPUT_MESSAGES: json.dumps(output),
                sc.GEN_AI_USAGE_INPUT_TOKENS: len(prompt), sc.GEN_AI_USAGE_OUTPUT_TOKENS: len(completion),
                sc.PROMPT_TOKEN_IDS: prompt, sc.COMPLETION_TOKEN_IDS: completion,
                sc.COMPLETION_LOGPROBS: [-rng.random() for _ in completion], sc.POLICY_STEP: 0,
            },
        ))
        prompt = prompt + completion + [rng.randrange(49152) for _ in range(20)]
    for kind, name in ((sc.SPAN_KIND_NODE, "agent"), (sc.SPAN_KIND_TOOL, "add"), (sc.SPAN_KIND_NODE, "tools")):
        t0 = start + 500_000
        children.append(ReadableSpan(
            name, _context(trace_id, rng), parent=root_context, resource=_RESOURCE,
            start_time=t0, end_time=t0 + 300_000,
            attributes={sc.SPAN_KIND: kind, sc.ROLLOUT_ID: rollout, sc.NODE_NAME: name},
        ))
    return [root, *children]


def make_exports(traces: int, per_export: int, seed: int = 0) -> list[bytes]:
    """Serialized OTLP export requests holding `traces` traces, `per_export` per request, encoded by the
    OpenTelemetry SDK's own OTLP encoder (the plugin's exporter)."""
    rng = random.Random(seed)
    return [
        encode_spans(
            [s for n in range(first, min(traces, first + per_export)) for s in make_trace(n, rng)]
        ).SerializeToString()
        for first in range(0, traces, per_export)
    ]


def wait_http(url: str, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f}s; log {log}")


def run(name: str, url: str, bodies: list[bytes], expected: int, count: Callable[[], int], concurrency: int) -> float:
    """Send every export (`concurrency` at a time), then poll `count()` until `expected`; returns spans/s."""
    client = httpx.Client(timeout=120)
    headers = {"Content-Type": "application/x-protobuf"}

    def send(body: bytes) -> None:
        response = client.post(url, content=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"{name}: export answered {response.status_code}: {response.text[:300]}")

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, bodies))
    acked = time.perf_counter() - start
    while (seen := count()) < expected:
        if time.perf_counter() - start > 1800:
            raise RuntimeError(f"{name}: only {seen} of {expected} spans persisted after 30 min")
        time.sleep(0.05)
    elapsed = time.perf_counter() - start
    print(f"{name:<26} {expected / elapsed:10.0f} spans/s  "
          f"({expected} spans in {elapsed:.2f}s; last 200 after {acked:.2f}s)", flush=True)
    return expected / elapsed


def bench_collector(label: str, db: str, bodies: list[bytes], expected: int, concurrency: int, workdir: Path) -> float:
    port = free_port()
    log = workdir / f"collector-{label}.log"
    env = {**os.environ, "ART_HOME": str(workdir)}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-c", "from collector.cli import main; main()", "serve", "--port", str(port), "--db", db,
             "--log-level", "warning"],
            cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env,
        )
    engine = create_engine(db)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process, 60, log)
        with engine.connect() as conn:
            before = conn.execute(text("select count(*) from spans")).scalar_one()

        def count() -> int:
            with engine.connect() as conn:
                return conn.execute(text("select count(*) from spans")).scalar_one() - before

        rate = run(f"art-collector ({label})", f"http://127.0.0.1:{port}/v1/traces", bodies, expected, count,
                   concurrency)
        t0 = time.perf_counter()
        found = httpx.get(f"http://127.0.0.1:{port}/v1/trajectories", params={"task": "bench"}, timeout=600).json()
        print(f"{'':26} queryable: GET /v1/trajectories?task=bench -> {len(found)} assembled in "
              f"{time.perf_counter() - t0:.2f}s")
        return rate
    finally:
        engine.dispose()
        process.terminate()
        process.wait(30)


def phoenix_python() -> Path:
    """The Phoenix venv's interpreter; creates the venv and installs `arize-phoenix` when missing."""
    python = PHOENIX_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(PHOENIX_VENV)], check=True)
    if subprocess.run([str(python), "-c", "import phoenix.server.main"], capture_output=True).returncode != 0:
        print("installing arize-phoenix into bench/.phoenix-venv (first run only)...", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "arize-phoenix"], check=True)
    return python


def bench_phoenix(bodies: list[bytes], expected: int, concurrency: int, workdir: Path) -> float:
    python = phoenix_python()
    version = subprocess.run([str(python), "-c", "import phoenix; print(phoenix.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    port = free_port()
    home = workdir / "phoenix"
    home.mkdir()
    log = workdir / "phoenix.log"
    grpc_port = port + 1
    with log.open("wb") as sink:
        env = {**os.environ, "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(grpc_port),
               "PHOENIX_WORKING_DIR": str(home), "PHOENIX_TELEMETRY_ENABLED": "false"}
        process = subprocess.Popen([str(python), "-m", "phoenix.server.main", "serve"], stdout=sink,
                                   stderr=subprocess.STDOUT, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", process, 180, log)
        database = home / "phoenix.db"

        def count() -> int:
            with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30) as conn:
                return conn.execute("select count(*) from spans").fetchone()[0]

        return run(f"Arize Phoenix {version}", f"http://127.0.0.1:{port}/v1/traces", bodies, expected, count,
                   concurrency)
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=positive_int, default=1000, help="traces to send (7 spans each)")
    parser.add_argument("--traces-per-export", type=positive_int, default=64,
                        help="traces per OTLP export request (64 = 448 spans)")
    parser.add_argument("--concurrency", type=positive_int, default=4, help="exports in flight at once")
    parser.add_argument("--postgres", type=database_url,
                        help="also measure the collector on this PostgreSQL URL (an empty database)")
    parser.add_argument("--skip-phoenix", action="store_true", help="measure only the collector")
    args = parser.parse_args()

    bodies = make_exports(args.traces, args.traces_per_export)
    expected = args.traces * SPANS_PER_TRACE
    size = sum(map(len, bodies))
    print(f"{expected} spans in {len(bodies)} exports ({size / 1e6:.1f} MB protobuf, {size / expected:.0f} B/span), "
          f"{args.concurrency} in flight; {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        workdir = Path(tmp)
        rates = {"sqlite": bench_collector("SQLite", f"sqlite:///{workdir / 'collector.db'}", bodies, expected,
                                           args.concurrency, workdir)}
        if args.postgres:
            rates["postgresql"] = bench_collector("PostgreSQL", args.postgres, bodies, expected, args.concurrency,
                                                  workdir)
        if not args.skip_phoenix:
            phoenix = bench_phoenix(bodies, expected, args.concurrency, workdir)
            for label, rate in rates.items():
                print(f"ratio art-collector ({label}) / Phoenix: {rate / phoenix:.2f}x")


if __name__ == "__main__":
    main()
