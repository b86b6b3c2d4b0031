"""What an attacker tried on `gpuflow sample` and `gpuflow export`, each refused in one line
with nothing changed: checkpoints from outside the run, links planted in it, checkpoints
stripped of their checksums or with fields of the wrong kind, a prompt that is not UTF-8, a
saved config whose preset is not a name. Older checkpoints (sizes only) still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpuflow.interface.cli.main import main
from gpuflow.train import checkpoint as ckpt
from tests.helpers import entry_hashes, gpuflow_cli, one_error, two_checkpointed_steps

VICTIM = "the user's own file"
SAMPLE = ["sample", "--run", "runs/r", "--max-tokens", "3", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory) -> Path:
    """runs/r: 2 steps, a checkpoint at each, a best one."""
    return two_checkpointed_steps(prepared, tmp_path_factory.mktemp("sampled"))


@pytest.fixture
def run(trained, workdir) -> Path:
    """A copy of ``trained`` in this test's folder, beside a victim file and a checkpoint
    copied out of the run (``elsewhere/ck``): runs/r."""
    shutil.copytree(trained, workdir / "runs", symlinks=True)
    (workdir / "victim.txt").write_text(VICTIM)
    shutil.copytree(trained / "r" / "checkpoints" / "step_000002", workdir / "elsewhere" / "ck")
    return workdir / "runs" / "r"


def _refused(argv: list[str], workdir: Path, capsys, *said: str) -> str:
    before = entry_hashes(workdir)
    assert main(argv) == 2
    line = one_error(capsys.readouterr().err, *said)
    assert entry_hashes(workdir) == before
    assert (workdir / "victim.txt").read_text() == VICTIM
    return line


# ---- only the run's own checkpoints ---------------------------------------------------------


@pytest.mark.parametrize("given", ["absolute", "relative"])
def test_a_checkpoint_outside_the_run_is_refused(run, workdir, capsys, given):
    path = workdir / "elsewhere" / "ck"
    which = str(path) if given == "absolute" else "../../../elsewhere/ck"  # from checkpoints/
    said = f"--checkpoint {which} is not one of runs/r's checkpoints"
    _refused([*SAMPLE, "--checkpoint", which], workdir, capsys, said, "pass best, latest")


@pytest.mark.parametrize("command", ["sample", "export"])
@pytest.mark.parametrize("which", ["step_000010", "best"])
def test_a_checkpoint_link_planted_in_the_run_is_refused(run, workdir, capsys, command, which):
    if which == "best":
        shutil.rmtree(run / "checkpoints" / "best")
    (run / "checkpoints" / which).symlink_to(workdir / "elsewhere" / "ck")
    argv = SAMPLE if command == "sample" else ["export", "--run", "runs/r", "--out", "hf"]
    said = f"runs/r/checkpoints/{which} is not a checkpoint gpuflow wrote"
    _refused([*argv, "--checkpoint", which], workdir, capsys, said, "move it out")
    assert not (workdir / "hf").exists()


def test_a_checkpoint_named_by_its_path_in_the_run_is_read(run, capsys):
    assert main([*SAMPLE, "--checkpoint", "runs/r/checkpoints/step_000001"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_tokenizer_link_in_the_run_is_refused(run, workdir, capsys):
    shutil.copy(run / "tokenizer.json", workdir / "elsewhere" / "tokenizer.json")
    (run / "tokenizer.json").unlink()
    (run / "tokenizer.json").symlink_to(workdir / "elsewhere" / "tokenizer.json")
    _refused(SAMPLE, workdir, capsys, "runs/r/tokenizer.json is a link")


# ---- checksums and fields -------------------------------------------------------------------


def _edit_record(folder: Path, change, rehash: bool = False) -> None:
    record = json.loads((folder / "state.json").read_text())
    change(record)
    if rehash:  # as a forger would: the record verifies, its fields are what is wrong
        record[ckpt.RECORD_DIGEST] = ckpt.record_digest(record)
    (folder / "state.json").unlink()
    (folder / "state.json").write_text(json.dumps(record))


def _flip_weights(folder: Path) -> None:
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-100] ^= 0x01  # same size, still a safetensors file
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").write_bytes(bytes(data))


def _drop(*keys: str):
    """A change to a record: ``keys`` deleted."""

    def change(record: dict) -> None:
        for key in keys:
            del record[key]

    return change


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_drop(ckpt.RECORD_DIGEST, "files"), "has no checksum (state_sha256)"),
        (_drop(ckpt.RECORD_DIGEST, "files", ckpt.FORMAT_KEY), "has no checksums"),
        (lambda r: r.update(format=1, files=1), "has format 1, which this gpuflow does not read"),
    ],
    ids=["checksums", "checksums-and-format", "format"],
)
def test_a_checkpoint_without_its_checksums_is_refused(run, workdir, capsys, change, said):
    step = run / "checkpoints" / "step_000002"
    _edit_record(step, change)
    _flip_weights(step)
    _refused(
        [*SAMPLE, "--checkpoint", "step_000002"],
        workdir,
        capsys,
        f"runs/r/checkpoints/step_000002/state.json {said}",
        "choose another with --checkpoint (best, step_000001)",
    )


def test_a_damaged_best_does_not_suggest_its_own_step_which_shares_its_bytes(run, workdir, capsys):
    """``best`` is hard links to its step's files: a byte flipped in one is flipped in both,
    and the suggestion named the step, which then failed the same way."""
    import os

    checkpoints = run / "checkpoints"
    best = checkpoints / "best"
    step = next(p for p in ckpt.list_checkpoints(run)
                if (p / "model.safetensors").read_bytes()
                == (best / "model.safetensors").read_bytes())  # fmt: skip
    for file in best.iterdir():  # as the trainer makes it (a copied run folder has copies)
        file.unlink()
        os.link(step / file.name, file)
    with open(best / "model.safetensors", "r+b") as weights:
        weights.seek(-100, os.SEEK_END)
        byte = weights.read(1)
        weights.seek(-100, os.SEEK_END)
        weights.write(bytes([byte[0] ^ 1]))
    others = [p.name for p in ckpt.list_checkpoints(run) if p != step]
    line = _refused(SAMPLE, workdir, capsys, "best/model.safetensors is not the bytes written",
                    f"choose another with --checkpoint ({', '.join(others)})")  # fmt: skip
    assert step.name not in line.split("choose another")[1]


def test_an_older_checkpoint_with_sizes_alone_still_loads(run, capsys):
    """What gpuflow wrote before checksums: each file's size, no format, no digest."""

    def older(record: dict) -> None:
        sizes = {name: entry["bytes"] for name, entry in record["files"].items()}
        _drop(ckpt.RECORD_DIGEST, ckpt.FORMAT_KEY)(record)
        record["files"] = sizes

    step = run / "checkpoints" / "step_000002"
    _edit_record(step, older)
    assert main([*SAMPLE, "--checkpoint", "step_000002"]) == 0
    (step / "model.safetensors").write_bytes(b"short")  # its sizes are still checked
    assert main([*SAMPLE, "--checkpoint", "step_000002"]) == 2
    one_error(capsys.readouterr().err, "model.safetensors is 5 bytes where")


