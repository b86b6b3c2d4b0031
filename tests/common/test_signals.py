"""Signal handlers for the length of a block: installed, called, and the old ones put back;
interrupts held while a child process starts, and settled in the child."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest

from gpuflow.common.signals import (
    handling,
    interrupts_deferred,
    interrupts_held,
    take_interrupts_in_child,
)


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


def test_an_interrupt_in_a_held_block_reaches_the_handler_there_was_once_it_ends():
    caught: list[int] = []
    with handling([signal.SIGTERM], lambda signum, frame: caught.append(signum)):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # bytecodes at which Python would run a handler
                pass
            assert caught == []
        assert caught == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_in_a_held_block_raises_after_it():
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        reached_the_end = True
    assert reached_the_end


def test_a_deferred_block_raises_its_ctrl_c_after_it_and_leaves_the_mask_alone():
    """For a child started with subprocess, which must take its signals as usual."""
    mask = (
        signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else None
    )
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt), interrupts_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes at which Python would run a handler
            pass
        if mask is not None:
            assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
        reached_the_end = True
    assert reached_the_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _report_interrupts(conn) -> None:
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    take_interrupts_in_child()
    conn.send(
        (blocked, signal.pthread_sigmask(signal.SIG_BLOCK, []), signal.getsignal(signal.SIGINT))
    )


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no signal masks here")
def test_a_child_started_in_a_held_block_boots_with_interrupts_blocked_until_its_entry():
    """A Ctrl-C at a terminal reaches the child too: while it boots, the signal waits; at its
    entry point Ctrl-C is ignored (the parent stops it) and SIGTERM is taken again."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    with interrupts_held():
        child = context.Process(target=_report_interrupts, args=(theirs,))
        child.start()
    assert ours.poll(60)
    booted_with, after_entry, on_ctrl_c = ours.recv()
    child.join(30)
    assert {signal.SIGINT, signal.SIGTERM} <= booted_with
    assert not {signal.SIGINT, signal.SIGTERM} & after_entry
    assert on_ctrl_c == signal.SIG_IGN
    assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])
