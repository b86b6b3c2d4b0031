"""Live training progress: a rich bar on a terminal, one plain line per record elsewhere."""

from __future__ import annotations

from typing import Any

from rich.progress import Progress, TextColumn

from gpuflow.console import err_console, progress_bar


def _fmt_rate(tokens_per_s: float | None) -> str:
    if tokens_per_s is None:
        return "-"
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


class TrainDisplay:
    """Shows step, loss, validation loss, tokens/s, MFU, bus traffic and ETA while training."""

    def __init__(self, total_steps: int, start_step: int) -> None:
        self.live = err_console.is_terminal
        self.fields: dict[str, str] = {
            "loss": "-",
            "val": "-",
            "rate": "-",
            "mfu": "-",
            "bus": "-",
        }
        self._progress: Progress | None = None
        if self.live:
            self._progress = progress_bar(
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("val {task.fields[val]}"),
                TextColumn("{task.fields[rate]} tok/s"),
                TextColumn("MFU {task.fields[mfu]}"),
                TextColumn("{task.fields[bus]}"),
            )
            self._task = self._progress.add_task(
                "training", total=total_steps, completed=start_step, **self.fields
            )

    def __enter__(self) -> TrainDisplay:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def step(self, completed: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed)

    def record(self, record: dict[str, Any]) -> None:
        if "val_loss" in record:
            self.fields["val"] = f"{record['val_loss']:.4f}"
        else:
            self.fields["loss"] = f"{record['loss']:.4f}"
            self.fields["rate"] = _fmt_rate(record.get("tokens_per_s"))
            mfu = record.get("mfu")
            self.fields["mfu"] = f"{mfu:.1%}" if mfu is not None else "-"
            if "h2d_bytes_per_step" in record:
                self.fields["bus"] = (
                    f"h2d {_fmt_bytes(record['h2d_bytes_per_step'])}/step, "
                    f"d2h {_fmt_bytes(record['d2h_bytes_per_step'])}/step, "
                    f"{record['syncs_per_step']:g} syncs, "
                    f"{record['device_allocs_per_step']:g} cudaMalloc"
                )
        if self._progress is not None:
            self._progress.update(self._task, **self.fields)
        elif "val_loss" in record:
            err_console.print(f"step {record['step']:>6}  val loss {self.fields['val']}")
        else:
            err_console.print(
                f"step {record['step']:>6}  loss {self.fields['loss']}  {self.fields['rate']} tok/s"
                f"  MFU {self.fields['mfu']}  {self.fields['bus']}"
            )

    def note(self, message: str) -> None:
        err_console.print(message)
