"""The tally: copies the transfer layer reports on a thread's behalf reach the listeners of that
thread only, and its own housekeeping is marked while it runs."""

from __future__ import annotations

import threading

import numpy as np

from gpuflow.accounting.ledger import TransferLedger
from gpuflow.accounting.tally import (
    housekeeping,
    in_housekeeping,
    listen,
    report_copy,
    stop_listening,
)
from gpuflow.transfer.loader import DeviceLoader


def test_a_report_reaches_every_listener_of_its_thread_until_it_stops_listening():
    first: list[tuple] = []
    second: list[tuple] = []

    def hear_first(*report: object) -> None:
        first.append(report)

    def hear_second(*report: object) -> None:
        second.append(report)

    listen(hear_first)
    listen(hear_second)
    try:
        report_copy("h2d", 4096, "DeviceLoader batch", "uint8", True)
        stop_listening(hear_first)
        report_copy("d2h", 8, "AsyncScalars")
    finally:
        stop_listening(hear_second)
    report_copy("h2d", 1, "nobody listens")
    assert first == [("h2d", 4096, "DeviceLoader batch", "uint8", True)]
    assert second == [
        ("h2d", 4096, "DeviceLoader batch", "uint8", True),
        ("d2h", 8, "AsyncScalars", None, None),
    ]


def test_a_report_made_on_another_thread_is_not_heard_here():
    heard: list[tuple] = []

    def listener(*report: object) -> None:
        heard.append(report)

    listen(listener)
    try:
        thread = threading.Thread(target=report_copy, args=("h2d", 64, "elsewhere"))
        thread.start()
        thread.join()
        report_copy("h2d", 32, "here")
    finally:
        stop_listening(listener)
    assert heard == [("h2d", 32, "here", None, None)]


def test_housekeeping_nests_and_belongs_to_its_thread():
    assert not in_housekeeping()
    seen_elsewhere: list[bool] = []
    with housekeeping():
        with housekeeping():
            assert in_housekeeping()
        assert in_housekeeping()  # the outer region is still open
        thread = threading.Thread(target=lambda: seen_elsewhere.append(in_housekeeping()))
        thread.start()
        thread.join()
    assert not in_housekeeping()
    assert seen_elsewhere == [False]


def test_an_open_ledger_counts_what_the_loader_reports_when_a_batch_is_taken():
    batches = [np.arange(12, dtype=np.int64).reshape(3, 4) for _ in range(3)]
    with DeviceLoader(batches, "cpu") as loader, TransferLedger("cpu") as ledger:
        taken = list(loader)
    assert len(taken) == 3
    reported = [e for e in ledger.events if e.op == "DeviceLoader batch"]
    assert len(reported) == 3 and all(e.kind == "h2d" and e.nbytes > 0 for e in reported)
