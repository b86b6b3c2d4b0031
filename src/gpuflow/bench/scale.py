"""``gpuflow bench scale``: one training run three ways, each in a child process.

    gpuflow bench scale --preset seed-d384                  # every visible GPU
    gpuflow bench scale --preset tiny --device cpu --nproc 2

The rows: plain ``python -m gpuflow train`` (the baseline), ``torchrun --nproc_per_node=1``
and ``torchrun --nproc_per_node=N``, one rank per GPU. What each row shows, how speedup and
scaling efficiency are computed (weak scaling), and where the children run:
docs/architecture/benches.md (gpuflow bench scale).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuflow.bench.row_progress import progress_line
from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError
from gpuflow.common.signals import handling, interrupts_deferred
from gpuflow.device.accelerator import Device
from gpuflow.train.config import RunConfig, resolve_config
from gpuflow.train.runfolder import REPORT_FILE, RUNS_DIR

# torchrun with one process may cost at most this much throughput against a plain process.
TORCHRUN_1_TARGET = 0.03
# Logging intervals a row needs: the first pays for warm-up, the median is of the rest.
MIN_INTERVALS = 4
# After SIGTERM, how long a child gets to stop: torchrun itself gives its workers 30 s
# before it kills them, and it must outlive them to do so.
STOP_GRACE_S = 40.0
PROGRESS_S = 1.0  # how often a running row's progress is read
# torchrun's own log folder, in the children's cwd: by default it leaves one in the system's
# temporary folder per job.
TORCHRUN_LOGS = "torchrun-logs"
# What the children's environment gets unless it says otherwise: NVLink multicast (NVLS)
# stays off on shared machines.
CHILD_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0"}
# torchrun's variables: inherited from a job this bench runs in, they would make the plain
# row a rank of that job.
_TORCHRUN_ENV = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK"
    r"|ROLE_WORLD_SIZE|ROLE_NAME|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+)$"
)


@dataclass(frozen=True)
class ScaleConfig:
    preset: str = "seed-d384"
    steps: int = 300
    nproc: int | None = None  # None: every visible GPU (2 on the cpu)
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.nproc is not None and self.nproc < 1:
            raise GpuflowError(f"--nproc must be >= 1, got {self.nproc}")
        if self.steps < 1:
            raise GpuflowError(f"--steps must be >= 1, got {self.steps}")


@dataclass(frozen=True)
class Row:
    """One child: its label in the table, its run name, how many processes it starts."""

    label: str
    name: str
    processes: int
    torchrun: bool

    def command(self, train_args: list[str]) -> list[str]:
        if not self.torchrun:
            return [sys.executable, "-m", "gpuflow", "train", *train_args]
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={self.processes}", f"--log-dir={TORCHRUN_LOGS}",
            "-m", "gpuflow", "train", *train_args,
        ]  # fmt: skip


# ---- what to run ----------------------------------------------------------------------------


def job_size(device: Device, requested: int | None) -> int:
    """N, the processes of the last row: ``--nproc``, else every visible GPU (2 on the cpu)."""
    if device.type not in ("cuda", "cpu"):
        raise GpuflowError(
            f"bench scale runs data-parallel jobs, on cuda or the cpu, not {device.type}"
        )
    if device.type == "cpu":
        return requested or 2
    if device.index != 0:  # each rank takes cuda:LOCAL_RANK; the plain rows must match rank 0
        raise GpuflowError(
            f"bench scale runs its one-process rows on cuda:0 and rank r on cuda:r, not on "
            f"{device}; choose GPUs with CUDA_VISIBLE_DEVICES instead"
        )
    visible = torch.cuda.device_count()
    if requested and requested > visible:
        raise GpuflowError(
            f"--nproc {requested} needs {requested} GPUs but {visible} are visible; pass "
            f"--nproc {visible} or fewer"
        )
    return requested or visible


def plan_rows(nproc: int) -> list[Row]:
    rows = [Row("plain", "plain", 1, False), Row("torchrun 1", "torchrun-1", 1, True)]
    if nproc > 1:
        rows.append(Row(f"torchrun {nproc}", f"torchrun-{nproc}", nproc, True))
    return rows


def check_intervals(config: RunConfig) -> None:
    """Refuse a run too short for a steady median of its logging intervals."""
    steps, interval = config.train.steps, config.train.log_interval
    if steps // interval < MIN_INTERVALS:
        raise GpuflowError(
            f"--steps {steps} gives {steps // interval} logging intervals of "
            f"train.log_interval={interval}; a steady median needs {MIN_INTERVALS} (the first "
            f"is warm-up): pass --steps {MIN_INTERVALS * interval} or more, or --set "
            "train.log_interval=N with a smaller N"
        )


def token_folder(config: RunConfig) -> Path:
    """The run's token folder as an absolute path, so that no child depends on its cwd; the
    built-in corpus is prepared here, once, if it is missing. A folder named by data.dir is
    left to the children to check: its errors are theirs."""
    if config.data.dir:
        return Path(config.data.dir).expanduser().absolute()
    from gpuflow.train.setup import open_training_data  # prepares on first use

    open_training_data(config)
    return config.data.resolved_dir(config.model.vocab_size).absolute()


def child_env() -> dict[str, str]:
    """This process's environment, with what a child in another cwd needs to import the
    same gpuflow, and the defaults of ``CHILD_ENV_DEFAULTS``."""
    env = {k: v for k, v in os.environ.items() if not _TORCHRUN_ENV.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(_child_pythonpath(env.get("PYTHONPATH", "")))
    env["PYTHONUNBUFFERED"] = "1"  # a stopped child's log is complete up to its stop
    for key, value in CHILD_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    return env


def _child_pythonpath(current: str) -> list[str]:
    """PYTHONPATH's entries made absolute (a relative one would name another folder from
    the child's cwd), and the folder this gpuflow was imported from when only this cwd made
    it importable (``python -m gpuflow`` run inside ``src/``)."""
    entries = [str(Path(p).absolute()) for p in current.split(os.pathsep) if p]
    root = str(Path(__file__).resolve().parents[2])  # the folder holding gpuflow/
    known = {str(Path(p).resolve()) for p in [*entries, *site.getsitepackages()]}
    if root not in known:
        entries.append(root)
    return list(dict.fromkeys(entries))


def train_args(bench: ScaleConfig, device: Device, data_dir: Path, name: str) -> list[str]:
    # The caller's data.dir, if any, is replaced by its absolute path, as a TOML string.
    sets = [s for s in bench.overrides if s.partition("=")[0].strip() != "data.dir"]
    sets.append(f"data.dir={json.dumps(str(data_dir))}")
    args = ["--preset", bench.preset, "--steps", str(bench.steps), "--device", str(device)]
    return [*args, "--name", name, *(a for s in sets for a in ("--set", s))]


# ---- running a child ------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildOutcome:
    returncode: int
    seconds: float
    stderr: str


def run_child(
    command: list[str], cwd: Path, env: dict[str, str], log: Path,
    while_running: Callable[[], None] | None = None,
) -> ChildOutcome:  # fmt: skip
    """Run ``command`` to its end, its output into ``log``.out/.err (a pipe nobody reads
    while it runs would fill and stall it), calling ``while_running`` every
    ``PROGRESS_S`` until then. The child gets a process group of its own, so that Ctrl-C
    reaches this process alone, which then stops the child and all below it."""
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    started = time.perf_counter()
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        child = None
        try:
            # An interrupt as the child starts waits until it is known here, to be stopped.
            with interrupts_deferred():
                child = subprocess.Popen(
                    command, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                    start_new_session=True,
                )  # fmt: skip
            while True:
                try:
                    returncode = child.wait(timeout=PROGRESS_S)
                    break
                except subprocess.TimeoutExpired:
                    if while_running is not None:
                        while_running()
        finally:
            if child is not None:  # after Ctrl-C or SIGTERM; a no-op when the child has ended
                stop_child(child)
    seconds = time.perf_counter() - started
    return ChildOutcome(returncode, seconds, err.read_text(errors="replace"))


def stop_child(child: subprocess.Popen) -> None:
    """SIGTERM to the child's process group (a training process then stops at its next
    step; torchrun stops its workers), SIGKILL to everything below it after
    ``STOP_GRACE_S`` or at a second Ctrl-C."""
    if child.poll() is not None:
        return
    _signal_group(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=STOP_GRACE_S)
        return
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    # torchrun's workers run in sessions of their own: find them before their parent dies.
    family = _descendants(child.pid)
    _signal_group(child.pid, signal.SIGKILL)
    for pid in family:
        _kill(pid)
    child.wait()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):  # gone already
        os.killpg(pid, sig)  # the child leads its group: start_new_session


def _kill(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """The live processes below ``pid``, read from /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        parent = int(stat.rpartition(")")[2].split()[1])  # the name may hold spaces: ")" ends it
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(), [])
        found += below
        queue += below
    return found


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM to this bench stops it as Ctrl-C does, children included: by default it would
    die at once and leave them running."""
    with handling([signal.SIGTERM], _raise_interrupt):
        yield


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def failure_line(row: Row, outcome: ChildOutcome) -> str:
    """One line for a failed child: its row, its exit status and its own last words."""
    return (
        f"bench scale: row {row.label!r} failed (exit status {outcome.returncode}): "
        f"{last_words(outcome.stderr)}"
    )


# gpuflow's one-line error, as the cli prints it (under torchrun maybe behind "[rank0]:").
_OURS = re.compile(r"^(?:\[[^\]]*\]:\s*)?error: (.*)$")
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b")


def last_words(stderr: str, limit: int = 400) -> str:
    """What a child said when it failed: gpuflow's own ``error:`` line, else a traceback's
    last line (torchrun's summary box after it names no cause), else its last lines."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    ours = [m[1] for line in lines if (m := _OURS.match(line))]
    raised = [line for line in lines if _EXCEPTION.match(line) and "ChildFailedError" not in line]
    text = (ours or raised or [" | ".join(lines[-3:]) or "(nothing on stderr)"])[-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- the bench ------------------------------------------------------------------------------


def run_scale_bench(device: Device, bench: ScaleConfig) -> dict[str, Any]:
    config = resolve_config(bench.preset, None, [*bench.overrides, f"train.steps={bench.steps}"])
    check_intervals(config)
    nproc = job_size(device, bench.nproc)
    data_dir = token_folder(config)
    rows = plan_rows(nproc)
    skipped = None
    if nproc == 1:
        why = "--nproc 1" if bench.nproc else "one GPU is visible"
        skipped = f"{why}: the row of a job of N > 1 processes is skipped"
        err_console.print(f"note: {skipped}")
    env = child_env()
    measured = []
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-scale-"))
    err_console.print(f"runs in {scratch} (removed afterwards)")
    try:
        with sigterm_as_interrupt():
            for number, row in enumerate(rows, start=1):
                measured.append(
                    _run_row(row, f"[{number}/{len(rows)}]", bench, device, data_dir, env, scratch)
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with_figures(measured)
    # The GPUs the job ran on, by name (the machine facts describe the first only).
    gpus = [torch.cuda.get_device_name(i) for i in range(nproc)] if device.type == "cuda" else []
    return {
        "preset": bench.preset,
        "steps": bench.steps,
        "overrides": list(bench.overrides),
        "batch_size_per_rank": config.train.batch_size,  # the micro-batch; 0: found to fit
        "batch_tokens": config.train.batch_tokens,  # 0: one micro-batch a step
        "seq_len": config.model.max_len,
        "log_interval": config.train.log_interval,
        "data_dir": str(data_dir),
        "nproc": nproc,
        "gpus": gpus,
        "env_defaults": {k: env[k] for k in CHILD_ENV_DEFAULTS},
        "rows": measured,
        "skipped": skipped,
        "torchrun_1_vs_plain": measured[1]["tokens_per_s"] / measured[0]["tokens_per_s"] - 1,
        "torchrun_1_target": TORCHRUN_1_TARGET,
    }


def _run_row(
    row: Row, tag: str, bench: ScaleConfig, device: Device, data_dir: Path,
    env: dict[str, str], scratch: Path,
) -> dict[str, Any]:  # fmt: skip
    """Run one row's child and read its report."""
    command = row.command(train_args(bench, device, data_dir, row.name))
    what = f"{row.processes} process{'es' if row.processes > 1 else ''}"
    err_console.print(f"{tag} {row.label}: training {bench.steps} steps, {what}...")
    run_dir = scratch / RUNS_DIR / row.name
    with err_console.status(f"{tag} {row.label}: starting") as status:
        outcome = run_child(
            command, scratch, env, scratch / row.name,
            lambda: status.update(f"{tag} {row.label}: {progress_line(run_dir, bench.steps)}"),
        )  # fmt: skip
    if outcome.returncode != 0:
        raise GpuflowError(failure_line(row, outcome))
    report_path = run_dir / REPORT_FILE
    if not report_path.is_file():
        raise GpuflowError(f"bench scale: row {row.label!r} ended without writing {REPORT_FILE}")
    report = json.loads(report_path.read_text())
    if not report.get("tokens_per_s"):
        raise GpuflowError(f"bench scale: row {row.label!r} measured no tokens/s")
    err_console.print(
        f"{tag} {row.label}: {report['tokens_per_s']:,.0f} tokens/s ({outcome.seconds:.1f} s)"
    )
    keys = ("world_size", "tokens_per_s", "tokens_per_s_per_rank", "tokens_per_step", "mfu",
            "collective_bytes_per_step_per_rank", "final_train_loss", "steps_done",
            "micro_batch", "accumulation")  # fmt: skip
    return {
        "row": row.label,
        "processes": row.processes,
        "command": shlex.join(command),
        "seconds": outcome.seconds,
        **{key: report.get(key) for key in keys},
        "device": report.get("device", {}).get("device"),
    }


def with_figures(rows: list[dict[str, Any]]) -> None:
    """Add each row's speedup over the plain row (the first), its scaling efficiency, its
    step time, and what the job costs a step beyond a rank's own work: the step's time less
    the time the plain row takes for one rank's share of the step's tokens (the exchange
    between ranks, and whatever else the job adds)."""
    plain = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / plain
        row["efficiency"] = row["speedup"] / row["world_size"]
        row["step_ms"] = 1e3 * row["tokens_per_step"] / row["tokens_per_s"]
        own_work_ms = 1e3 * row["tokens_per_step"] / row["world_size"] / plain
        row["job_cost_ms_per_step"] = row["step_ms"] - own_work_ms


def print_scale_table(result: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    per = "per GPU" if result["gpus"] else "per rank"
    out = table(
        "row", "processes", "tokens/s", f"tokens/s {per}", "speedup", "efficiency", "MFU",
        "exchanged per step per rank", "step", "job's cost a step", "final train loss",
        title=(
            f"{result['preset']} (B {result['batch_size_per_rank'] or 'found'} per rank, "
            f"T {result['seq_len']}), {result['steps']} steps: plain vs torchrun"
        ),
    )  # fmt: skip
    for row in result["rows"]:
        reduced = row["collective_bytes_per_step_per_rank"]
        loss = row["final_train_loss"]
        out.add_row(
            row["row"],
            str(row["processes"]),
            f"{row['tokens_per_s']:,.0f}",
            f"{row['tokens_per_s_per_rank']:,.0f}",
            f"{row['speedup']:.2f}x",
            f"{row['efficiency']:.0%}",
            f"{row['mfu']:.1%}" if row["mfu"] is not None else "-",
            f"{reduced / 2**20:,.2f} MiB" if reduced is not None else "-",
            f"{row['step_ms']:,.1f} ms",
            f"{row['job_cost_ms_per_step']:+,.1f} ms",
            f"{loss:.4f}" if loss is not None else "-",
        )
    out_console.print(out)
    gap, target = result["torchrun_1_vs_plain"], result["torchrun_1_target"]
    verdict = "within" if abs(gap) <= target else "[bold red]outside[/]"
    out_console.print(f"torchrun 1 vs plain: {gap:+.1%} ({verdict} the {target:.0%} target)")
    if result["skipped"]:
        out_console.print(f"note: {result['skipped']}")
    if not result["gpus"]:
        out_console.print(
            "note: on the cpu the ranks share the host's cores (torchrun gives each one "
            "thread unless OMP_NUM_THREADS is set): efficiency measures the host, not the "
            "all-reduce"
        )
