"""A run resumed on a token folder that changed since its checkpoints (``prepare --append``):
it trains on the folder as it is now and says so, and its best checkpoint and report compare
only the validation losses taken on the validation windows it has now."""

from __future__ import annotations

import json
from pathlib import Path

from gpuflow.interface.cli.main import main
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.runfolder import read_metrics
from tests.helpers import FAST

SETS = (
    "train.steps=4",
    "train.eval_interval=2",
    "train.checkpoint_interval=2",
    "train.decay_steps=20",
)


def _train(capsys, *args: str) -> str:
    assert main(["train", "--device", "cpu", "--name", "r", *args]) == 0
    return capsys.readouterr().err


def _sets(data: Path) -> list[str]:
    return [a for s in (*FAST, f"data.dir={data}", *SETS) for a in ("--set", s)]


def _best_record(run: Path) -> dict:
    best = ckpt.best_checkpoint(run)
    assert best is not None
    return ckpt.read_record(best)


def test_a_run_resumed_on_appended_text_says_so_and_keeps_its_best_anew(data_copy, workdir, capsys):
    first = _train(capsys, *_sets(data_copy))
    assert "changed since" not in first
    run = workdir / "runs" / "r"
    old_best = _best_record(run)
    assert old_best["data"]["val_set"] and old_best["data"]["train_tokens"] > 0
    meta = json.loads((data_copy / "meta.json").read_text())

    documents = [
        f"Document {i} tells of item {i * 7} and of its {i % 5} parts." for i in range(300)
    ]
    (workdir / "more.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    assert main(["prepare", "--data", "more.jsonl", "--out", str(data_copy), "--append"]) == 0
    capsys.readouterr()
    grown = json.loads((data_copy / "meta.json").read_text())
    assert grown["val_tokens"] > meta["val_tokens"]  # the validation windows move

    said = _train(capsys, "--resume", "--steps", "8")
    assert f"note: {data_copy} changed since step 4: its train split holds" in said
    assert "the validation windows differ from step 4's" in said
    assert f"checkpoints/best (validation loss {old_best['val_loss']:.4f}) was evaluated" in said
    after = [r for r in read_metrics(run) if "val_loss" in r and r["step"] > 4]
    assert [r["step"] for r in after] == [6, 8]
    best_now = min(r["val_loss"] for r in after)  # on the new windows, whatever the old best
    assert _best_record(run)["val_loss"] == best_now
    assert _best_record(run)["data"]["val_set"] != old_best["data"]["val_set"]
    report = json.loads((run / "report.json").read_text())
    assert report["best_val_loss"] == best_now

    # Resumed again on the folder as it now is: nothing to say, the same comparison.
    again = _train(capsys, "--resume", "--steps", "10")
    assert "changed since" not in again and "windows differ" not in again
    after = [r for r in read_metrics(run) if "val_loss" in r and r["step"] > 4]
    report = json.loads((run / "report.json").read_text())
    assert report["best_val_loss"] == min(r["val_loss"] for r in after)
    assert _best_record(run)["val_loss"] == report["best_val_loss"]


def test_a_run_resumed_on_the_same_folder_says_nothing_and_compares_all(data_copy, workdir, capsys):
    _train(capsys, *_sets(data_copy))
    said = _train(capsys, "--resume", "--steps", "6")
    assert "changed since" not in said and "windows differ" not in said
    run = workdir / "runs" / "r"
    val = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r]
    assert json.loads((run / "report.json").read_text())["best_val_loss"] == min(val)
    assert _best_record(run)["val_loss"] == min(val[1:])  # step 0's is never saved


def _swap_two_tokens(path: Path) -> None:
    """Another tokenizer of the same size: two of its tokens' ids exchanged."""
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tokenizer))


def test_a_checkpoint_trained_with_another_tokenizer_is_refused(data_copy, workdir, capsys):
    """The run's tokenizer.json and its data's agree, but not with the one the checkpoint's
    weights were trained with (a checkpoint copied from another run, or both replaced)."""
    _train(capsys, *_sets(data_copy))
    run = workdir / "runs" / "r"
    assert _best_record(run)["data"]["tokenizer_sha256"]
    for path in (run / "tokenizer.json", data_copy / "tokenizer.json"):
        _swap_two_tokens(path)
    more = ("--resume", "--set", "train.steps=6")
    assert main(["train", "--device", "cpu", "--name", "r", *more]) == 2
    err = capsys.readouterr().err
    assert "was trained with another tokenizer than runs/r/tokenizer.json" in err
