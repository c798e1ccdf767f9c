"""The promotion gate's evaluation: sample answers to eval prompts from a served model and score them.

Eval prompts come from a JSONL file (`{"messages": [...], ...}` a line; the other keys reach
the reward function) or from the collector's trajectories of one split (their conversation up
to the last assistant message). The reward is a user function `module:function(row,
completion) -> float`, called in a worker thread, one call at a time, so a slow one does not hold up the
service's event loop (its proxy and status). Answers are sampled from vLLM with a fixed seed per prompt, so two
checkpoints are compared on the same prompts with the same sampling noise; rewards compare only
when measured on the same prompts with the same reward function and sampling (`Evaluator.key`). A shutdown gives an
evaluation up after a grace (`Evaluator.stop`): a vLLM that accepts and never answers held it for the client's timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import json
import logging
import math
import numbers
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy

from collector.protocol import Trajectory
from trainer_service.config import TrainerSettings

__all__ = ["EvalError", "Evaluator", "RewardFn", "build_evaluator", "load_eval_file", "load_reward_fn",
           "prompts_from_trajectories"]

logger = logging.getLogger(__name__)

RewardFn = Callable[[dict[str, Any], str], float]
"""`(row, completion_text) -> reward`: `row` is the eval line (with `messages`)."""

_ENGINE_TIMEOUT_S = 600.0
"""Seconds one eval request may wait for the engine's answer (all of a prompt's samples)."""
_STOP_CHECK_S = 0.1
"""Seconds between two looks at `Evaluator.stop`'s end while an evaluation waits for the engine."""


class EvalError(RuntimeError):
    """The eval set, the reward function or the sampling failed."""


def load_reward_fn(spec: str) -> RewardFn:
    """Import `module:function`.

    Raises:
        EvalError: the module or attribute does not exist (or the module name is empty or relative, or the module
            is no valid Python, or its code raised as it was imported), or is not callable, or is an `async def`
            (its coroutine is no reward), or cannot be called with two arguments `(row, completion)`.
    """
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    # ValueError, TypeError: `:f`, `.mod:f`; SyntaxError: a module that is no valid Python (was a traceback)
    except (ImportError, AttributeError, ValueError, TypeError, SyntaxError) as exc:
        raise EvalError(f"eval reward {spec!r} cannot be imported: {exc}. Give `module:function` on the "
                        "Python path of the trainer.") from exc
    except Exception as exc:  # the module's own code failed as it was imported, e.g. on a missing environment variable
        frames = traceback.extract_tb(exc.__traceback__)
        # the module's own line that raised or led to it (not importlib's, not the innermost library frame)
        frame = next((f for f in frames[1:] if "importlib" not in f.filename), frames[-1])
        raise EvalError(f"eval reward {spec!r}: importing its module raised {type(exc).__name__}: {exc} "
                        f"({frame.filename}:{frame.lineno})") from exc
    if not callable(fn):
        raise EvalError(f"eval reward {spec!r} is not callable")
    if inspect.iscoroutinefunction(fn):
        raise EvalError(f"eval reward {spec!r} is an async function; give a plain `def function(row, completion) "
                        "-> float`.")
    try:
        inspect.signature(fn).bind({}, "")
    except TypeError as exc:  # every eval then failed with "the eval reward function raised TypeError"
        raise EvalError(f"eval reward {spec!r} cannot be called as function(row, completion): {exc}") from exc
    except ValueError:  # no signature to read (some builtins): checked when it is called
        pass
    return fn  # type: ignore[no-any-return]


def load_eval_file(path: Path) -> list[dict[str, Any]]:
    """Read a JSONL eval set (UTF-8, a byte order mark allowed); every line needs a non-empty `messages` list of
    objects with a `role`. Lines end at a line feed only (`str.splitlines` also split at U+2028 or U+0085, which
    JSON strings may hold).

    Raises:
        EvalError: the file is missing or not UTF-8, a line is not JSON, or lacks `messages` of chat messages, or
            holds what cannot be sent to the engine as JSON (NaN, Infinity, a lone UTF-16 surrogate).
    """
    try:
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"eval file {path} cannot be read: {exc}") from exc
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        # ValueError: also an int of more than 4300 digits; RecursionError: nesting too deep (both were a traceback)
        except (ValueError, RecursionError) as exc:
            raise EvalError(f"{path}:{number} is not JSON: {exc}") from exc
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise EvalError(f"{path}:{number} needs a non-empty `messages` list of chat messages (objects with a "
                            "`role`)")
        try:
            _check_sendable(row)
        except ValueError as exc:
            raise EvalError(f"{path}:{number} cannot be sent to the engine as JSON: {exc}") from exc
        rows.append(row)
    if not rows:
        raise EvalError(f"eval file {path} has no prompts")
    return rows


