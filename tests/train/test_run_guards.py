"""What an attacker tried on `gpuflow train`, each refused in one line before anything changes:
a second writer, links planted in the run folder, checkpoints stripped of their checksums,
token folders whose parts disagree, absurd sizes, names with a newline. Each case checks the
exit status, the one `error:` line (naming the file and what to do), every file's bytes
before and after, and a victim file outside the run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpuflow.data.prepare.tokenizer import train_tokenizer
from gpuflow.data.shards import Shard, write_shard
from gpuflow.interface.cli.main import main
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.runfolder import RunFolder
from tests.helpers import FAST, entry_hashes, gpuflow_cli, one_error, two_checkpointed_steps

VICTIM = "the user's own file"


def _sets(data: Path, *extra: str) -> list[str]:
    return [a for s in (*FAST, f"data.dir={data}", *extra) for a in ("--set", s)]


def _resume(data: Path) -> list[str]:
    return ["train", "--device", "cpu", "--name", "r", "--resume", "--steps", "3", *_sets(data)]


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory) -> Path:
    """runs/r: 2 steps, a checkpoint at each, a best one."""
    return two_checkpointed_steps(prepared, tmp_path_factory.mktemp("guarded"))


@pytest.fixture
def run(trained, workdir) -> Path:
    """A copy of ``trained`` in this test's folder, beside a victim file: runs/r."""
    shutil.copytree(trained, workdir / "runs", symlinks=True)
    (workdir / "victim.txt").write_text(VICTIM)
    return workdir / "runs" / "r"


# ---- one writer per run ---------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holders_pid(run, prepared, workdir):
    before = entry_hashes(workdir)
    with RunFolder(run, resume=True):  # this process trains it
        result = gpuflow_cli(*_resume(prepared), cwd=workdir)
    assert result.returncode == 2
    one_error(result.stderr, "runs/r is in use by another gpuflow process", f"PID {os.getpid()}")
    assert entry_hashes(workdir) == before


def test_the_run_stays_locked_until_its_report_is_written(run, prepared, monkeypatch, capsys):
    from gpuflow.train import report

    real_plot, refused = report.plot_run, []

    def plot_while_someone_tries(run_dir):
        try:
            with RunFolder(run_dir, resume=True):
                pass
        except Exception as exc:  # what a second writer meets now
            refused.append(str(exc))
        return real_plot(run_dir)

    monkeypatch.setattr(report, "plot_run", plot_while_someone_tries)
    assert main(_resume(prepared)) == 0
    [message] = refused
    assert f"in use by another gpuflow process (PID {os.getpid()})" in message
    with RunFolder(run, resume=True):  # and free once the command is over
        pass


# ---- links planted in the run ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("tokenizer.json", "outside/new.json"),  # dangling: a write would create it
        ("metrics.jsonl", "victim.txt"),
        ("training.png", "victim.txt"),
        ("report.json", "outside/new.json"),
        ("config.toml", "victim.txt"),
    ],
)
def test_a_link_at_a_file_the_run_writes_is_refused(run, prepared, workdir, capsys, name, target):
    (run / name).unlink(missing_ok=True)
    (workdir / "outside").mkdir()
    (run / name).symlink_to(workdir / target)
    before = entry_hashes(workdir)
    assert main(_resume(prepared)) == 2
    one_error(capsys.readouterr().err, f"runs/r/{name} is a link")
    assert entry_hashes(workdir) == before
    assert (workdir / "victim.txt").read_text() == VICTIM
    assert list((workdir / "outside").iterdir()) == []  # no target created


def test_the_plot_is_never_written_through_a_link_at_its_old_temporary_name(
    run, prepared, workdir, capsys
):
    (run / ".training.png.tmp").symlink_to(workdir / "victim.txt")
    assert main(_resume(prepared)) == 0
    assert (workdir / "victim.txt").read_text() == VICTIM
    assert (run / "training.png").read_bytes().startswith(b"\x89PNG")
    assert (run / ".training.png.tmp").is_symlink()  # not gpuflow's: left as it was


# ---- checkpoints without their checksums --------------------------------------------------


def _edit_record(folder: Path, change, rehash: bool = False) -> None:
    record = json.loads((folder / "state.json").read_text())
    change(record)
    if rehash:  # as a forger would: the record verifies, its fields are what is wrong
        record[ckpt.RECORD_DIGEST] = ckpt.record_digest(record)
    (folder / "state.json").unlink()  # (best shares the step's files: never rewrite in place)
    (folder / "state.json").write_text(json.dumps(record))


