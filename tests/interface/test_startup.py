"""The command line answers --help without loading torch, which takes seconds to import, and
says a Ctrl-C while it loads in a word."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import child_env


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["bench", "transfer", "--help"]])
def test_help_does_not_load_torch(tmp_path, argv):
    code = (
        "import sys\n"
        "from gpuflow.interface.cli.main import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    assert "usage:" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "False"


def test_ctrl_c_while_the_commands_load_is_said_in_a_word(monkeypatch, capsys):
    """Loading the commands takes a fifth of a second, long enough for a Ctrl-C."""
    from gpuflow.interface.cli import main as cli
    from gpuflow.interface.cli.common import EXIT_INTERRUPTED

    def interrupted(sub: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.COMMANDS[-1], "add_parser", interrupted)
    assert cli.main(["info"]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "interrupted\n"
