"""Terminal output shared by every command: progress on stderr, results on stdout."""

from __future__ import annotations

from rich.console import Console
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

# Progress and status go to stderr so that stdout carries only results (tables, JSON, text).
err_console = Console(stderr=True, highlight=False)
out_console = Console(highlight=False)


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
