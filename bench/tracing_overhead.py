"""Per-call cost of `ARTChatModel` (tracing on) against plain `ChatOpenAI`, same server, same run.

Three clients call the same OpenAI-compatible server (the trainer service) with the same
prompts, interleaved call by call so that server load hits them alike:

* `openai`       — plain `ChatOpenAI`, no tracing;
* `openai+ids`   — `ChatOpenAI` asking for the same extras (`logprobs`, `return_token_ids`),
                   to separate what the engine's extra output costs from what tracing costs;
* `art`          — `ARTChatModel`: extras + token bookkeeping + an `llm` span exported over
                   OTLP/HTTP to the collector (graph node spans too in the agent-step part).

It prints median wall time per call, client CPU per call (this process, all threads, so the
span export thread counts), and the ratios. Aim (issue 4): under 2 ms per call and under 5% of
an agent step.

    PYTHONPATH=. .venv/bin/python bench/tracing_overhead.py                  # starts its own collector + trainer
    PYTHONPATH=. .venv/bin/python bench/tracing_overhead.py --trainer http://127.0.0.1:8000 --collector http://127.0.0.1:4318
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph

import art_langgraph
from art_langgraph import ARTChatModel, chat_node
from bench.options import http_url, positive_int
from examples.stack import running_stack

PROMPTS = [f"Reply with one word about the number {i}." for i in range(16)]


def time_call(call: Callable[[str], Any], prompt: str) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    call(prompt)
    return time.perf_counter() - wall, time.process_time() - cpu


def graph_of(model: Any) -> Any:
    builder = StateGraph(MessagesState)
    builder.add_node("agent", chat_node(model))
    builder.add_edge(START, "agent")
    return builder.compile(name="bench")


def run(clients: dict[str, Callable[[str], Any]], rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """Interleave the clients call by call; return per-client wall and CPU samples."""
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in clients}
    for name, call in clients.items():  # warm-up: connections, caches, the first span pipeline
        call(PROMPTS[0])
    for i in range(rounds):
        prompt = PROMPTS[i % len(PROMPTS)]
        order = list(clients.items())
        if i % 2:
            order.reverse()
        for name, call in order:
            wall, cpu = time_call(call, prompt)
            samples[name][0].append(wall)
            samples[name][1].append(cpu)
    return samples


def report(title: str, samples: dict[str, tuple[list[float], list[float]]], baseline: str) -> None:
    print(f"\n== {title} ({len(next(iter(samples.values()))[0])} calls each, interleaved) ==")
    print(f"{'client':<12} {'median wall ms':>15} {'mean CPU ms':>12}")
    for name, (wall, cpu) in samples.items():
        print(f"{name:<12} {statistics.median(wall) * 1e3:>15.2f} {statistics.fmean(cpu) * 1e3:>12.2f}")
    base_wall = statistics.median(samples[baseline][0])
    base_cpu = statistics.fmean(samples[baseline][1])
    art_wall = statistics.median(samples["art"][0])
    art_cpu = statistics.fmean(samples["art"][1])
    print(
        f"art vs {baseline}: wall {art_wall / base_wall:.3f}x ({(art_wall - base_wall) * 1e3:+.2f} ms), "
        f"client CPU {art_cpu / base_cpu:.2f}x ({(art_cpu - base_cpu) * 1e3:+.2f} ms per call)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", type=http_url,
                        help="trainer service base URL (default: start a collector and a trainer)")
    parser.add_argument("--collector", type=http_url, help="collector base URL, where spans go (with --trainer)")
    parser.add_argument("--model", default="agent@latest", help="model name the chat calls ask for")
    parser.add_argument("--rounds", type=positive_int, default=40, help="calls per variant, interleaved")
    parser.add_argument("--max-tokens", type=positive_int, default=8, help="completion tokens per call")
    args = parser.parse_args()
    if (args.trainer is None) != (args.collector is None):
        parser.error("give both --trainer and --collector, or neither (then both are started here)")
    if args.trainer is not None:
        measure(args)
        return
    with tempfile.TemporaryDirectory(prefix="tracing-bench-") as tmp, running_stack(Path(tmp)) as (collector, trainer):
        args.trainer, args.collector = trainer.url, collector.url
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """Time the three clients on single calls, then the two on agent steps."""
    art_langgraph.configure(collector_url=args.collector, trainer_url=f"{args.trainer}/v1", model=args.model)
    common: dict[str, Any] = {
        "model": args.model,
        "base_url": f"{args.trainer}/v1",
        "api_key": "EMPTY",
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "max_retries": 0,
    }
    plain = ChatOpenAI(**common)
    extras = ChatOpenAI(**common, logprobs=True, extra_body={"return_token_ids": True})
    art = ARTChatModel(**common)

    calls = {
        "openai": lambda p: plain.invoke([HumanMessage(p)]),
        "openai+ids": lambda p: extras.invoke([HumanMessage(p)]),
        "art": lambda p: art.invoke([HumanMessage(p)]),
    }
    report("model call", run(calls, args.rounds), "openai+ids")

    graphs = {"openai+ids": graph_of(extras), "art": graph_of(art)}  # the node asks for the same extras as art
    steps = {name: (lambda p, g=g: g.invoke({"messages": [HumanMessage(p)]})) for name, g in graphs.items()}
    report("agent step (one-node graph; art adds node + rollout spans)", run(steps, args.rounds), "openai+ids")
    dropped = art_langgraph.dropped_spans()
    ok = art_langgraph.flush(timeout=10)
    print(f"\nspans flushed: {ok}; dropped: {dropped}")


if __name__ == "__main__":
    main()
