"""Child processes that end with the process that started them.

A parent killed outright (SIGKILL, or SIGTERM where nothing handles it) runs no clean-up: its
spawned children are handed to init and live on, holding their memory and blocked for good
on a pipe nobody reads."""

from __future__ import annotations

import os
import threading
import time

CHECK_S = 0.5  # how often a child looks for its parent


def exit_with_parent(parent_pid: int) -> None:
    """In a child: end this process once ``parent_pid`` is no longer its parent (a thread
    that looks twice a second; ``os._exit``, as nothing it holds is worth finishing)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="gpuflow-parent-watch", daemon=True).start()