def _check_sendable(row: dict[str, Any]) -> None:
    """Check that `row` can be encoded as httpx encodes a JSON body (no NaN or Infinity, UTF-8).

    Raises:
        ValueError: it holds a NaN or an infinity, or a lone UTF-16 surrogate (`UnicodeEncodeError`).
    """
    json.dumps(row, ensure_ascii=False, allow_nan=False).encode("utf-8")


def prompts_from_trajectories(trajectories: list[Trajectory]) -> list[dict[str, Any]]:
    """Eval rows from trajectories: each conversation up to (not including) its last assistant message."""
    rows = []
    for t in trajectories:
        messages = list(t.messages)
        while messages and messages[-1].get("role") == "assistant":
            messages.pop()
        if messages:
            rows.append({"messages": messages, "tools": t.tools, "task": t.task, "metadata": t.metadata,
                         "trajectory_id": t.id})
    return rows


class Evaluator:
    """Mean reward of a served model on the eval prompts.

    Args:
        rows: async callable returning the eval rows (read each evaluation, so a split grows).
        reward_fn: scores one answer.
        engine_url: base address of the vLLM engine.
        samples: answers per prompt.
        max_prompts: most prompts used.
        max_tokens: max_tokens per answer.
        temperature: sampling temperature.
        transport: httpx transport (tests).
    """

    def __init__(self, rows: Callable[[], Awaitable[list[dict[str, Any]]]], reward_fn: RewardFn, engine_url: str, *,
                 samples: int = 4, max_prompts: int = 32, max_tokens: int = 64, temperature: float = 1.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._rows = rows
        self.reward_fn = reward_fn
        self.samples = samples
        self.max_prompts = max_prompts
        self.max_tokens = max_tokens
        self.temperature = temperature
        self._client = httpx.AsyncClient(base_url=engine_url, timeout=_ENGINE_TIMEOUT_S, transport=transport)
        self._reward_lock = asyncio.Lock()
        """Held while the reward function runs in its worker thread: a user function need not be thread-safe."""
        self._stops_at: float | None = None
        """When evaluations are given up (`time.monotonic`), once `stop` was called."""

    def stop(self, grace: float) -> None:
        """Give evaluations up `grace` seconds from now (a shutdown: `TrainerService.begin_shutdown`): one not done
        then raises `EvalError`, its requests cancelled, and a later one raises it at once, asking the engine nothing.
        A second call keeps the earlier end."""
        ends = time.monotonic() + grace
        self._stops_at = ends if self._stops_at is None else min(self._stops_at, ends)

    async def prompts(self) -> list[dict[str, Any]]:
        """The eval prompts as of now, at most `max_prompts` (a collector split grows between calls).

        Raises:
            EvalError: there are none yet, or their source failed.
        """
        rows = (await self._rows())[: self.max_prompts]
        if not rows:
            raise EvalError("the eval set has no prompts yet (for a collector split: record rollouts with that split)")
        return rows

    async def evaluate(self, model: str, rows: list[dict[str, Any]] | None = None) -> float:
        """Sample `samples` answers per prompt of `rows` (default: `prompts()`) from `model`; the mean reward.

        Raises:
            EvalError: no prompts, a prompt JSON cannot carry (NaN, a lone surrogate), the engine failed or
                answered something other than a chat completion, or the reward function raised or returned no
                finite number (prompt and model named), or `stop`'s grace ended first; the other prompts' requests
                are cancelled.
        """
        rows = await self.prompts() if rows is None else rows
        self._check_not_stopped(model)
        started = time.perf_counter()
        logger.info("eval of %s: %d prompts x %d samples", model, len(rows), self.samples)
        progress = _Progress(model, len(rows), started)
        tasks = [asyncio.ensure_future(self._score(model, index, row, progress)) for index, row in enumerate(rows)]
        try:
            rewards = await self._all_scored(model, tasks)
        except BaseException:  # one prompt failed: the others stop, not left running past the gate's decision
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        mean = _mean([r for per_row in rewards for r in per_row])
        logger.info("eval of %s: mean reward %.4f on %d prompts x %d samples in %.1f s", model, mean, len(rows),
                    self.samples, time.perf_counter() - started)
        return mean

    async def _all_scored(self, model: str, tasks: list[asyncio.Future[list[float]]]) -> list[list[float]]:
        """The rewards of each prompt's task, in order, once every one is done (waited for in `_STOP_CHECK_S` slices).

        Raises:
            EvalError: `stop`'s grace ended first. Any error of a task, the first seen.
        """
        pending: set[asyncio.Future[list[float]]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=_STOP_CHECK_S, return_when=asyncio.FIRST_EXCEPTION)
            failure = next((task.exception() for task in done if task.exception() is not None), None)
            if failure is not None:
                raise failure
            if pending:
                self._check_not_stopped(model)
        return [task.result() for task in tasks]

    def _check_not_stopped(self, model: str) -> None:
        """Raise `EvalError` once `stop`'s grace ended."""
        if self._stops_at is not None and time.monotonic() >= self._stops_at:
            raise EvalError(f"the eval of {model} was given up: the service is shutting down, and the engine had not "
                            "answered every eval prompt within the shutdown's grace")

    def key(self, rows: list[dict[str, Any]]) -> str:
        """A short fingerprint of `rows` and of how they are scored (reward function, samples, max_tokens,
        temperature): mean rewards measured with the same key compare.

        Raises:
            EvalError: a prompt is nested too deep to encode as JSON from here (`RecursionError`).
        """
        fn = self.reward_fn
        scoring = [f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', repr(fn))}", self.samples,
                   self.max_tokens, self.temperature]
        try:
            text = json.dumps([rows, scoring], sort_keys=True, default=str)
        except RecursionError as exc:
            raise EvalError(f"a prompt of the eval set cannot be encoded as JSON: {exc}") from exc
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    async def _score(self, model: str, index: int, row: dict[str, Any], progress: _Progress) -> list[float]:
        body: dict[str, Any] = {"model": model, "messages": row["messages"], "n": self.samples,
                                "max_tokens": self.max_tokens, "temperature": self.temperature, "seed": index}
        if row.get("tools"):
            body["tools"] = row["tools"]
        try:
            response = await self._client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            # httpx's timeouts carry no message: the reason ended in ": " (`_no_answer`)
            raise EvalError(f"the engine did not answer an eval prompt for {model}: {_no_answer(exc)}") from exc
        # a collector row with a NaN or a lone surrogate, which httpx cannot encode (a 500), or one nested too deep
        # to encode from here (RecursionError; `load_eval_file` checks its rows with a shallower stack)
        except (ValueError, RecursionError) as exc:
            raise EvalError(f"prompt {index} of the eval set cannot be sent to the engine as JSON: {exc}") from exc
        if response.status_code != 200:
            raise EvalError(f"the engine refused an eval prompt for {model}: HTTP {response.status_code}: "
                            f"{response.text[:300]}")
        try:
            texts = [choice["message"].get("content") or "" for choice in response.json()["choices"]]
        except (ValueError, LookupError, TypeError, AttributeError) as exc:  # not JSON, or not shaped like one
            raise EvalError(f"the engine's answer to an eval prompt for {model} is not a chat completion "
                            f"({type(exc).__name__}: {exc}): {response.text[:300]}") from exc
        if not texts:  # the mean reward would divide by zero
            raise EvalError(f"the engine answered an eval prompt for {model} without choices: {response.text[:300]}")
        async with self._reward_lock:
            rewards = await asyncio.to_thread(self._rewards, model, index, row, texts)
        progress.done()
        return rewards

    def _rewards(self, model: str, index: int, row: dict[str, Any], texts: list[str]) -> list[float]:
        """The rewards of `texts`, the answers of `model` to prompt `index` (`row`), in the calling (worker) thread."""
        return [self._reward(model, index, row, text) for text in texts]

    def _reward(self, model: str, index: int, row: dict[str, Any], text: str) -> float:
        """The reward function's value for one answer of `model` to prompt `index` (`row`).

        Raises:
            EvalError: it raised (logged with its traceback and the row; a `CancelledError` or `GeneratorExit`
                too: called in a worker thread, it is the function's own), or returned no finite real number (a
                `bool`, also numpy's, counts as 1 or 0).
        """
        where = f"prompt {index} of the eval set, answered by {model}"
        try:
            value = self.reward_fn(row, text)
        # a user function: any failure is reported with its type, logged with its traceback; also a SystemExit (e.g.
        # argparse's) or KeyboardInterrupt, its own here in a worker thread, which was raised again in the event loop
        # and stopped the service; and a CancelledError or GeneratorExit, which escaped the gate (as a cancellation
        # or a RuntimeError). None of them is the step's cancellation: this runs in a worker thread, where no
        # cancellation of the event loop's tasks arrives (it reaches `_score`'s await and propagates from there)
        except (Exception, SystemExit, KeyboardInterrupt, asyncio.CancelledError, GeneratorExit) as exc:
            row_text = json.dumps(row, default=str)
            logger.exception("the eval reward function raised on %s; the row: %.300s", where, row_text)
            raise EvalError(f"the eval reward function raised {type(exc).__name__} on {where}: {exc}") from exc
        # `float()` took "0.9" as a reward and called "abc" or None a raise; numpy's ints and floats are
        # `numbers.Real`, its bool is not
        if not isinstance(value, numbers.Real | numpy.bool_):
            raise EvalError(f"the eval reward function returned {value!r} ({type(value).__name__}) on {where}; "
                            "return a float")
        try:
            reward = float(value)
        except OverflowError as exc:  # an int beyond a float's range (printing it may fail too: past 4300 digits)
            raise EvalError(f"the eval reward function returned a number too large for a float "
                            f"({type(value).__name__}) on {where}; rewards must be finite") from exc
        if not math.isfinite(reward):
            raise EvalError(f"the eval reward function returned {value} on {where}; rewards must be finite")
        return reward

    async def aclose(self) -> None:
        """Close the engine client."""
        await self._client.aclose()


def _no_answer(error: httpx.HTTPError) -> str:
    """Why an eval request got no answer, as `ReadTimeout: no answer within 600 s`."""
    if isinstance(error, httpx.TimeoutException):
        return f"{type(error).__name__}: no answer within {_ENGINE_TIMEOUT_S:g} s"
    return f"{type(error).__name__}: {error}"


def _mean(rewards: list[float]) -> float:
    """The mean of finite `rewards`, finite also where their sum is not (each is divided first then, and the sum of
    those kept within the rewards' range, which its rounding could pass: 4 rewards of 1e308, or 3 of the largest
    float, had the mean `inf`, which `promotion.json` cannot hold)."""
    total = sum(rewards)
    if math.isfinite(total):
        return total / len(rewards)
    return min(max(sum(r / len(rewards) for r in rewards), min(rewards)), max(rewards))


class _Progress:
    """Logs how many prompts of an eval are scored, at each quarter of them (the last is the eval's own line)."""

    def __init__(self, model: str, total: int, started: float) -> None:
        self._model = model
        self._total = total
        self._started = started
        self._every = math.ceil(total / 4)
        self._scored = 0

    def done(self) -> None:
        """Count one scored prompt."""
        self._scored += 1
        if self._scored % self._every == 0 and self._scored < self._total:
            logger.info("eval of %s: %d of %d prompts scored in %.1f s", self._model, self._scored, self._total,
                        time.perf_counter() - self._started)


def build_evaluator(settings: TrainerSettings, collector: httpx.AsyncClient, engine_url: str) -> Evaluator | None:
    """The promotion gate's evaluator from the settings; None when no eval set is configured.

    Raises:
        EvalError: the eval file or the reward function cannot be loaded.
    """
    if settings.eval_reward is None:
        return None
    reward_fn = load_reward_fn(settings.eval_reward)
    if settings.eval_file is not None:
        rows = load_eval_file(settings.eval_file)

        async def source() -> list[dict[str, Any]]:
            return rows
    else:
        split = settings.eval_split

        async def source() -> list[dict[str, Any]]:
            try:
                response = await collector.get("/v1/trajectories", params={"split": split})
            except httpx.HTTPError as exc:
                raise EvalError(f"the collector did not answer for the eval split {split!r}: {exc}") from exc
            if response.status_code != 200:
                raise EvalError(f"the collector refused the eval split {split!r}: HTTP {response.status_code}: "
                                f"{response.text[:300]}")
            try:
                return prompts_from_trajectories([Trajectory.model_validate(t) for t in response.json()])
            # not JSON (or nested too deep to read), not a list, or rows that are not trajectories
            except (ValueError, TypeError, RecursionError) as exc:
                raise EvalError(f"the collector's trajectories of the eval split {split!r} are malformed "
                                f"({type(exc).__name__}: {exc})") from exc
    return Evaluator(source, reward_fn, engine_url, samples=settings.eval_samples,
                     max_prompts=settings.eval_max_prompts, max_tokens=settings.eval_max_tokens,
                     temperature=settings.eval_temperature)
