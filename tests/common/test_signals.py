"""Signal handlers for the length of a block: installed, called, and the old ones put back."""

from __future__ import annotations

import os
import signal
import threading

from gpuflow.common.signals import handling


def test_the_handler_runs_inside_the_block_and_the_old_one_is_back_after():
    before = signal.getsignal(signal.SIGUSR1)
    caught: list[int] = []
    with handling([signal.SIGUSR1, signal.SIGUSR2], lambda signum, frame: caught.append(signum)):
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
    assert caught == [signal.SIGUSR1, signal.SIGUSR2]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_the_old_handler_is_back_when_the_block_raises():
    before = signal.getsignal(signal.SIGUSR1)
    try:
        with handling([signal.SIGUSR1], lambda signum, frame: None):
            raise ValueError("the block failed")
    except ValueError:
        pass
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_handler_set_inside_the_block_stays_after_it():
    """A job being left sets SIGTERM to be ignored inside the trainer's block: leaving the
    block keeps that, not the handler from before it."""
    before = signal.getsignal(signal.SIGUSR1)
    try:
        with handling([signal.SIGUSR1], lambda signum, frame: None):
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_off_the_main_thread_nothing_changes_and_the_block_still_runs():
    before = signal.getsignal(signal.SIGUSR1)
    seen: list[object] = []

    def body() -> None:
        with handling([signal.SIGUSR1], lambda signum, frame: None):
            seen.append(signal.getsignal(signal.SIGUSR1))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=10)
    assert seen == [before]  # Python allows no handler there: the block ran unchanged
