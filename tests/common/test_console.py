"""The consoles and tables every command prints with, off a terminal and at 80 columns."""

from __future__ import annotations

import io

from rich.console import Console

from gpuflow.common.console import out_console, table


def test_off_a_terminal_a_long_line_is_not_wrapped(piped):
    line = " ".join(f"word{i:03d}" for i in range(25))  # 199 characters
    out_console.print(line)
    assert piped.readouterr().out == line + "\n"


def test_off_a_terminal_a_ten_column_table_is_whole(piped):
    headers = [f"column number {i}" for i in range(10)]
    figures = [f"{1_234_567.8 * (i + 1):,.1f}" for i in range(10)]
    grid = table(*headers, title="ten columns")
    grid.add_row(*figures)
    out_console.print(grid)
    out = piped.readouterr().out
    assert "…" not in out
    header, _, row = out.splitlines()[1:4]
    assert header.split() == " ".join(headers).split()  # each header on one line
    assert row.split() == figures


def test_at_80_columns_a_ten_column_table_wraps_headers_and_keeps_figures_whole():
    console = Console(file=io.StringIO(), force_terminal=True, width=80, color_system=None)
    headers = ["data path", "tokens/s", "MFU", "h2d bytes per step", "d2h bytes per step"]
    headers += ["syncs per step", "allocs per step", "vs naive", "vs standard", "overhead"]
    figures = ["2,123,984", "46.0%", "8,256", "0.8", "0", "0", "482.2x", "5.58x", "+0.5%"]
    grid = table(*headers)
    grid.add_row("resident-graph (synthetic batch)", *figures)
    console.print(grid)
    lines = console.file.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "…" not in "".join(lines)
    rule = next(i for i, line in enumerate(lines) if line.startswith("─"))
    assert rule >= 2 and "step" in lines[rule - 1]  # headers wrapped onto more lines
    assert lines[rule + 1].split()[-9:] == figures  # each figure whole, on the row's first line
