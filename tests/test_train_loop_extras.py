"""What the recipes' training loop (``mmspec.training.loop.train_loop``) does around the steps
without touching a weight: a progress bar, a rate on every log line, accelerate trackers, and a
held-out ``evaluate`` at each checkpoint whose history a resumed run restores. A toy MLP with
dropout, noise from the global RNG and its own batch-order generator, 12 steps in-process."""

import json
import re

import pytest
import torch
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker

from mmspec import commands
from mmspec.training.loop import Checkpoints, new_accelerator, tracking, train_loop

STEPS = 12
DATA = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
TARGET = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))
HELD = (torch.randn(16, 8, generator=torch.Generator().manual_seed(5)),
        torch.randn(16, 4, generator=torch.Generator().manual_seed(6)))


def evaluate(model):
    """Held-out MSE, plus a draw from the global RNG: the loop must put that state back."""
    noise = torch.randn(())
    return {"mse": torch.nn.functional.mse_loss(model(HELD[0]), HELD[1]), "noise": float(noise), "n": 16}


def toy(accelerator=None, lines=None, crash_at=0, on_step=None, **kw):
    """The toy's final weights after ``train_loop(..., **kw)`` (``crash_at``: raise at that step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    order = torch.Generator().manual_seed(3)

    def batches():
        while True:
            idx = torch.randperm(64, generator=order)[:8]
            yield DATA[idx], TARGET[idx]

    def step_hook(step):
        if on_step is not None:
            on_step(model, step)
        if step == crash_at:
            raise RuntimeError("crash")

    def loss(m, b):
        return ((m(b[0]) - b[1] + 0.01 * torch.randn(b[1].shape)) ** 2).mean()

    train_loop(model, optimizer, batches(), loss, steps=STEPS, accelerator=accelerator or new_accelerator("toy"),
               name="toy", log=(lines.append if lines is not None else lambda msg: None), log_every=4,
               on_step=step_hook, **kw)
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_evaluate_and_progress_change_no_weight(capsys):
    """With ``evaluate`` (which draws from the global RNG) at every 3-step checkpoint and a forced
    progress bar, the weights are those of a bare run; ``evaluate`` called raw from ``on_step``
    (no RNG or train mode put back) does change them: the test bites."""
    plain = toy()
    history = []
    shown = toy(evaluate=evaluate, history=history, progress=True)
    assert same(plain, shown)
    assert [h["step"] for h in history] == [STEPS]  # no checkpoints: at the end only
    err = capsys.readouterr().err
    assert "toy" in err and f"{STEPS}/{STEPS}" in err and "samples/s" in err  # the bar, on stderr
    raw = toy(on_step=lambda model, step: evaluate(model.eval()) if step % 3 == 0 else None)
    assert not same(plain, raw)


def test_history_at_each_checkpoint_and_restored_on_resume(tmp_path):
    """Checkpoints every 3 steps: evaluations at 3, 6, 9 and 12, the same weights as a bare run,
    each checkpoint's ``meta.json`` holding the history so far. A run crashed at step 8 and
    resumed from step 6 ends with the same weights and the same history as the uninterrupted one."""
    plain = toy()
    history, lines = [], []
    whole = toy(checkpoints=Checkpoints(tmp_path / "a", 3), evaluate=evaluate, history=history, lines=lines)
    assert same(plain, whole)
    assert [h["step"] for h in history] == [3, 6, 9, 12]
    assert set(history[0]) == {"step", "mse", "noise", "n"} and isinstance(history[0]["mse"], float)
    meta = json.loads((tmp_path / "a" / "toy" / "step-00000009" / "meta.json").read_text())
    assert meta["history"] == history[:3]
    held = [line for line in lines if "held-out" in line]
    assert held[0] == f"toy step 3 held-out mse {history[0]['mse']:.4f}  noise {history[0]['noise']:.4f}  n 16"

    with pytest.raises(RuntimeError, match="crash"):
        toy(checkpoints=Checkpoints(tmp_path / "b", 3), evaluate=evaluate, history=[], crash_at=8)
    resumed_history = []
    resumed = toy(checkpoints=Checkpoints(tmp_path / "b", 3, resume=True), evaluate=evaluate,
                  history=resumed_history)
    assert same(plain, resumed)
    assert resumed_history == history


def test_log_lines_carry_the_rate():
    """``"<name> step i/n  loss v  <rate> samples/s  <t>s"``; with ``count``: ``tok/s``, in
    proportion (three tokens per sample here, from the same timings up to noise)."""
    lines = []
    toy(lines=lines)
    pattern = r"toy step (\d+)/12  loss \d+\.\d{4}  (\d+\.\d) samples/s  \d+s"
    assert [re.fullmatch(pattern, line).group(1) for line in lines] == ["4", "8", "12"]
    assert all(float(re.fullmatch(pattern, line).group(2)) > 0 for line in lines)
    lines = []
    toy(lines=lines, count=lambda batch: 3 * len(batch[0]))
    assert all(re.fullmatch(r"toy step \d+/12  loss \d+\.\d{4}  \d+\.\d tok/s  \d+s", line) for line in lines)


class Recorder(GeneralTracker):
    """A tracker that keeps what it is sent (``runs``: every instance, for the CLI test)."""

    name = "mmspec_recorder"
    requires_logging_directory = True
    runs: list = []

    def __init__(self, run_name="", logging_dir=None):
        super().__init__()
        self.run_name, self.logging_dir, self.events, self.logged = run_name, logging_dir, [], []
        Recorder.runs.append(self)

    @property
    def tracker(self):
        return self

    def start(self):
        self.events.append("start")

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.events.append("finish")


def test_a_tracker_receives_the_logged_values_and_evaluations(tmp_path):
    """A ``GeneralTracker`` in ``log_with`` (here through ``tracking(...)``) is started, sent the
    loss and the rate at each log line and the held-out figures at each evaluation, and finished;
    the weights are unchanged."""
    plain = toy()
    recorder = Recorder()
    with tracking([recorder], tmp_path / "logs"):
        accelerator = new_accelerator("toy")
    history = []
    weights = toy(accelerator=accelerator, evaluate=evaluate, history=history,
                  checkpoints=Checkpoints(tmp_path / "ckpt", 6))
    assert same(plain, weights)
    assert recorder.events == ["start", "finish"]
    train = [(s, v) for s, v in recorder.logged if "loss" in v]
    assert [s for s, _ in train] == [4, 8, 12] and all(set(v) == {"loss", "samples_per_s"} for _, v in train)
    held = [(s, v) for s, v in recorder.logged if "loss" not in v]
    assert held == [(h["step"], {"heldout/mse": h["mse"], "heldout/noise": h["noise"], "heldout/n": 16})
                    for h in history]
    assert [h["step"] for h in history] == [6, 12]


def test_a_missing_tracker_package_is_refused_up_front(tmp_path, capsys, monkeypatch):
    """``log_with="tensorboard"`` without tensorboard installed: one line naming ``log_with`` and
    the package to install, from ``new_accelerator``, ``tracking`` and ``mmspec train --log-with``
    (before any work: no folder written). An unknown name is refused too."""
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])  # as here: not installed
    message = r"log_with must be a tracker whose package is installed \(pip install tensorboard\), got 'tensorboard'"
    with pytest.raises(ValueError, match=message):
        new_accelerator("toy", log_with="tensorboard", project_dir=tmp_path)
    with pytest.raises(ValueError, match=message):
        with tracking("tensorboard", tmp_path):
            pass
    with pytest.raises(ValueError, match="log_with must be one of all, .*tensorboard.*, got 'tensorbored'"):
        new_accelerator("toy", log_with="tensorbored")
    with pytest.raises(SystemExit):
        commands.main(["train", "vq", "--out", str(tmp_path / "vq"), "--steps", "2", "--log-with", "tensorboard"])
    assert "log_with must be a tracker whose package is installed (pip install tensorboard)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_cli_sets_trackers_and_progress_for_a_recipe(tmp_path, capsys, monkeypatch):
    """``mmspec train vq ... --log-with NAME --progress``: the loop the recipe runs (the toy's,
    standing in for the recipe's) logs to the tracker registered under NAME, its files under
    ``OUT.logs``, and draws its bar on stderr; by default only on a terminal, ``--no-progress``:
    never."""
    from mmspec.commands import train

    monkeypatch.setitem(LOGGER_TYPE_TO_CLASS, Recorder.name, Recorder)
    monkeypatch.setattr(Recorder, "runs", [])
    monkeypatch.setattr(train, "_run", lambda args: (toy(), 0)[1])
    base = ["train", "vq", "--steps", "2", "--out", str(tmp_path / "vq")]
    assert commands.main([*base, "--log-with", Recorder.name, "--progress"]) == 0
    (run,) = Recorder.runs
    assert (run.run_name, str(run.logging_dir)) == ("toy", str(tmp_path / "vq.logs"))
    assert run.events == ["start", "finish"] and [s for s, _ in run.logged] == [4, 8, 12]
    assert "toy" in capsys.readouterr().err
    for flag in ([], ["--no-progress"]):
        assert commands.main([*base, *flag]) == 0
        assert capsys.readouterr().err == "" and len(Recorder.runs) == 1
    parse = commands.build_parser().parse_args
    assert [parse([*base, *flag]).progress for flag in ([], ["--progress"], ["--no-progress"])] == [None, True, False]
