"""Live training progress: a status line fitted to the terminal, or plain lines elsewhere.

On a terminal the line always shows the step count, train and validation loss, tokens/s and
the time left, uncut at 80 columns; MFU, validation bits per byte and a bar take the room
that is left, in that order (the bar repeats the step count). Bus figures
(bytes each way, host syncs, cudaMalloc per step) join it once one of them is not zero, or
always when asked for. Anywhere else each record is one whole line: `step 120/300 loss ...`.
"""

from __future__ import annotations

from time import monotonic
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from gpuflow.common.console import err_console

BAR_MIN, BAR_MAX = 10, 40  # a bar narrower than BAR_MIN says nothing: leave it out
SEP = "  "
BUS_KEYS = ("h2d_bytes_per_step", "d2h_bytes_per_step", "syncs_per_step", "device_allocs_per_step")


def _fmt_rate(tokens_per_s: float | None) -> str:
    if tokens_per_s is None:
        return "-"
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.3g} B"  # a readback spread over an interval is a fraction of a byte a step


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _fmt_bus(bus: dict[str, float]) -> str:
    return SEP.join(
        (
            f"h2d {_fmt_bytes(bus['h2d_bytes_per_step'])}/step",
            f"d2h {_fmt_bytes(bus['d2h_bytes_per_step'])}/step",
            f"{bus['syncs_per_step']:g} syncs/step",
            f"{bus['device_allocs_per_step']:g} cudaMalloc/step",
        )
    )


class TrainDisplay:
    """Shows step, loss, validation loss and bits per byte, tokens/s, ETA, MFU and bus traffic
    while training.

    `console` is where it draws (stderr by default); it is live only on a terminal.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        show_bus: bool = False,
        console: Console | None = None,
    ) -> None:
        self.console = console or err_console
        self.total = total_steps
        self.completed = start_step
        self.show_bus = show_bus
        self.loss: float | None = None
        self.val_loss: float | None = None
        self.val_bpb: float | None = None  # None: the run's bytes were not counted
        self.rate: float | None = None
        self.mfu: float | None = None
        self.bus: dict[str, float] | None = None  # the latest measured figures
        self._bus_nonzero = False  # once seen, the figures stay, so a return to 0 shows
        # (time, step) at the first and latest step(): the rate for the ETA leaves out the
        # set-up, compilation and capture that come before the first interval closes.
        self._first: tuple[float, int] | None = None
        self._last: tuple[float, int] | None = None
        self._spinner: Spinner | None = Spinner("dots", style="progress.spinner")
        self._live: Live | None = None
        if self.console.is_terminal:
            self._live = Live(self, console=self.console, refresh_per_second=4)

    def __enter__(self) -> TrainDisplay:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._spinner = None  # the last frame stays on the terminal: nothing spins there
        if self._live is not None:
            self._live.stop()

    def step(self, completed: int) -> None:
        if self._last is not None and completed <= self._last[1]:
            return
        now = monotonic()
        if self._first is None:
            self._first = (now, completed)
        self._last = (now, completed)
        self.completed = completed

    def record(self, record: dict[str, Any]) -> None:
        if "val_loss" in record:
            self.val_loss = record["val_loss"]
            self.val_bpb = record.get("val_bpb")
        else:
            self.step(record["step"])  # its step is done; the trainer may say so only after
            self.loss = record["loss"]
            self.rate = record.get("tokens_per_s")
            self.mfu = record.get("mfu")
            if all(key in record for key in BUS_KEYS):
                self.bus = {key: record[key] for key in BUS_KEYS}
                self._bus_nonzero = self._bus_nonzero or any(self.bus.values())
        if self._live is None:
            self.console.print(self._plain_line(record), soft_wrap=True)

    def note(self, message: str) -> None:
        self.console.print(message, markup=False)  # plain text: "gpuflow[gds]" stays whole

    # ---- what is shown ---------------------------------------------------------------------

    def eta_seconds(self, now: float | None = None) -> float | None:
        """Seconds left at the rate since the first step(), counting down between updates."""
        if self._first is None or self._last is None:
            return None
        (t0, s0), (t1, s1) = self._first, self._last
        if s1 <= s0 or t1 <= t0:
            return None
        left = (self.total - s1) * (t1 - t0) / (s1 - s0)
        return max(0.0, left - ((monotonic() if now is None else now) - t1))

    def _bus_shown(self) -> bool:
        return self.show_bus or self._bus_nonzero

    def _plain_line(self, record: dict[str, Any]) -> str:
        step = f"step {record['step']:>{len(str(self.total))}}/{self.total}"
        if "val_loss" in record:
            line = f"{step}{SEP}val loss {record['val_loss']:.4f}"
            bpb = record.get("val_bpb")
            return line if bpb is None else f"{line}{SEP}bpb {bpb:.4f}"
        parts = [step, f"loss {record['loss']:.4f}", f"{_fmt_rate(self.rate)} tok/s"]
        if self.mfu is not None:
            parts.append(f"MFU {self.mfu:.1%}")
        parts.append(f"eta {_fmt_duration(self.eta_seconds())}")
        if self._bus_shown() and all(key in record for key in BUS_KEYS):
            parts.append(_fmt_bus(record))
        return SEP.join(parts)

    def lines(self, width: int, now: float | None = None) -> list[Text]:
        """The live display at `width` columns: what must show first, then what has room."""
        now = monotonic() if now is None else now

        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.4f}"

        # Fields keep their width as their values change, so that the line does not jitter.
        parts = [
            f"step {self.completed:>{len(str(self.total))}}/{self.total}",
            f"loss {fmt(self.loss):>6}",
            f"val {fmt(self.val_loss):>6}",
            f"{_fmt_rate(self.rate):>6} tok/s",
            f"eta {_fmt_duration(self.eta_seconds(now))}",
        ]
        room = width - 2 - cell_len(SEP.join(parts))  # after the spinner and its space
        if self.mfu is not None:
            mfu = f"MFU {self.mfu:>5.1%}"
            if len(SEP + mfu) <= room:
                parts.insert(-1, mfu)
                room -= len(SEP + mfu)
        if self.val_bpb is not None:
            bpb = f"bpb {fmt(self.val_bpb):>6}"
            if len(SEP + bpb) <= room:
                parts.insert(3, bpb)  # beside the validation loss it is measured from
                room -= len(SEP + bpb)
        below = None
        if self._bus_shown():
            bus = _fmt_bus(self.bus) if self.bus is not None else "bus not measured yet"
            if cell_len(SEP + bus) + len(SEP) + BAR_MIN <= room:  # fits beside a bar
                parts.append(bus)
                room -= cell_len(SEP + bus)
            else:
                below = Text(f"  {bus}")
        bar_width = min(BAR_MAX, room - len(SEP))
        spinner = " " if self._spinner is None else self._spinner.render(now)
        line = Text.assemble(spinner, " ", parts[0])
        if bar_width >= BAR_MIN:
            line.append(SEP)
            line.append_text(self._bar(bar_width))
        for part in parts[1:]:
            line.append(SEP + part)
        return [line] if below is None else [line, below]

    def _bar(self, width: int) -> Text:
        done = round(width * min(1.0, self.completed / self.total)) if self.total else width
        style = "bar.finished" if done == width else "bar.complete"
        # Two glyphs, so that the bar reads without colour too.
        return Text.assemble(("━" * done, style), ("─" * (width - done), "bar.back"))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.lines(options.max_width)
