"""The run folder `runs/<name>/`: config, metrics, report, plot, tokenizer, checkpoints.

``RunFolder`` is how a training process holds one: locked against a second process, cleared
of the temporary files a killed one left, and, when the invocation fails before its first
checkpoint, put back as it was (a new folder removed, a resumed run's config restored), so
that the same command can simply be run again.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuflow.common.atomic import check_replaceable, fsync_dir, write_atomic, write_text_atomic
from gpuflow.common.errors import GpuflowError
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import (
    PRESETS,
    RunConfig,
    apply_overrides,
    apply_sets,
    load_toml,
    parse_set,
    preset,
    resolve_config,
    to_toml,
)
from gpuflow.train.schedule import finished_run, lr_at

RUNS_DIR = Path("runs")
CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.json"
PLOT_FILE = "training.png"
TOKENIZER_FILE = "tokenizer.json"
PROFILE_FILE = "profile.json"  # marks a `gpuflow profile` folder, which is not a run
# The files gpuflow writes at the top of a run folder: each is a regular file or absent.
OWN_FILES = (CONFIG_FILE, METRICS_FILE, REPORT_FILE, PLOT_FILE, TOKENIZER_FILE)
# Temporary files of gpuflow.common.atomic (".config.toml.tmp-<pid>") and the plot's.
_OWN_TEMPORARY = re.compile(
    rf"^\.({re.escape(CONFIG_FILE)}|{re.escape(METRICS_FILE)}|{re.escape(REPORT_FILE)}"
    rf"|{re.escape(PLOT_FILE)})\.tmp(-\d+)?$"
)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):  # (``$`` would let a final newline through)
        raise GpuflowError(
            f"run name {name!r} must start with a letter or digit and use only letters, digits, "
            "'.', '_' and '-'"
        )
    return name


def new_run_dir(base_name: str, explicit: bool) -> Path:
    """``runs/<base_name>``, or the first free ``runs/<base_name>-N`` when the name was not
    given explicitly; an explicit name that is taken is an error (work is never overwritten)."""
    check_name(base_name)
    path = RUNS_DIR / base_name
    if not os.path.lexists(path):  # (a link to nothing takes the name too)
        return path
    if explicit and path.is_symlink():
        raise GpuflowError(
            f"{path} is a link to {os.readlink(path)}; gpuflow makes its run folders itself "
            "and never follows a link: pass another --name"
        )
    if explicit:
        if (path / CONFIG_FILE).is_file() and not (path / PROFILE_FILE).exists():
            raise GpuflowError(
                f"{path} already exists; pass --resume to continue it, or another --name"
            )
        # a bench's or a profile's folder, or one of the user's: nothing to resume
        raise GpuflowError(f"{path} already exists and is not a gpuflow run; pass another --name")
    n = 2
    while os.path.lexists(RUNS_DIR / f"{base_name}-{n}"):
        n += 1
    return RUNS_DIR / f"{base_name}-{n}"


def latest_run_dir() -> Path:
    """The run whose metrics or config changed last, for ``--resume`` without ``--name``."""
    runs = [
        p
        for p in (RUNS_DIR.iterdir() if RUNS_DIR.is_dir() else [])
        if (p / CONFIG_FILE).is_file() and not (p / PROFILE_FILE).exists()
    ]
    if not runs:
        raise GpuflowError(f"there is no run in {RUNS_DIR}/ to resume; start one without --resume")

    def last_active(run: Path) -> float:
        return max(
            (run / f).stat().st_mtime for f in (CONFIG_FILE, METRICS_FILE) if (run / f).exists()
        )

    return max(runs, key=last_active)


def open_run(path: Path | str) -> tuple[Path, RunConfig]:
    """An existing run folder and its config; refuses folders that are not runs."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if path.is_symlink():  # a resume would write, and prune checkpoints, where it points
        raise GpuflowError(
            f"run folder {path} is a link (to {os.readlink(path)}); gpuflow uses a run's own "
            "folder, never one through a link: pass the folder itself"
        )
    if not path.is_dir():
        raise GpuflowError(f"run folder {path} does not exist; runs live in {RUNS_DIR}/<name>")
    if not config_path.is_file() or (path / PROFILE_FILE).exists():
        raise GpuflowError(
            f"{path} is not a gpuflow run (it has no {CONFIG_FILE}); pass a folder made by "
            "`gpuflow train`, such as runs/tiny"
        )
    if config_path.is_symlink():
        raise GpuflowError(
            f"{config_path} is a link; gpuflow reads only a run's own files, never through a "
            "link: put the file itself there"
        )
    values = load_toml(config_path)
    name = values.get("preset", "tiny")
    if not isinstance(name, str):
        raise GpuflowError(
            f"{config_path}: preset must be a string naming a preset ({', '.join(PRESETS)}), "
            f'got {name!r}; write it as preset = "tiny", say'
        )
    config = apply_overrides(preset(name), values, str(config_path))
    return path, config