def _flip_weights(folder: Path) -> None:
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-100] ^= 0x01
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").write_bytes(bytes(data))


def _strip(record: dict) -> None:
    for key in (ckpt.RECORD_DIGEST, "files", ckpt.FORMAT_KEY):
        record.pop(key)


def test_a_resume_skips_a_checkpoint_stripped_of_its_checksums(run, prepared, capsys):
    latest = run / "checkpoints" / "step_000002"
    _edit_record(latest, _strip)
    _flip_weights(latest)
    assert main(_resume(prepared)) == 0
    err = capsys.readouterr().err
    assert "skipping checkpoint step_000002" in err and "has no checksums" in err, err
    assert "resuming from the intact checkpoint step_000001" in err


def test_a_damaged_best_record_is_one_line_and_the_run_goes_on(run, prepared, capsys):
    _edit_record(run / "checkpoints" / "best", lambda r: r.update(val_loss="abc"), rehash=True)
    assert main(_resume(prepared)) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "the best checkpoint is damaged" in err and "its val_loss is 'abc'" in err, err
    assert ckpt.read_record(run / "checkpoints" / "best")["val_loss"] is not None  # replaced


# ---- token folders whose parts disagree -----------------------------------------------------


def _small_tokenizer(folder: Path, stdlib_documents) -> int:
    """Replace ``folder``'s tokenizer with a 300-token one; its vocabulary."""
    tokenizer = train_tokenizer((d.text for d in stdlib_documents[:20]), 300)
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer.get_vocab_size()


def _refused_train(data: Path, workdir: Path, capsys, *said: str, sets=()) -> None:
    before = entry_hashes(workdir)
    assert main(["train", "--device", "cpu", "--steps", "2", *_sets(data, *sets)]) == 2
    one_error(capsys.readouterr().err, *said)
    assert entry_hashes(workdir) == before  # no run folder, nothing changed in the data


@pytest.mark.parametrize("path", ["resident", "streamed"])
def test_shards_with_ids_past_their_tokenizer_are_refused(
    data_copy, workdir, capsys, stdlib_documents, path
):
    vocab = _small_tokenizer(data_copy, stdlib_documents)
    meta = json.loads((data_copy / "meta.json").read_text())
    (data_copy / "meta.json").write_text(json.dumps({**meta, "vocab_size": vocab}))
    val = Shard.open(next(data_copy.glob("val_*.bin")))  # the val split fits: train is read
    write_shard(val.path, np.asarray(val.tokens) % vocab)  # as the data path reads it
    _refused_train(
        data_copy,
        workdir,
        capsys,
        "train_000000.bin holds token id",
        f"tokenizer.json has {vocab} tokens",
        "prepare the folder again",
        sets=(f"train.data_path={path}",),
    )


def test_a_tokenizer_other_than_meta_json_says_is_refused(
    data_copy, workdir, capsys, stdlib_documents
):
    vocab = _small_tokenizer(data_copy, stdlib_documents)
    _refused_train(
        data_copy,
        workdir,
        capsys,
        f"meta.json records a vocabulary of 512 tokens but {data_copy}/tokenizer.json has {vocab}",
    )


@pytest.mark.parametrize("meta", ["null", "[]", '{"vocab_size": "512"}', '{"vocab_size": true}'])
def test_a_meta_json_without_a_vocabulary_is_refused(data_copy, workdir, capsys, meta):
    (data_copy / "meta.json").write_text(meta)  # edited: the vocabulary check went unmade
    _refused_train(data_copy, workdir, capsys, "meta.json records no vocabulary", "prepare")


def test_a_shard_that_is_not_a_file_is_named_as_such(data_copy, workdir, capsys):
    (data_copy / "val_000001.bin").mkdir()
    _refused_train(data_copy, workdir, capsys, "val_000001.bin is not a regular file")


def test_a_tokenizer_that_is_not_json_is_refused_before_the_run_starts(data_copy, workdir, capsys):
    (data_copy / "tokenizer.json").write_text("not json at all")
    _refused_train(
        data_copy,
        workdir,
        capsys,
        f"{data_copy}/tokenizer.json is not a Hugging Face tokenizer.json",
        "prepare it again",
    )


# ---- absurd sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (("train.batch_size=1000000000",), "is more than the train split"),
        (("train.batch_tokens=32000000000",), "is more than the train split"),
    ],
    ids=["batch_size", "batch_tokens"],
)
def test_a_batch_larger_than_the_corpus_is_refused_before_it_is_built(
    prepared, workdir, monkeypatch, capsys, sets, said
):
    def never(*args, **kwargs):
        raise AssertionError("validation windows built for a batch that cannot be")

    monkeypatch.setattr("gpuflow.train.setup.validation_windows", never)
    monkeypatch.setattr("gpuflow.train.setup.GPT", never)  # refused before the model, too
    _refused_train(prepared, workdir, capsys, said, "lower train.batch_size", sets=sets)


