"""One place every step's metrics go: `metrics.jsonl`, the status endpoint, a PNG plot and W&B.

`MetricsSink.emit` is the only writer. The JSONL line is written first (it is the record): one a
full disk refuses is kept and written, before the new one, by the next `emit` (or by `close`). The
plot and Weights & Biases follow, and a failure there is logged with its traceback and counted
(`sink_errors`), never raised into the training step. The plot is drawn in a thread of its own (`_Redraw`), so a
step does not wait for a drawing (most of a second at thousands of steps), at most once every `_PLOT_INTERVAL_S`, so
that drawing, which holds the GIL, does not slow steps that follow each other quickly; `flush` and `close` have the
last state drawn at once and wait for it. W&B is used when the `wandb` package is installed and not turned off; it
runs offline unless `WANDB_MODE` says otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CHECKPOINT_METRICS", "KL_METRICS", "LOSS_METRICS", "MetricsSink", "PLOT_FILE", "is_checkpoint_metric"]

logger = logging.getLogger(__name__)

PLOT_FILE = "metrics.png"
"""Name of the reward/loss plot in the run folder."""
CHECKPOINT_METRICS = frozenset({
    "step", "grad/norm", "optim/lr", "time/step_s", "time/tokens_per_s", "reward/mean", "reward/std",
    "reward/chosen_mean", "advantage/mean", "advantage/std", "advantage/min", "advantage/max", "data/sequences",
    "data/tokens", "data/assistant_tokens", "data/groups", "data/groups_trained", "data/trajectories",
    "data/truncated_sequences", "data/missing_logprobs", "data/retokenized_trajectories", "data/retokenize_split_edges",
    "data/retokenize_non_object_arguments", "loss/policy", "loss/clip_fraction", "loss/ratio_mean", "loss/logprob_gap",
    "loss/kl", "loss/total", "loss/sft", "kind/sft",
})
"""The metrics of `LoRATrainer.train`, which a checkpoint's manifest records (some only on GRPO or SFT steps, with
`--kl-coef` > 0 or engine log-probs), besides `data/skipped/<reason>`: what retention can rank checkpoints by
(`TrainerSettings.keep_best_metric`). The service adds `time/publish_s`, `time/workers_s`, `eval/reward`,
`promotion/promoted` and `collector/ack_failed` once the checkpoint is written; retention reads `eval/reward` from
the promotion gate."""
LOSS_METRICS = frozenset({"loss/policy", "loss/kl", "loss/total", "loss/sft"})
"""The `CHECKPOINT_METRICS` that are losses: best at their smallest (`TrainerSettings.keep_best_mode`'s default)."""
KL_METRICS = frozenset({"loss/kl", "loss/total"})
"""The `CHECKPOINT_METRICS` a GRPO step records only with a KL penalty (`GRPOConfig.kl_coef` > 0)."""
_SKIPPED = "data/skipped/"
"""Prefix of the counts of what a step left out (`batching`), one metric per reason."""
_PLOT_WAIT_S = 60.0
"""Longest `close` waits for the plot of the last steps (a drawing takes well under a second)."""
_PLOT_INTERVAL_S = 5.0
"""Shortest time from the end of one drawing to the start of the next, unless someone waits for it (`flush`): a
drawing of 5,000 steps holds the GIL for 0.2 to 0.7 s, and one per step made 300 quick steps (the test model's) 5 to 9
times slower on 2 cores."""
_PLOTTED = (("reward/mean", "reward (mean)"), ("loss/policy", "policy loss"), ("loss/sft", "SFT loss"),
            ("eval/reward", "eval reward"))


def _finite_or_null(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with NaN and ±inf as None: JSON has no such numbers, so the JSONL line says `null` instead (and a
    line written before, which says `NaN`, reads back as `null` would); its other values as they are."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}


def _plottable(value: object) -> bool:
    """True for a number of the plot, or None (a gap: a NaN or infinite metric); not for a value a hand-edited
    `metrics.jsonl` line may hold instead (a string, a list, a boolean), on which every plot failed."""
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def is_checkpoint_metric(name: str) -> bool:
    """True when a checkpoint's manifest can record metric `name`: one of `CHECKPOINT_METRICS`, or
    `data/skipped/<reason>`."""
    return name in CHECKPOINT_METRICS or (name.startswith(_SKIPPED) and name != _SKIPPED)


class _Redraw:
    """Calls `draw` in a thread of its own each time it is asked, the caller never waiting: the requests made while it
    draws or less than `interval_s` after a drawing ended are one more drawing once that time has passed, however
    many were made (it draws the state as of then); at once while someone waits (`wait`). `draw` must not raise.
    The thread ends when nothing is asked, so an idle sink holds none."""

    def __init__(self, draw: Callable[[], None], interval_s: float) -> None:
        self._draw = draw
        self._interval_s = interval_s
        self._state = threading.Condition()
        self._asked = False
        self._running = False
        self._waiting = 0
        self._drawn_at = -math.inf
        """`time.monotonic()` when the last drawing ended."""

    def request(self) -> None:
        """Ask for a drawing of the state as of now."""
        with self._state:
            self._asked = True
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="metrics-plot", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Have every drawing asked for done, without waiting out `interval_s`, and wait for it; False when `timeout`
        seconds passed first."""
        with self._state:
            self._waiting += 1
            self._state.notify_all()  # a drawing held back is drawn now
            try:
                return self._state.wait_for(lambda: not self._running, timeout)
            finally:
                self._waiting -= 1

    def _run(self) -> None:
        while True:
            with self._state:
                if not self._asked:
                    self._running = False
                    self._state.notify_all()
                    return
                due = self._drawn_at + self._interval_s
                self._state.wait_for(lambda: self._waiting > 0 or time.monotonic() >= due,
                                     max(0.0, due - time.monotonic()))
                self._asked = False
            self._draw()
            with self._state:
                self._drawn_at = time.monotonic()


class MetricsSink:
    """Writes step metrics to every sink.

    Args:
        run_dir: the run folder (`metrics.jsonl`, `metrics.png`, `wandb/`).
        wandb: `auto` (use it when installed) or `off`.
        project: W&B project.
        run_name: W&B run name (the model name).
        config: recorded as the W&B run config.
    """

    def __init__(self, run_dir: Path, *, wandb: str = "auto", project: str = "art-langgraph", run_name: str = "agent",
                 config: dict[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.history: list[dict[str, Any]] = self._read_history()
        self._plot_errors = 0
        """Failed drawings, counted by the plot's thread only (`_draw`)."""
        self._wandb_errors = 0
        self._redraw = _Redraw(self._draw, _PLOT_INTERVAL_S)
        self._unwritten: list[tuple[int, str]] = []
        """(step, JSONL line) of the records of `history` not yet in `metrics.jsonl` (a write failed), oldest first."""
        self._wandb_wanted = wandb == "auto" and importlib.util.find_spec("wandb") is not None
        self._wandb_run: Any = None
        self._project = project
        self._run_name = run_name
        self._config = config or {}

    @property
    def jsonl_path(self) -> Path:
        """`run_dir/metrics.jsonl`."""
        return self.run_dir / "metrics.jsonl"

    @property
    def sink_errors(self) -> int:
        """Failures of the plot and of W&B since the start (logged with their tracebacks)."""
        return self._plot_errors + self._wandb_errors

    @property
    def wandb_enabled(self) -> bool:
        """True when metrics also go to Weights & Biases."""
        return self._wandb_wanted

    @property
    def last(self) -> dict[str, float]:
        """Numeric metrics of the latest emitted step (empty before the first)."""
        if not self.history:
            return {}
        return {k: float(v) for k, v in self.history[-1].items() if isinstance(v, int | float) and k != "time"}

    def _read_history(self) -> list[dict[str, Any]]:
        """The records of `metrics.jsonl`; a line that is not a JSON object with an integer `step` (cut short by a full
        disk, or edited, also to bytes that are not UTF-8) is skipped: the plot places each record at its step. A whole
        float `step` (`1.0`, as lines were written before) is read as that integer, a `NaN` or `Infinity` (written
        before they became `null`) as None."""
        if not self.jsonl_path.is_file():
            return []
        history, skipped = [], 0
        for line in self.jsonl_path.read_bytes().splitlines():  # bytes: one line that is not UTF-8 is one skipped
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, float) and step.is_integer():  # as `emit` wrote the trainer's float step before
                record["step"] = step = int(step)
            if isinstance(step, int) and not isinstance(step, bool):
                history.append(_finite_or_null(record))  # as `emit` records it: a `NaN` of older lines is None
            else:
                skipped += 1
        if skipped:
            logger.warning("%s: skipped %d line(s) that are not JSON objects with a `step` (a write cut short, or "
                           "edited?)", self.jsonl_path, skipped)
        return history

    def _ends_mid_line(self) -> bool:
        """True when `metrics.jsonl` ends without a newline (a write cut short): the next record needs its own line."""
        try:
            with self.jsonl_path.open("rb") as handle:
                if handle.seek(0, os.SEEK_END) == 0:
                    return False
                handle.seek(-1, os.SEEK_END)
                return handle.read(1) != b"\n"
        except FileNotFoundError:
            return False

    def emit(self, step: int, metrics: dict[str, float], **extra: Any) -> None:
        """Record one step: JSONL line, status history, plot (asked for here, drawn in its own thread: `flush`), W&B.
        A NaN or infinite metric is `null` in the JSONL line and the history (JSON has no such numbers; `last` leaves
        it out), and goes to W&B as it is.

        Args:
            step: policy step.
            metrics: slash-keyed numbers.
            extra: non-numeric fields for the JSONL line (batch id, model name, kind).

        Raises:
            OSError: the JSONL line could not be written (the disk is full or read-only); it is kept, in the
                history too, and written by the next `emit` or `close`. The other sinks have the step.
        """
        recorded = _finite_or_null(metrics)
        if nonfinite := sorted(key for key, value in recorded.items() if value is None):
            logger.warning("step %s: metrics %s are not finite numbers (%s); recorded as null", step,
                           ", ".join(nonfinite), ", ".join(str(metrics[key]) for key in nonfinite))
        line = {"step": step, "time": time.time(), **extra, **recorded}
        line["step"] = step  # the trainer's metrics carry it as a float; the record's is the integer `step`
        self.history.append(line)
        self._unwritten.append((step, json.dumps(line)))
        try:
            self._write_unwritten()
        finally:  # the plot and W&B have the step also when its line must wait for room on the disk
            self._redraw.request()
            try:
                self._wandb(step, metrics)
            except Exception:  # a secondary sink never fails the step; logged and counted
                self._wandb_errors += 1
                logger.exception("metrics sink W&B failed at step %s", step)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until `metrics.png` shows every emitted step (or its drawing failed, counted in `sink_errors`).

        Returns:
            False when `timeout` seconds passed first.
        """
        return self._redraw.wait(timeout)

    def _write_unwritten(self) -> None:
        """Append the lines of `_unwritten` to `metrics.jsonl`, one at a time, each dropped from it once written.

        Raises:
            OSError: a line could not be written; it and those after it stay in `_unwritten`, and the message
                names the file and their steps.
        """
        if not self._unwritten:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            while self._unwritten:
                start = "\n" if self._ends_mid_line() else ""  # after a line a full disk cut short
                with self.jsonl_path.open("a") as handle:
                    handle.write(start + self._unwritten[0][1] + "\n")
                self._unwritten.pop(0)
        except OSError as exc:
            held = f"the record of step {self._unwritten[0][0]} is" if len(self._unwritten) == 1 else \
                f"the records of steps {', '.join(str(step) for step, _ in self._unwritten)} are"
            raise OSError(exc.errno, f"{self.jsonl_path} could not be written ({exc.strerror or exc}): {held} kept "
                          "and written with the next step; free disk space") from exc

    def _draw(self) -> None:
        """Plot the history as of now (in `_Redraw`'s thread); a failure is logged and counted, never raised."""
        history = list(self.history)  # `emit` appends to it meanwhile
        try:
            self._plot(history)
        except Exception:  # a secondary sink never fails the step; logged and counted
            self._plot_errors += 1
            logger.exception("metrics sink plot failed at step %s", history[-1]["step"] if history else None)

    def _plot(self, history: list[dict[str, Any]]) -> None:
        """Draw `history` to `metrics.png` (a `Figure` of its own, not pyplot's shared state: another thread may
        plot meanwhile)."""
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        series = [(key, label) for key, label in _PLOTTED if any(key in h for h in history)]
        if not series:
            return
        figure = Figure(figsize=(6, 2.2 * len(series)))
        axes = figure.subplots(len(series), 1, sharex=True, squeeze=False)
        for axis, (key, label) in zip(axes[:, 0], series, strict=True):
            points = [(h["step"], h[key]) for h in history if key in h and _plottable(h[key])]
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # no tick at 1.5
        figure.suptitle(f"{self._run_name}: step {history[-1]['step']}")
        figure.tight_layout()
        tmp = self.run_dir / f".{PLOT_FILE}.tmp.png"
        try:
            figure.savefig(tmp, dpi=80)
            os.replace(tmp, self.run_dir / PLOT_FILE)
        except OSError:  # a full disk: the partial file goes, not to hold the space until the next plot
            tmp.unlink(missing_ok=True)
            raise

    def _wandb(self, step: int, metrics: dict[str, float]) -> None:
        if not self._wandb_wanted:
            return
        import wandb

        if self._wandb_run is None:
            self._wandb_run = wandb.init(
                project=self._project, name=self._run_name, dir=str(self.run_dir), config=self._config,
                mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new",
            )
        self._wandb_run.log(metrics, step=step)

    def close(self) -> None:
        """Write the JSONL lines a full disk held back (logged when it still cannot), wait (at most `_PLOT_WAIT_S`)
        for the plot of the last steps and finish the W&B run, if one was started. Idempotent."""
        try:
            self._write_unwritten()
        except OSError:
            logger.exception("metrics not written at close")
        if not self.flush(_PLOT_WAIT_S):
            logger.warning("%s: the plot of the last steps was not drawn within %.0f s", self.run_dir / PLOT_FILE,
                           _PLOT_WAIT_S)
        run, self._wandb_run = self._wandb_run, None
        if run is not None:
            run.finish()