def resumed_config(
    run_dir: Path,
    sets: list[str] | tuple[str, ...] = (),
    steps: int | None = None,
    preset_name: str | None = None,
    config_file: str | None = None,
) -> RunConfig:
    """The config a resumed run trains with: its saved one with ``--set``/``--steps``
    applied. A ``--preset``/``--config`` is accepted when it gives that same config (the
    original command with ``--resume`` added); a learning-rate schedule that would jump at
    the resumed step because ``steps`` changed is refused, with the two ways to go on."""
    _, saved = open_run(run_dir)
    changes = [parse_set(a) for a in sets] + ([{"train": {"steps": steps}}] if steps else [])
    sets = [*sets, *([f"train.steps={steps}"] if steps else [])]

    def with_changes(config: RunConfig) -> RunConfig:
        return apply_sets(config, sets)  # validated once, with every change in place

    config = with_changes(saved)
    if config.model != saved.model:  # the checkpoint's weights have the run's shapes
        raise GpuflowError(
            f"a resumed run keeps its model, and {_first_difference(saved, config)}; drop that "
            "--set, or train the other shape as a new run (another --name)"
        )
    if preset_name or config_file:
        given = with_changes(resolve_config(preset_name, config_file))
        if given != config:
            raise GpuflowError(
                f"--resume continues a run with its own saved config, and {run_dir}'s differs "
                f"from this --preset/--config ({_first_difference(config, given)}); drop "
                "--preset/--config (use --set to change a setting)"
            )
    explicit = any("decay_steps" in c.get("train", {}) for c in changes)
    old, new = saved.train, config.train
    at = ckpt.latest_step(run_dir)
    # Fewer steps than it trained: told here, where the schedule it trained with is known (a
    # run at its end is told once its data are checked, by the trainer).
    if at > new.steps:
        raise GpuflowError(finished_run(run_dir, at, new.steps, old))
    if old.schedule_steps != new.schedule_steps and not explicit:
        stretched = replace(old, steps=new.steps)  # the change of length alone
        before, after = lr_at(at, old), lr_at(at, stretched)
        if abs(after - before) > 1e-3 * before:
            raise GpuflowError(
                f"{run_dir} was scheduled over {old.schedule_steps} steps and stopped at step "
                f"{at}; with {new.steps} its next step would train at {after:.2e} where its "
                f"schedule puts {before:.2e}. Add --set train.decay_steps={old.schedule_steps} "
                f"to keep the schedule (the steps after it train at "
                f"{lr_at(old.schedule_steps, old):.2e}), or --set train.decay_steps={new.steps} "
                f"to stretch it over all {new.steps} steps, taking that jump"
            )
    return config


def _first_difference(saved: RunConfig, given: RunConfig) -> str:
    for section in ("model", "train", "data"):
        a, b = getattr(saved, section), getattr(given, section)
        for key in a.__dataclass_fields__:
            if getattr(a, key) != getattr(b, key):
                return (
                    f"{section}.{key} is {getattr(a, key)!r} in the run, {getattr(b, key)!r} here"
                )
    return f"preset {saved.preset!r} in the run, {given.preset!r} here"


