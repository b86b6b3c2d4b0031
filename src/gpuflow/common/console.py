"""Terminal output shared by every command: progress on stderr, results on stdout.

On a terminal, output is laid out for its width, down to 80 columns. Anywhere else (a file,
a pipe, a CI log) nobody reads it at a fixed width, so lines and tables go out whole: never
wrapped, never cut short with an ellipsis.
"""

from __future__ import annotations

import os
import signal
from contextlib import suppress

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleDimensions, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

# Wide enough that no line or table of ours is ever wrapped; rich pads nothing we print to it.
UNBOUNDED_WIDTH = 100_000


class _Console(Console):
    """A rich Console that lays out for the terminal's width, or without limit off a terminal.

    Off a terminal rich would take COLUMNS, another stream's terminal or 80 columns, and
    hard-wrap logs and ellipsize tables to that.
    """

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self.is_terminal else ConsoleDimensions(UNBOUNDED_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)

    def on_broken_pipe(self) -> None:
        """Whoever read this stream has gone (``gpuflow train | head``): write nothing more
        to it and stop the command as Ctrl-C would, so that a run stops at its next step with
        a checkpoint. Rich's own answer, exiting at once, would lose the steps since the last
        one and leave a run folder with no checkpoint at all."""
        self.quiet = True
        # The stream's descriptor on the null device: Python's own flush of it at exit (and
        # any print elsewhere) then fails no more. (A stream with no descriptor: a test's.)
        with suppress(OSError, ValueError), open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), self.file.fileno())
        signal.raise_signal(signal.SIGINT)


# Progress and status go to stderr so that stdout carries only results (tables, JSON, text).
err_console: Console = _Console(stderr=True, highlight=False)
out_console: Console = _Console(highlight=False)

# A rule under the header, broken between columns, and no other lines: a column costs one
# space, so that ten columns of figures can share 80 terminal columns.
_RULED_HEAD = box.Box(
    "    \n"  # top
    "    \n"  # header row
    " ─  \n"  # under the header
    "    \n"  # between rows (unused)
    "    \n"  # body row
    " ─  \n"  # above the footer
    "    \n"  # footer row
    "    \n"  # bottom
)


class _FittedTable(Table):
    """A Table that, short of room, wraps headers first and then cells, widest columns first,
    and never below a column's longest word, so that figures stay whole. Rich alone narrows
    all columns alike and cuts what no longer fits."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths = self._fitted_widths(console, options)
        preset = [column.width for column in self.columns]
        try:
            for column, width in zip(self.columns, widths or preset, strict=True):
                column.width = width
            yield from super().__rich_console__(console, options)
        finally:
            for column, width in zip(self.columns, preset, strict=True):
                column.width = width

    def _fitted_widths(self, console: Console, options: ConsoleOptions) -> list[int] | None:
        room = options.max_width - (len(self.columns) - 1)  # one divider between columns
        whole, header_wrapped, words = [], [], []
        for column in self.columns:
            header = Measurement.get(console, options, column.header)
            cells = [Measurement.get(console, options, cell) for cell in column.cells]
            cell_lines = max((cell.maximum for cell in cells), default=0)
            whole.append(max(header.maximum, cell_lines))
            header_wrapped.append(max(header.minimum, cell_lines))
            words.append(max([header.minimum, *(cell.minimum for cell in cells)]))
        if sum(whole) <= room or sum(words) > room:
            return None  # it fits as it is, or nothing does: rich folds what it must
        if sum(header_wrapped) <= room:
            return _squeeze(header_wrapped, whole, room)
        return _squeeze(words, header_wrapped, room)


def _squeeze(least: list[int], most: list[int], room: int) -> list[int]:
    """Widths between least and most that fit room, taken from the widest columns first."""
    ceiling = max(most)
    while sum(max(lo, min(hi, ceiling)) for lo, hi in zip(least, most, strict=True)) > room:
        ceiling -= 1
    return [max(lo, min(hi, ceiling)) for lo, hi in zip(least, most, strict=True)]


def table(*headers: str, title: str | None = None) -> Table:
    """A results table that reads at 80 columns and is never ellipsized.

    Short of room, headers and cells wrap between words, widest columns first; a figure is
    folded only when the longest words of all columns together are wider than the terminal.
    The table is as wide as its title where the console allows, so the title stays one line.
    """
    grid = _FittedTable(
        box=_RULED_HEAD,
        show_edge=False,
        padding=0,
        title=title,
        min_width=cell_len(title) if title else None,
    )
    for header in headers:
        grid.add_column(header, overflow="fold")
    return grid


def progress_bar(*extra_columns: ProgressColumn, counter: ProgressColumn | None = None) -> Progress:
    """A progress bar on stderr; rich draws nothing live when stderr is not a terminal."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        counter or MofNCompleteColumn(),
        *extra_columns,
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err_console,
        transient=False,
    )