def test_a_model_the_host_cannot_hold_is_refused_before_it_is_built(
    prepared, workdir, monkeypatch, capsys
):
    def never(*args, **kwargs):
        raise AssertionError("a model built that the host cannot hold")

    monkeypatch.setattr("gpuflow.train.setup.GPT", never)
    monkeypatch.setattr("gpuflow.train.setup.available_bytes", lambda: 1 << 30)
    said = ("needs about", "GiB of host memory", "this host has 1.0 GiB available")
    _refused_train(prepared, workdir, capsys, *said, sets=("model.n_layer=2000",))


# ---- names and configs ----------------------------------------------------------------------


def test_a_run_name_ending_in_a_newline_is_refused(prepared, workdir, capsys):
    before = entry_hashes(workdir)
    assert main(["train", "--device", "cpu", "--name", "nl\n", *_sets(prepared)]) == 2
    one_error(capsys.readouterr().err, "run name 'nl\\n' must start with a letter or digit")
    assert entry_hashes(workdir) == before


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
def test_an_empty_run_name_is_refused_not_taken_as_none(prepared, workdir, capsys, resume):
    """An unset shell variable (--name "$NAME") must not train into the preset's folder, or
    resume the latest run."""
    if resume:  # a run that "the latest" would name
        assert main(["train", "--device", "cpu", "--name", "first", *_sets(prepared)]) == 0
    capsys.readouterr()
    before = entry_hashes(workdir)
    args = ["train", "--device", "cpu", "--name", "", *(["--resume"] if resume else [])]
    assert main([*args, *_sets(prepared)]) == 2
    one_error(capsys.readouterr().err, "run name '' must start with a letter or digit")
    assert entry_hashes(workdir) == before


def test_a_saved_config_whose_preset_is_not_a_string_is_one_line(run, prepared, workdir, capsys):
    config = run / "config.toml"
    text = config.read_text().replace('preset = "tiny"', 'preset = ["tiny"]')
    config.unlink()
    config.write_text(text)
    before = entry_hashes(workdir)
    assert main(_resume(prepared)) == 2
    one_error(capsys.readouterr().err, "runs/r/config.toml: preset must be a string")
    assert entry_hashes(workdir) == before


def test_resume_with_data_says_how_to_go_on_over_other_text(prepared, workdir, capsys):
    assert main(["train", "--device", "cpu", "--name", "r", "--steps", "2", *_sets(prepared)]) == 0
    capsys.readouterr()
    (workdir / "more.txt").write_text("more text to train on " * 50)
    before = entry_hashes(workdir)
    resumed = ["train", "--device", "cpu", "--name", "r", "--resume", "--data", "more.txt"]
    assert main(resumed) == 2
    one_error(
        capsys.readouterr().err,
        "--data names other text than the run was trained on (",
        "--resume trains on the run's own data: leave --data out (to go on over other text, "
        "encode it with the run's tokenizer: gpuflow prepare --data PATH --tokenizer "
        "runs/r/tokenizer.json --out DIR, then resume with --set data.dir=DIR)",
    )
    assert entry_hashes(workdir) == before


def test_resume_with_the_data_the_run_started_with_continues_it(workdir, capsys):
    """The command that started a run, with --resume added, resumes it (as docs/cli.md says)
    also where it named a raw corpus; once the corpus has changed, it is refused."""
    import sys

    sources = sorted(Path(sys.modules["json"].__file__).parent.glob("*.py"))
    (workdir / "corpus.txt").write_text("\n\n".join(p.read_text() for p in sources))
    sets = [a for s in FAST for a in ("--set", s)]
    start = ["train", "--device", "cpu", "--name", "raw", "--data", "corpus.txt", *sets]
    assert main([*start, "--steps", "2"]) == 0
    assert main([*start, "--steps", "3", "--resume"]) == 0
    assert "resumed" in capsys.readouterr().err
    assert json.loads((workdir / "runs/raw/report.json").read_text())["steps_done"] == 3
    with open(workdir / "corpus.txt", "a") as corpus:
        corpus.write("\nmore text")
    assert main([*start, "--steps", "4", "--resume"]) == 2
    one_error(capsys.readouterr().err, "--data names other text than the run was trained on")
