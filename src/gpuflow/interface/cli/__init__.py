"""The ``gpuflow`` command: one module per command (``info``, ``prepare``, ``train``,
``profile``, ``sample``, ``bench``), each adding its parser and running it; ``main`` turns
what they raise into one line and an exit status."""

from gpuflow.interface.cli.main import main

__all__ = ["main"]
