"""What the tests of every layer share besides fixtures (those are in tests/conftest.py): the
repository's places, the settings of a fast run, and the ways to start gpuflow in a child
process. Import it absolutely (``from tests.helpers import FAST``): pytest puts the folder
above ``tests/`` on the path whatever the current directory.

Children find gpuflow through ``PYTHONPATH`` (the ``src`` folder first), so a test passes
whether or not gpuflow is installed and from any working directory."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
SRC = ROOT / "src"
PACKAGE = SRC / "gpuflow"
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"
DOCS = ROOT / "docs"  # the reference pages, docs/*.md

SMALL_VOCAB = 512  # the vocabulary of the ``prepared`` fixture's token folder

# Settings that make a run take a few seconds on 2 cores while still learning.
FAST = (
    "model.vocab_size=512",
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=64",
    "model.max_len=32",
    "train.batch_size=8",
    "train.warmup_steps=5",
    "train.eval_batches=2",
    "train.lr=0.003",
    "train.compile=false",  # compiling takes longer than these runs (the gpu tests check it)
)


def child_env(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict:
    """The environment for a child Python process: ``base`` (this process's by default) with
    ``extra`` on top, and ``src`` first on ``PYTHONPATH``: the child imports this checkout's
    gpuflow whether or not it is installed."""
    env = {**(os.environ if base is None else base), **(extra or {})}
    paths = [str(SRC), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def plugin_args() -> list[str]:
    """pytest options that load gpuflow's pytest plugin: none when gpuflow is installed (its
    entry point loads it), ``-p gpuflow.accounting.testing`` when it is only on the path."""
    from importlib.metadata import entry_points

    installed = any(e.value == "gpuflow.accounting.testing" for e in entry_points(group="pytest11"))
    return [] if installed else ["-p", "gpuflow.accounting.testing"]


def gpuflow_cli(
    *args: str, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m gpuflow ARGS`` in a subprocess, as a user would from a shell (``env``:
    extra environment variables)."""
    return subprocess.run(
        [sys.executable, "-m", "gpuflow", *args],
        cwd=cwd,
        env=child_env({"PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun_cli(*args: str, cwd: Path, nproc: int = 2) -> subprocess.Popen:
    """``torchrun -m gpuflow train ARGS``, started, its output into ``cwd/torchrun.log`` (a
    pipe nobody reads while the job runs would fill and stall it)."""
    env = child_env({"PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"})
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "gpuflow", "train", *args,
    ]  # fmt: skip
    with open(cwd / "torchrun.log", "w") as log:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


def torchrun_ended(job: subprocess.Popen, cwd: Path, timeout: float = 180) -> str:
    """Wait for a ``torchrun_cli`` job to end (at most ``timeout`` s); its output."""
    job.wait(timeout=timeout)
    return (cwd / "torchrun.log").read_text()


def torchrun_workers(job: subprocess.Popen) -> dict[int, int]:
    """A running ``torchrun_cli`` job's worker processes: pid by rank (from /proc)."""
    workers = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True)
    ranks = {}
    for pid in map(int, workers.stdout.split()):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next(v for v in environ if v.startswith(b"RANK="))
        ranks[int(rank.split(b"=")[1])] = pid
    return ranks


def line_holding(file: str, marker: str) -> int:
    """The line of ``file`` that holds ``marker``, other than a ``_line(...)`` call naming it
    (tests check the locations a ledger reports against it)."""
    for number, text in enumerate(Path(file).read_text().splitlines(), start=1):
        if marker in text and "_line(" not in text:
            return number
    raise AssertionError(marker)


def random_shards(folder: Path, sizes, dtype, high: int, seed: int = 0) -> list:
    """``train_*.bin`` shards of uniformly random ids below ``high``, opened."""
    import numpy as np

    from gpuflow.data.shards import Shard, write_shard

    rng = np.random.default_rng(seed)
    shards = []
    for i, n in enumerate(sizes):
        path = Path(folder) / f"train_{i:06d}.bin"
        write_shard(path, rng.integers(0, high, size=n).astype(dtype))
        shards.append(Shard.open(path))
    return shards


def mixed_state() -> dict:
    """A state of every kind of tensor a checkpoint holds, in two groups: float32, bfloat16,
    int64 and bool weights, and an optimizer's moments and step."""
    import torch

    return {
        "model": {
            "w": torch.randn(3, 5),
            "half": torch.randn(7).to(torch.bfloat16),
            "ids": torch.arange(9),
            "flag": torch.tensor([True, False, True]),
        },
        "optimizer": {"m": torch.randn(11), "step": torch.tensor(4.0)},
    }


def tiny_runs(accel, prepared, folder, setting: str, values) -> dict[str, tuple]:
    """20 steps of the tiny preset on ``prepared`` for each value of ``setting``, by value:
    (the train loss of every step, the run's ``TrainResult``)."""
    from gpuflow.train.config import resolve_config
    from gpuflow.train.runfolder import read_metrics
    from gpuflow.train.trainer import Trainer

    sets = [*FAST, f"data.dir={prepared}", "train.steps=20", "train.log_interval=1"]
    runs = {}
    for value in values:
        config = resolve_config("tiny", None, [*sets, f"{setting}={value}"])
        result = Trainer(config, folder / "runs" / value, accel).run()
        losses = [r["loss"] for r in read_metrics(result.run_dir) if "loss" in r]
        runs[value] = (losses, result)
    return runs


def save_checkpoint(run_dir: Path, step: int, model, optimizer, state: dict, keep: int) -> Path:
    """Write ``step_<step>`` in the foreground and prune to the newest ``keep``."""
    from gpuflow.device.accelerator import Device
    from gpuflow.train.checkpoint import Checkpointer

    device = Device.of(next(model.parameters()).device)
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # the run's folder, as a run makes it
    checkpointer = Checkpointer(run_dir, device, keep, background=False)
    checkpointer.save(step, model, optimizer, state)
    checkpointer.close()
    return checkpointer.written[-1]


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore weights and optimizer from ``path``; the JSON trainer state."""
    from gpuflow.train.checkpoint import apply_checkpoint, read_checkpoint

    data = read_checkpoint(path)
    apply_checkpoint(data, model, optimizer)
    return data.record


def entry_hashes(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed): a file's SHA-256, a link's target."""
    found = {}
    for folder, names, files in os.walk(root):
        for name in names + files:
            path = Path(folder) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = f"-> {os.readlink(path)}"
            elif path.is_file():
                found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[key] = "folder"
    return found


def one_error(err: str, *said: str) -> str:
    """The one `error:` line of ``err``, which says each of ``said``; no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert all(part in lines[0] for part in said), (said, lines[0])
    return lines[0]


class RecordingBackend:
    """A torch.compile backend that counts the graphs it compiles and each run of one."""

    def __init__(self) -> None:
        self.compiled = 0
        self.runs = 0

    def __call__(self, gm, inputs: list) -> object:
        self.compiled += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


def train_cli(prepared: Path, *extra: str, sets: tuple[str, ...] = ()) -> int:
    """``gpuflow train`` in this process on the cpu with FAST, the corpus at ``prepared``,
    ``extra`` arguments and ``sets`` settings; its exit status."""
    from gpuflow.interface.cli.main import main

    args = [a for s in (*FAST, f"data.dir={prepared}", *sets) for a in ("--set", s)]
    return main(["train", "--device", "cpu", *extra, *args])


def two_checkpointed_steps(prepared: Path, root: Path) -> Path:
    """``root``/runs/r: 2 steps of FAST on the cpu, a checkpoint at each, a best one;
    returns ``root``/runs."""
    from gpuflow.device.accelerator import Device
    from gpuflow.train.config import resolve_config
    from gpuflow.train.trainer import Trainer

    sets = [*FAST, f"data.dir={prepared}", "train.steps=2", "train.checkpoint_interval=1"]
    config = resolve_config("tiny", None, [*sets, "train.eval_interval=1"])
    Trainer(config, root / "runs" / "r", Device("cpu")).run()
    return root / "runs"


def interrupt_as_children_start(monkeypatch) -> list[subprocess.Popen]:
    """Ctrl-C at the moment each ``subprocess.Popen`` returns, before its caller holds the
    handle; the children started, for the test to check and clean up."""
    import signal

    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    class Interrupted(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(subprocess, "Popen", Interrupted)
    return started


def stopped(children: list[subprocess.Popen]) -> bool:
    """Whether every child in ``children`` has ended; kills those that have not."""
    running = [child for child in children if child.poll() is None]
    for child in running:
        child.kill()
        child.wait()
    return not running


def processes_in(folder: Path) -> list[int]:
    """Live processes whose cwd is in ``folder`` (the bench's children run in its scratch)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue  # gone, or not ours to read
        if cwd.startswith(str(folder)):
            pids.append(int(entry.name))
    return pids