def write_config(run_dir: Path, config: RunConfig) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / CONFIG_FILE, to_toml(config))


def copy_tokenizer(run_dir: Path, tokenizer_path: Path | None) -> None:
    """The data's tokenizer.json into the run, unless the run has its own already; a link
    there (dangling or not) is refused, never written through."""
    target = run_dir / TOKENIZER_FILE
    if tokenizer_path is None:
        return
    check_replaceable(target)
    if not target.exists():
        write_atomic(target, [tokenizer_path.read_bytes()])


def check_own_files(run_dir: Path) -> None:
    """Refuse, in one line, a run where a file gpuflow writes is a link or not a regular file
    (a planted link would send its writes out of the run)."""
    for name in OWN_FILES:
        check_replaceable(run_dir / name)


def _parse_metrics(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The records of ``path`` and whether its last line was torn (a crash mid-append: the
    line is dropped). A damaged line elsewhere is an error naming it."""
    if not path.is_file():
        return [], False
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if _is_record(record):
            records.append(record)
        elif number == len(lines):
            return records, True
        else:
            raise GpuflowError(
                f"{path}:{number} is not a metrics record; delete that line and try again"
            )
    return records, False


# The figures a record's readers compare and draw: numbers (or null) wherever they appear.
_FIGURES = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "val_loss", "val_bpb")


def _is_record(record: Any) -> bool:
    """A metrics record as gpuflow writes it: an object with a whole step number and its
    figures numbers (a line edited by hand to hold text there would fail the report)."""
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        return False
    return all(
        record[key] is None or type(record[key]) in (int, float)
        for key in _FIGURES
        if key in record
    )


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics records, a torn last line left out."""
    return _parse_metrics(Path(run_dir) / METRICS_FILE)[0]


def truncate_metrics(run_dir: Path, last_step: int) -> bool:
    """Drop records past ``last_step`` (steps a resumed run will train again) and a torn last
    line; returns whether there was one."""
    records, torn = _parse_metrics(Path(run_dir) / METRICS_FILE)
    kept = [r for r in records if r["step"] <= last_step]
    write_text_atomic(run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))
    return torn


