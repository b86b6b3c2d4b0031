"""What the training display looks like at 80 columns and off a terminal (the tables it prints
with: tests/common/test_console.py)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from gpuflow.train import display as display_module
from gpuflow.train.display import TrainDisplay

TRAIN = {"step": 120, "loss": 5.1234, "grad_norm": 0.9, "lr": 3e-4, "tokens_per_s": 10_780.0}
ZERO_BUS = {
    "h2d_bytes_per_step": 0.0,
    "d2h_bytes_per_step": 0.0,
    "syncs_per_step": 0.0,
    "device_allocs_per_step": 0.0,
}
STREAMED_BUS = {**ZERO_BUS, "h2d_bytes_per_step": 8256.0, "d2h_bytes_per_step": 0.8}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def clock(monkeypatch):
    """The display's clock, moved by hand: 60 steps in the first 10 seconds, 6 steps/s."""
    now = [100.0]
    monkeypatch.setattr(display_module, "monotonic", lambda: now[0])
    return now


def terminal(width: int) -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=width, color_system="truecolor")


def last_frame(console: Console, lines: int) -> list[str]:
    """The last `lines` lines the live display left on the terminal, escape codes removed."""
    text = ANSI.sub("", console.file.getvalue()).replace("\r", "\n")
    return [line for line in text.split("\n") if line.strip()][-lines:]


def train(console: Console | None, record: dict, show_bus=False, clock=None) -> TrainDisplay:
    """Steps 60 and 120 of 300, ten seconds apart, with a validation pass and a train record."""
    with TrainDisplay(300, 0, show_bus=show_bus, console=console) as shown:
        shown.record({"step": 0, "val_loss": 8.3173})
        shown.step(60)
        if clock is not None:
            clock[0] += 10
        shown.step(120)
        shown.record(record)
        shown.record({"step": 120, "val_loss": 5.4321})
    return shown


def test_the_line_at_80_columns_shows_step_losses_rate_and_eta_uncut(clock):
    console = terminal(80)
    train(console, {**TRAIN, "mfu": None}, clock=clock)
    [line] = last_frame(console, 1)
    assert len(line) <= 80
    for shown in ("step 120/300", "loss 5.1234", "val 5.4321", "10.8k tok/s", "eta 0:00:30"):
        assert shown in line
    assert "…" not in line
    assert "━" in line  # the room left on a CPU run (no MFU) holds a bar
    assert "h2d" not in line and "cudaMalloc" not in line  # bus all zero: not shown


def test_mfu_comes_before_the_bar_at_80_columns_and_both_show_at_120(clock):
    record = {**TRAIN, "mfu": 0.4567}
    narrow, wide = terminal(80), terminal(120)
    train(narrow, record, clock=clock)
    [line] = last_frame(narrow, 1)
    assert "MFU 45.7%" in line and "eta 0:00:30" in line and len(line) <= 80
    shown = train(wide, record, clock=clock)
    [line] = last_frame(wide, 1)
    assert "MFU 45.7%" in line and "step 120/300" in line and "…" not in line
    assert "━" * 10 in line and len(line) <= 120
    [at_200] = shown.lines(200)
    assert at_200.plain[2:] == line.rstrip()[2:]  # past the spinner: the same as at 120


def test_bus_figures_show_when_not_zero_on_their_own_line_at_80_columns(clock):
    console = terminal(80)
    train(console, {**TRAIN, "mfu": 0.4567, **STREAMED_BUS}, clock=clock)
    first, bus = last_frame(console, 2)
    assert "step 120/300" in first and "loss 5.1234" in first
    assert bus.strip() == "h2d 8.3 kB/step  d2h 0.8 B/step  0 syncs/step  0 cudaMalloc/step"
    assert len(bus) <= 80


def test_bus_figures_show_at_zero_when_asked_for(clock):
    console = terminal(80)
    train(console, {**TRAIN, **ZERO_BUS}, show_bus=True, clock=clock)
    _, bus = last_frame(console, 2)
    assert "h2d 0 B/step" in bus and "0 cudaMalloc/step" in bus
    quiet = terminal(80)
    train(quiet, {**TRAIN, **ZERO_BUS}, clock=clock)
    assert "h2d" not in quiet.file.getvalue()


def test_bus_figures_join_the_line_on_a_wide_terminal(clock):
    console = terminal(200)
    train(console, {**TRAIN, **STREAMED_BUS}, clock=clock)
    [line] = last_frame(console, 1)
    assert "loss 5.1234" in line and "h2d 8.3 kB/step" in line and "━" in line


def test_off_a_terminal_each_record_is_one_whole_line_with_step_and_total(piped, clock):
    train(None, {**TRAIN, "mfu": 0.4567, **STREAMED_BUS}, clock=clock)
    assert piped.readouterr().err.splitlines() == [
        "step   0/300  val loss 8.3173",
        "step 120/300  loss 5.1234  10.8k tok/s  MFU 45.7%  eta 0:00:30  "
        "h2d 8.3 kB/step  d2h 0.8 B/step  0 syncs/step  0 cudaMalloc/step",
        "step 120/300  val loss 5.4321",
    ]


def test_validation_bits_per_byte_shows_beside_the_validation_loss(piped, clock):
    def run(console):
        with TrainDisplay(300, 0, console=console) as shown:
            shown.record({"step": 0, "val_loss": 8.3173, "val_bpb": 3.1234})
            shown.step(60)
            clock[0] += 10
            shown.step(120)
            shown.record({**TRAIN, "mfu": None})
        return shown

    console = terminal(80)
    run(console)
    [line] = last_frame(console, 1)
    assert "val 8.3173  bpb 3.1234  " in line and len(line) <= 80
    assert "eta 0:00:30" in line  # what always shows is still there
    shown = run(None)
    assert piped.readouterr().err.splitlines()[0] == "step   0/300  val loss 8.3173  bpb 3.1234"
    [wide] = shown.lines(120)
    assert "bpb 3.1234" in wide.plain and "━" * 10 in wide.plain  # room for the bar too
