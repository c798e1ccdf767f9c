"""2,000 concurrent chat requests from one client through the trainer's OpenAI endpoint.

One `httpx.AsyncClient` opens every request at once (no client-side queue); the trainer's
proxy queues them towards vLLM. The same requests are then sent straight to the vLLM engine
behind it, in the same run, so the ratio shows what the proxy costs. Printed: failures,
wall time, requests/s and latency percentiles for each, and the ratios.

    PYTHONPATH=. .venv/bin/python bench/serve_load.py            # starts its own trainer (ports 28110-28111)
    PYTHONPATH=. .venv/bin/python bench/serve_load.py --trainer http://127.0.0.1:28000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.options import http_url, positive_int
from examples.stack import start_service


async def load(url: str, model: str, requests: int, max_tokens: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=requests, max_keepalive_connections=requests)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        async def one(index: int) -> tuple[float, int]:
            started = time.perf_counter()
            try:
                response = await client.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": max_tokens, "temperature": 0.0,
                    "messages": [{"role": "user", "content": f"Say the number {index}."}]})
                status = response.status_code
            except httpx.HTTPError:
                status = 0
            return time.perf_counter() - started, status

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - started
    latencies = sorted(latency for latency, status in results if status == 200)
    failed = sum(1 for _, status in results if status != 200)

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return {"failed": failed, "wall_s": wall, "rps": (requests - failed) / wall, "p50": pct(0.50),
            "p90": pct(0.90), "p99": pct(0.99), "max": latencies[-1] if latencies else float("nan"),
            "mean": statistics.fmean(latencies) if latencies else float("nan")}


@contextmanager
def trainer(url: str | None, workdir: Path) -> Iterator[str]:
    if url is not None:
        yield url
        return
    service = start_service(
        "art-trainer",
        ["--port", "28110", "--vllm-port", "28111", "--collector", "http://127.0.0.1:28112",
         "--output-dir", str(workdir / "run"), "--kv-cache-gib", "2", "--wandb", "off"],
        "http://127.0.0.1:28110/health", "http://127.0.0.1:28110", workdir / "trainer.log", timeout=900,
    )
    try:
        yield service.url
    finally:
        service.stop()


def report(name: str, r: dict[str, float]) -> None:
    print(f"{name:22s} failed {r['failed']:.0f} | wall {r['wall_s']:.1f} s | {r['rps']:.1f} req/s | latency "
          f"p50 {r['p50']:.1f} s, p90 {r['p90']:.1f} s, p99 {r['p99']:.1f} s, max {r['max']:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", type=http_url,
                        help="a running art-trainer (default: start one on ports 28110-28111)")
    parser.add_argument("--requests", type=positive_int, default=2000, help="chat requests, all sent at once")
    parser.add_argument("--max-tokens", type=positive_int, default=4, help="completion tokens per request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp, trainer(args.trainer, Path(tmp)) as url:
        status = httpx.get(f"{url}/v1/status", timeout=30).raise_for_status().json()
        engine_url, name = status["engine"]["url"], f"{status['name']}@latest"
        asyncio.run(load(url, name, 8, args.max_tokens))  # warm-up
        print(f"{args.requests} concurrent chat requests, max_tokens={args.max_tokens}, model {name} "
              f"(= {status['latest_model']})")
        proxied = asyncio.run(load(url, name, args.requests, args.max_tokens))
        report("through art-trainer", proxied)
        direct = asyncio.run(load(engine_url, status["latest_model"], args.requests, args.max_tokens))
        report("straight to vLLM", direct)
        print(f"ratio art-trainer / vLLM: throughput {proxied['rps'] / direct['rps']:.2f}x, "
              f"p50 latency {proxied['p50'] / direct['p50']:.2f}x, p99 latency {proxied['p99'] / direct['p99']:.2f}x")
        if proxied["failed"]:
            raise SystemExit(f"{proxied['failed']:.0f} requests failed through the trainer")


if __name__ == "__main__":
    main()
