"""Checkpoints and resume in the recipes' one training loop (``mmspec.training.loop``): a run
killed with SIGKILL and resumed from its last checkpoint ends with the weights (and EMA averages)
of a run never stopped, bit for bit, in one process and under ``accelerate launch`` with two; a
resume that leaves the loss's dropout generator out of ``state`` does not (the test bites); saving
checkpoints changes nothing. The toy run is ``tests/resume_toy.py``; every ``mmspec train`` recipe
resumes through the same loop (``--checkpoint-every``, ``--resume``: ``test_a_recipe_resumes``)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TOY = Path(__file__).parent / "resume_toy.py"
ACCELERATE = Path(sys.executable).parent / "accelerate"


def run(tmp_path, name, mode, kill_at=0, processes=1, folder="ckpt"):
    out = tmp_path / f"{name}.safetensors"
    args = [str(TOY), str(out), str(tmp_path / folder), mode, str(kill_at)]
    if processes == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", "0", *args]  # a free port: no clash with another launch beside it
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return done, out


def same(a: Path, b: Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_killed_run_resumes_to_the_same_weights(tmp_path, processes):
    done, plain = run(tmp_path, "plain", "none", processes=processes, folder="unused")
    assert done.returncode == 0, done.stderr[-6000:]
    done, saved = run(tmp_path, "saved", "save", processes=processes, folder="saved")
    assert done.returncode == 0, done.stderr[-6000:]
    assert same(plain, saved)  # writing checkpoints takes nothing from any RNG
    killed, out = run(tmp_path, "resumed", "save", kill_at=8, processes=processes)
    assert killed.returncode != 0 and not out.exists()  # SIGKILL at step 8: no weights written
    steps = sorted(p.name for p in (tmp_path / "ckpt" / "toy").iterdir())
    assert steps == ["step-00000006"]  # every 3 steps, the newest kept, nothing half-written beside it
    done, out = run(tmp_path, "resumed", "resume", processes=processes)
    assert done.returncode == 0, done.stderr[-6000:]
    assert same(plain, out)


def test_a_resume_that_forgets_a_generator_differs(tmp_path):
    done, plain = run(tmp_path, "plain", "none", folder="unused")
    assert done.returncode == 0, done.stderr[-6000:]
    killed, _ = run(tmp_path, "broken", "save", kill_at=8)
    assert killed.returncode != 0
    done, out = run(tmp_path, "broken", "resume-no-state")
    assert done.returncode == 0, done.stderr[-6000:]
    assert not same(plain, out)


@pytest.mark.parametrize("recipe", ["ar-image", "classifier", "video-ae"])
def test_a_recipe_resumes_through_the_cli(tmp_path, capsys, recipe):
    """``mmspec train RECIPE ... --checkpoint-every 2``: 5 steps leave the step-4 checkpoint beside
    ``--out`` (with the generator the recipe's loss draws label dropout, augmentation or latent
    noise from); ``--resume`` reruns step 5 from it, and the saved weights are those of a run
    without checkpoints, byte for byte. ``--resume`` alone is refused naming
    ``--checkpoint-every``."""
    from mmspec import commands
    from mmspec.training import loop
    from mmspec.training.recipes import train_vq

    extra = []
    if recipe == "ar-image":
        vq = tmp_path / "vq"
        train_vq(vq, steps=2, batch_size=2, lr=1e-3, dataset_size=4, heldout_size=2, log=lambda msg: None)
        extra = ["--vq", str(vq)]
    base = ["train", recipe, *extra, "--steps", "5", "--batch-size", "2", "--dataset-size", "4", "--threads", "1"]
    threads = torch.get_num_threads()
    resumed = []
    real = loop._load_checkpoint
    try:
        assert commands.main([*base, "--out", str(tmp_path / "plain")]) == 0
        assert commands.main([*base, "--out", str(tmp_path / "run"), "--checkpoint-every", "2"]) == 0
        saved = sorted(p.name for p in (tmp_path / "run.checkpoints").glob("*/step-*"))
        assert saved == ["step-00000004"]
        loop._load_checkpoint = lambda path, *a: (resumed.append(path.name), real(path, *a))[1]
        assert commands.main([*base, "--out", str(tmp_path / "run"), "--checkpoint-every", "2", "--resume"]) == 0
        capsys.readouterr()
        with pytest.raises(SystemExit):
            commands.main([*base, "--out", str(tmp_path / "x"), "--resume"])
        assert "--resume needs --checkpoint-every N" in capsys.readouterr().err
    finally:
        loop._load_checkpoint = real
        torch.set_num_threads(threads)
    assert resumed == ["step-00000004"]  # it did resume
    files = sorted(p.name for p in (tmp_path / "plain").glob("*.safetensors"))
    assert files and all((tmp_path / "plain" / f).read_bytes() == (tmp_path / "run" / f).read_bytes() for f in files)


def test_a_resume_from_another_process_count_is_refused(tmp_path):
    """A checkpoint records its run's process count; a resume under another count is refused in one
    line naming ``resume`` (each process's RNG state is its own), before any weight is loaded."""
    from types import SimpleNamespace

    from mmspec.training.loop import Checkpoints, _load_checkpoint, new_accelerator, train_loop

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = ((torch.randn(4, 3), torch.randn(4, 2)) for _ in range(4))
    train_loop(model, optimizer, batches, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), steps=4,
               accelerator=new_accelerator("toy"), name="toy", log=lambda msg: None,
               checkpoints=Checkpoints(tmp_path, 2))
    path = tmp_path / "toy" / "step-00000002"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="resume must be a checkpoint of a run of 2 processes, as this one") as err:
        _load_checkpoint(path, model, optimizer, None, {}, SimpleNamespace(num_processes=2, process_index=0))
    assert "\n" not in str(err.value) and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