@pytest.mark.parametrize(
    ("field", "value", "rehash", "said"),
    [
        ("val_loss", "abc", False, "was changed after it was written"),
        ("val_loss", "abc", True, "its val_loss is 'abc', not a number or null"),
        ("step", "x", True, "its step is 'x', not a step number"),
        ("rng", {"torch": "!!"}, True, "its rng is"),
        ("param_groups", [{"lr": "fast"}], True, "its param_groups is"),
        ("files", {"model.safetensors": {"bytes": -1}}, True, "its files is"),
    ],
)
def test_a_best_record_is_verified_before_any_field_is_read(
    run, workdir, capsys, field, value, rehash, said
):
    _edit_record(run / "checkpoints" / "best", lambda r: r.update({field: value}), rehash)
    _refused(
        SAMPLE,
        workdir,
        capsys,
        "runs/r/checkpoints/best/state.json",
        said,
        "choose another with --checkpoint",
    )


# ---- input that is not what it says ---------------------------------------------------------


def test_a_prompt_that_is_not_utf8_is_one_line(run, workdir):
    before = entry_hashes(workdir)
    result = gpuflow_cli(*SAMPLE, "--prompt", "abc\udcff", cwd=workdir)  # argv b"abc\xff"
    assert result.returncode == 2
    one_error(result.stderr, "--prompt is not valid UTF-8 text (byte 0xff", "pass UTF-8 text")
    assert entry_hashes(workdir) == before


def test_a_saved_config_whose_preset_is_not_a_string_is_one_line(run, workdir, capsys):
    config = run / "config.toml"
    text = config.read_text().replace('preset = "tiny"', 'preset = ["tiny"]')
    config.unlink()
    config.write_text(text)
    _refused(SAMPLE, workdir, capsys, "runs/r/config.toml: preset must be a string")
