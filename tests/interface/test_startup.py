"""The command line answers --help without loading torch, which takes seconds to import."""

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