class MetricsLog:
    """Appends one JSON record per line and flushes it, so a crash loses at most one line.
    The file is a regular one or made new: never a link (``O_NOFOLLOW``)."""

    def __init__(self, run_dir: Path) -> None:
        path = Path(run_dir) / METRICS_FILE
        check_replaceable(path)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        self._file = open(os.open(path, flags, 0o644), "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


class RunFolder:
    """``runs/<name>`` while this process trains in it (see the module docstring).

    with RunFolder(path, resume) as folder:   # a resumed run is locked and cleaned here
        ...                                   # read its checkpoint, open the data
        folder.start(config, tokenizer)       # a new run's folder appears only now
        ...                                   # train; an error before the first
                                              # checkpoint undoes what start() wrote
    """

    def __init__(self, path: Path, resume: bool, say: Callable[[str], None] = print) -> None:
        self.path = Path(path)
        self.resume = resume
        self.say = say
        self._lock_fd: int | None = None
        self._started = False
        self._config_before: str | None = None
        self._checkpoints_before: list[Path] = []

    def __enter__(self) -> RunFolder:
        if self.resume and self.path.is_dir():
            self._lock()
            try:  # before anything is read or removed:
                ckpt.check_checkpoint_folder(self.path)
                check_own_files(self.path)
                self._clean()
            except BaseException:
                self._unlock()
                raise
        return self

    def start(self, config: RunConfig, tokenizer_path: Path | None) -> None:
        """Create (a new run) or take over (a resumed one) the folder and write its config."""
        if not self.resume:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.path.mkdir()
            except FileExistsError:
                raise GpuflowError(
                    f"{self.path} was created by someone else while this run started; "
                    "pass another --name"
                ) from None
            self._lock()
        else:
            config_path = self.path / CONFIG_FILE
            self._config_before = config_path.read_text() if config_path.is_file() else None
            self._checkpoints_before = ckpt.list_checkpoints(self.path)
        self._started = True
        write_config(self.path, config)
        copy_tokenizer(self.path, tokenizer_path)

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        try:
            # An error rolls back; a second Ctrl-C (KeyboardInterrupt) keeps what is there,
            # a write perhaps still running: --resume carries on from it.
            if exc_type is not None and issubclass(exc_type, Exception) and self._started:
                self._roll_back()
        finally:
            self._unlock()

    def _roll_back(self) -> None:
        """Undo what ``start`` did when nothing worth keeping came of it: a resumed run's
        config goes back unless a new checkpoint was saved; a new run's folder is removed
        unless it holds a checkpoint (a best one counts: it is the run's best weights).
        Temporaries are left to the next start: a write may still be running."""
        if ckpt.list_checkpoints(self.path) != self._checkpoints_before:
            return
        if self.resume:
            if self._config_before is not None:
                write_text_atomic(self.path / CONFIG_FILE, self._config_before)
            return
        if ckpt.best_checkpoint(self.path) is not None:
            return
        for name in OWN_FILES:
            if _regular_file(self.path / name):  # gpuflow's own: never a link put there
                (self.path / name).unlink()
        with suppress(OSError):  # not empty: a write was abandoned, or someone added a file
            ckpt.checkpoint_dir(self.path).rmdir()
        with suppress(OSError):
            self.path.rmdir()
            self.say(f"removed {self.path}: the run failed before its first checkpoint")

    def _clean(self) -> None:
        """Remove what a killed process of this folder left (the lock says none is alive)."""
        handled = ckpt.remove_stale_temporaries(self.path)
        for path in self.path.iterdir():
            if _OWN_TEMPORARY.match(path.name) and _regular_file(path):
                path.unlink()
                handled.append(path.name)
        if handled:
            fsync_dir(self.path)
            self.say(f"removed what an interrupted run left in {self.path}: {', '.join(handled)}")

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # no advisory locks on this platform: the folder goes unguarded
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = lock_holder(self.path)
            raise GpuflowError(
                f"{self.path} is in use by another gpuflow process"
                + (f" (PID {holder})" if holder is not None else "")
                + "; wait for it to finish, or pass another --name"
            ) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            if _kept_locks is not None:  # the command goes on writing to the run
                _kept_locks.append(self._lock_fd)
            else:
                os.close(self._lock_fd)  # closing the descriptor releases the lock
            self._lock_fd = None


# Locks of run folders whose RunFolder has ended but whose command has not (see
# ``locks_kept``); None outside such a command.
_kept_locks: list[int] | None = None


@contextmanager
def locks_kept() -> Iterator[None]:
    """Within this block, a ``RunFolder``'s lock outlives it until the block ends: ``gpuflow
    train`` writes the run's report after training, and is its one writer until then."""
    global _kept_locks
    outer, _kept_locks = _kept_locks, []
    try:
        yield
    finally:
        kept, _kept_locks = _kept_locks, outer
        for fd in kept:
            os.close(fd)


def lock_holder(path: Path) -> int | None:
    """The PID of the process holding ``flock`` on ``path``, from Linux's /proc/locks; None
    where it cannot be told (another system, or a holder outside this PID namespace)."""
    try:
        info = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    holders = {}  # by the "major:minor:inode" of what each holds
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146493 0 EOF" (blocked waiters: "-> ...")
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4].isdigit():
            holders[fields[5]] = int(fields[4])
    # Some file systems (overlays) report another device there than stat does: then the
    # inode alone, where one holder has it.
    same_inode = [pid for key, pid in holders.items() if key.endswith(f":{info.st_ino}")]
    pid = holders.get(device) or (same_inode[0] if len(same_inode) == 1 else 0)
    return pid or None


def _regular_file(path: Path) -> bool:
    """A regular file, not a link to one."""
    return path.is_file() and not path.is_symlink()
