"""The ``gpuflow`` command: one module per command (``info``, ``prepare``, ``train``,
``profile``, ``sample``, ``bench``), each adding its parser and running it;
``gpuflow.interface.cli.main`` builds the parser and turns what a command raises into one
line and an exit status."""
