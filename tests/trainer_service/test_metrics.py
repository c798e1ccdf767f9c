"""Metrics go from one function to JSONL, status, a PNG plot and Weights & Biases (offline)."""

from __future__ import annotations

import errno
import json
import math
import threading
from pathlib import Path
from typing import IO, Any

import pytest

from collector.protocol import Batch
from tests.trainer_service.builders import group, make_service, make_trainer
from trainer_service import metrics
from trainer_service.metrics import CHECKPOINT_METRICS, PLOT_FILE, MetricsSink, is_checkpoint_metric


def test_sink_writes_jsonl_plot_and_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(tmp_path, wandb="auto", run_name="agent", config={"lr": 1e-4})
    assert sink.wandb_enabled
    for step, (reward, loss) in enumerate([(0.2, 0.5), (0.4, 0.3)], 1):
        sink.emit(step, {"reward/mean": reward, "loss/policy": loss}, batch_id=f"b{step}")
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["reward/mean"], line["batch_id"]) for line in lines] == [(1, 0.2, "b1"), (2, 0.4, "b2")]
    assert (tmp_path / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert sink.last["reward/mean"] == 0.4 and sink.sink_errors == 0
    assert MetricsSink(tmp_path, wandb="off").last["loss/policy"] == 0.3  # history survives a restart


def test_a_nonfinite_metric_is_null_in_the_jsonl_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """JSON has no NaN or Infinity: a line holding them is refused by strict readers (jq, JavaScript, pandas)."""
    sink = MetricsSink(tmp_path, wandb="off")
    sink.emit(1, {"reward/mean": math.inf, "loss/policy": math.nan, "grad/norm": 0.5})

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    line = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert (line["reward/mean"], line["loss/policy"], line["grad/norm"]) == (None, None, 0.5)
    assert "loss/policy, reward/mean are not finite" in caplog.text
    assert sink.last == MetricsSink(tmp_path, wandb="off").last == {"step": 1.0, "grad/norm": 0.5}
    assert sink.flush() and (tmp_path / PLOT_FILE).is_file()


def test_a_nonfinite_metric_of_an_older_line_is_null_once_read_back(tmp_path: Path) -> None:
    """Lines written before NaN became `null` say `NaN` or `Infinity`: `last` (`GET /v1/status`) showed them."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "batch_id": "b1", "loss/policy": NaN, '
                                            '"reward/mean": Infinity, "grad/norm": 0.5}\n')
    sink = MetricsSink(tmp_path, wandb="off")
    assert sink.history == [{"step": 1, "time": 1.0, "batch_id": "b1", "loss/policy": None, "reward/mean": None,
                             "grad/norm": 0.5}]
    assert sink.last == {"step": 1.0, "grad/norm": 0.5}


def test_a_failing_secondary_sink_is_counted_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = MetricsSink(tmp_path, wandb="off")

    def broken(history: list[dict[str, Any]]) -> None:
        raise RuntimeError("no display")

    monkeypatch.setattr(sink, "_plot", broken)
    sink.emit(1, {"reward/mean": 1.0})
    assert sink.flush() and sink.sink_errors == 1 and (tmp_path / "metrics.jsonl").is_file()


async def test_step_metrics_reach_status_and_plot(tmp_path: Path) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    result = await service.train_once()
    status = await service.status()
    for key in ("loss/policy", "reward/mean", "reward/std", "advantage/mean", "advantage/std", "grad/norm",
                "loss/clip_fraction", "time/tokens_per_s", "time/step_s", "time/publish_s", "promotion/promoted"):
        assert key in result.metrics and status.last_metrics[key] == pytest.approx(result.metrics[key]), key
    await service.aclose()
    assert (tmp_path / PLOT_FILE).is_file()  # drawn in its own thread: `close` waits for it


def test_a_line_cut_short_is_skipped_and_the_next_record_gets_its_own_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss/policy": 0.5}) + "\n" + '{"step": 2, "loss/po')  # full disk mid-line
    sink = MetricsSink(tmp_path, wandb="off")
    assert [h["step"] for h in sink.history] == [1]
    assert f"{path}: skipped 1 line(s)" in caplog.text
    sink.emit(3, {"loss/policy": 0.25})
    assert path.read_text().splitlines()[1:] == ['{"step": 2, "loss/po', json.dumps(sink.history[-1])]
    caplog.clear()
    assert [h["step"] for h in MetricsSink(tmp_path, wandb="off").history] == [1, 3]  # step 3 survives a restart
    assert f"{path}: skipped 1 line(s)" in caplog.text


class _FillingFile:
    """A file on a disk that fills up as it is written: half of what is written reaches it, then ENOSPC."""

    def __init__(self, handle: IO[str]) -> None:
        self.handle = handle

    def __enter__(self) -> _FillingFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.handle.close()

    def write(self, text: str) -> int:
        self.handle.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_record_a_full_disk_refused_is_written_once_there_is_room(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's line cut short by a full disk was lost for good (`metrics.jsonl`, status, plot): it is kept and
    written, whole and in order, by the next step or `close` once the disk has room."""
    sink = MetricsSink(tmp_path, wandb="off")
    sink.emit(1, {"loss/policy": 0.5})
    real_open, full = Path.open, {"disk": True}

    def filling(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(path, mode, *args, **kwargs)
        return _FillingFile(handle) if full["disk"] and path == sink.jsonl_path and "a" in mode else handle

    monkeypatch.setattr(Path, "open", filling)
    with pytest.raises(OSError) as info:
        sink.emit(2, {"loss/policy": 0.4})
    assert info.value.errno == errno.ENOSPC and str(sink.jsonl_path) in str(info.value)
    assert "step 2" in str(info.value) and "written with the next step" in str(info.value)
    assert [h["step"] for h in sink.history] == [1, 2]  # the status endpoint and the plot have it
    full["disk"] = False
    sink.emit(3, {"loss/policy": 0.3})
    assert [h["step"] for h in MetricsSink(tmp_path, wandb="off").history] == [1, 2, 3]
    full["disk"] = True
    with pytest.raises(OSError):
        sink.emit(4, {"loss/policy": 0.2})
    full["disk"] = False
    sink.close()
    assert [h["step"] for h in MetricsSink(tmp_path, wandb="off").history] == [1, 2, 3, 4]


def test_a_plot_a_full_disk_refuses_leaves_no_figure_open_and_no_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each refused plot kept its figure open in pyplot (memory, step after step) and its partial file on the
    full disk."""
    from matplotlib import pyplot as plt
    from matplotlib.figure import Figure

    def full_disk(figure: Figure, path: Path, **kwargs: object) -> None:
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    sink = MetricsSink(tmp_path, wandb="off")
    opened = set(plt.get_fignums())
    for step in (1, 2):
        sink.emit(step, {"loss/policy": 0.5})
        assert sink.flush()
    assert sink.sink_errors == 2 and set(plt.get_fignums()) == opened
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_line_of_json_that_is_no_record_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    no_step = json.dumps({"loss/policy": 0.3})  # was kept: the plot failed on it at every step, never redrawn
    path.write_text("5\n" + json.dumps({"step": 1, "loss/policy": 0.5}) + "\n[]\n" + no_step + "\n")  # edited by hand
    sink = MetricsSink(tmp_path, wandb="off")  # was an AttributeError in `last`, a 500 from /v1/status
    assert [h["step"] for h in sink.history] == [1] and sink.last == {"step": 1.0, "loss/policy": 0.5}
    assert f"{path}: skipped 3 line(s) that are not JSON objects with a `step`" in caplog.text
    sink.emit(2, {"loss/policy": 0.25})
    assert sink.flush() and sink.sink_errors == 0 and (tmp_path / PLOT_FILE).is_file()


def test_a_line_that_is_not_utf8_or_has_a_boolean_step_is_skipped(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    # one byte that is not UTF-8 was a UnicodeDecodeError: the service did not start; `true` was read as step 1
    path.write_bytes(b'{"step": 1}\n{"step": 3, "x": "\xff"}\n{"step": true}\n' + '{"step": 2, "note": "é"}\n'.encode())
    sink = MetricsSink(tmp_path, wandb="off")
    assert sink.history == [{"step": 1}, {"step": 2, "note": "é"}]
    assert f"{path}: skipped 2 line(s) that are not JSON objects with a `step`" in caplog.text


def test_the_plot_shows_the_sft_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    labels: list[list[str]] = []
    savefig = Figure.savefig

    def record(figure: Figure, *args: object, **kwargs: object) -> None:
        labels.append([axis.get_ylabel() for axis in figure.axes])
        savefig(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    sink = MetricsSink(tmp_path, wandb="off")
    sink.emit(1, {"loss/sft": 0.7})
    assert sink.flush()
    sink.emit(2, {"reward/mean": 0.5, "loss/policy": 0.1})
    assert sink.flush() and sink.sink_errors == 0
    assert labels == [["SFT loss"], ["reward (mean)", "policy loss", "SFT loss"]]


async def test_a_steps_record_survives_a_restart_with_its_kind(tmp_path: Path) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    await service.train_once(kind="sft")  # the trainer's metrics carry `step` as a float: every line was skipped
    await service.aclose()
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["step"] == 1 and isinstance(line["step"], int) and line["kind"] == "sft"
    history = MetricsSink(tmp_path, wandb="off").history
    assert [(h["step"], h["kind"], "loss/sft" in h) for h in history] == [(1, "sft", True)]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({**line, "step": 1.0}) + "\n")  # as written before
    assert [h["step"] for h in MetricsSink(tmp_path, wandb="off").history] == [1]


def test_checkpoint_metrics_are_the_ones_a_step_records() -> None:
    """`--keep-best-metric` is checked against this list at start: a name no step records (a typo) kept no best."""
    trainer = make_trainer(kl_coef=0.1)  # loss/kl and loss/total only with a KL penalty
    grpo = trainer.train([group(trainer, (1.0, 0.0), "a"), group(trainer, (0.5, 0.5), "b")], "grpo")
    sft = trainer.train([group(trainer, (1.0, 0.0), "a")], "sft")
    recorded = grpo.keys() | sft.keys()
    assert "data/skipped/no_reward_spread" in recorded and all(is_checkpoint_metric(name) for name in recorded)
    assert {name for name in recorded if not name.startswith("data/skipped/")} == CHECKPOINT_METRICS
    # added by the service after the checkpoint is written: never in a manifest, which retention reads
    for name in ("time/publish_s", "promotion/promoted", "eval/reward", "reward/maen", "data/skipped/"):
        assert not is_checkpoint_metric(name), name


@pytest.mark.parametrize("steps", [1, 3])
def test_the_plot_marks_whole_steps_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    from matplotlib.figure import Figure

    ticks: list[float] = []
    savefig = Figure.savefig

    def record(figure: Figure, *args: object, **kwargs: object) -> None:
        axis = figure.axes[-1]
        low, high = axis.get_xlim()
        ticks[:] = [tick for tick in axis.get_xticks() if low <= tick <= high]
        savefig(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    sink = MetricsSink(tmp_path, wandb="off")
    for step in range(1, steps + 1):
        sink.emit(step, {"reward/mean": 0.1 * step})
    assert sink.flush()
    # were 0.96, 0.98, ... for one step and 1.25, 1.5, ... for three: no step is there
    assert ticks and all(float(tick).is_integer() for tick in ticks) and sink.sink_errors == 0


def test_a_hand_edited_value_that_is_no_number_is_left_out_of_the_plot(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    plotted: list[list[float | None]] = []
    plot = Axes.plot

    def record(axis: Axes, x: list[int], y: list[float | None], **kwargs: object) -> object:
        plotted.append(list(y))
        return plot(axis, x, y, **kwargs)

    monkeypatch.setattr(Axes, "plot", record)
    edited = [{"step": 1, "reward/mean": "abc"}, {"step": 2, "reward/mean": [0.5]}, {"step": 3, "reward/mean": True},
              {"step": 4, "reward/mean": None}, {"step": 5, "reward/mean": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in edited))
    sink = MetricsSink(tmp_path, wandb="off")
    sink.emit(6, {"reward/mean": 0.5})
    assert sink.flush()
    # the plot raised at every step on such a value: never redrawn; a null stays, as a gap
    assert sink.sink_errors == 0 and plotted == [[None, 0.25, 0.5]]


def test_a_step_does_not_wait_for_the_plot_and_the_last_state_is_drawn(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing took 0.4 to 1 s at every step, the step's lock held; it runs in a thread of its own, the steps
    emitted while it draws are drawn once, together, after it."""
    sink = MetricsSink(tmp_path, wandb="off")
    drawn: list[list[int]] = []
    drawing, release = threading.Event(), threading.Event()

    def slow(history: list[dict[str, Any]]) -> None:
        drawing.set()
        assert release.wait(60)
        drawn.append([h["step"] for h in history])

    monkeypatch.setattr(sink, "_plot", slow)
    sink.emit(1, {"loss/policy": 0.5})
    assert drawing.wait(60)
    for step in (2, 3, 4):
        sink.emit(step, {"loss/policy": 0.5})  # return while step 1 is drawn
    assert drawn == [] and [h["step"] for h in sink.history] == [1, 2, 3, 4]
    assert not sink.flush(timeout=0)
    release.set()
    sink.close()  # waits for the last state
    assert drawn == [[1], [1, 2, 3, 4]] and sink.sink_errors == 0


def test_steps_emitted_soon_after_a_drawing_are_drawn_once_later_or_at_flush(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A drawing at every step, each holding the GIL, made quick steps 5 to 9 times slower: those emitted within
    `_PLOT_INTERVAL_S` of the last drawing are drawn together, once that time has passed or at once for `flush`."""
    monkeypatch.setattr(metrics, "_PLOT_INTERVAL_S", 3600.0)
    sink = MetricsSink(tmp_path, wandb="off")
    drawn: list[list[int]] = []
    drawing = threading.Event()

    def record(history: list[dict[str, Any]]) -> None:
        drawn.append([h["step"] for h in history])
        drawing.set()

    monkeypatch.setattr(sink, "_plot", record)
    sink.emit(1, {"loss/policy": 0.5})
    assert drawing.wait(60)  # the first step is drawn at once, unasked
    drawing.clear()
    for step in (2, 3, 4):
        sink.emit(step, {"loss/policy": 0.5})
    assert not drawing.wait(1)  # held back for the interval: each was drawn at once after the one before
    assert sink.flush(60) and drawn == [[1], [1, 2, 3, 4]] and sink.sink_errors == 0


def test_steps_held_back_are_drawn_once_the_interval_has_passed(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_PLOT_INTERVAL_S", 0.05)
    sink = MetricsSink(tmp_path, wandb="off")
    drawn: list[list[int]] = []
    last = threading.Event()

    def record(history: list[dict[str, Any]]) -> None:
        drawn.append([h["step"] for h in history])
        if history[-1]["step"] == 3:
            last.set()

    monkeypatch.setattr(sink, "_plot", record)
    for step in (1, 2, 3):
        sink.emit(step, {"loss/policy": 0.5})
    assert last.wait(60)  # nobody waits (`flush`): drawn when the interval has passed, not lost
    assert drawn[-1] == [1, 2, 3] and sink.flush(60) and sink.sink_errors == 0
