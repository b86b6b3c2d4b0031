"""Advice that works the first time: every refusal that names a value to set, and the command
``prepare`` ends with, followed as a user would follow it; the command then runs (the tiny
preset's model, a few steps, on a small prepared folder). And the notice of a run whose
schedule ends inside its warm-up."""

from __future__ import annotations

import re
import shlex

import numpy as np
import pytest

from gpuflow.common.errors import GpuflowError
from gpuflow.data.shards import Shard, write_shard
from gpuflow.interface.cli.main import main
from gpuflow.train.batching import plan_batching
from gpuflow.train.config import resolve_config
from tests.helpers import FAST


def _train(*args: str, sets: tuple[str, ...] = ()) -> int:
    settings = [a for s in (*FAST, *sets) for a in ("--set", s)]
    return main(["train", "--device", "cpu", *args, *settings])


def _said(err: str, pattern: str) -> str:
    found = re.search(pattern, err)
    assert found, f"no {pattern!r} in: {err}"
    return found[1]


def test_the_vocabulary_named_holds_every_shards_ids(data_copy, small_corpus, workdir, capsys):
    # The val split, checked first, holds smaller ids than the train split.
    val = Shard.open(next(data_copy.glob("val_*.bin")))
    write_shard(val.path, np.asarray(val.tokens) % 400)
    data = f"data.dir={data_copy}"
    assert _train("--steps", "2", sets=(data, "model.vocab_size=300")) == 2
    err = capsys.readouterr().err
    assert int(_said(err, r"val_000000\.bin holds token id (\d+) but model\.vocab_size")) < 400
    vocab = _said(err, r"train with --set model\.vocab_size=(\d+)")
    assert _train("--steps", "2", sets=(data, f"model.vocab_size={vocab}")) == 0
    # The other way it names: the data prepared again with the model's vocabulary.
    size = _said(err, r"or prepare the data again with --vocab-size (\d+)")
    assert main(["prepare", "--data", str(small_corpus), "--vocab-size", size, "--out", "v"]) == 0
    assert _train("--steps", "2", sets=("data.dir=v", f"model.vocab_size={size}")) == 0


def test_no_vocabulary_is_named_for_ids_past_the_tokenizer(data_copy, workdir, capsys):
    shard = Shard.open(next(data_copy.glob("train_*.bin")))
    tokens = np.array(shard.tokens)
    tokens[7] = 4000  # no token of the folder's 512-token tokenizer: no setting mends that
    write_shard(shard.path, tokens)
    assert _train("--steps", "2", sets=(f"data.dir={data_copy}",)) == 2
    err = capsys.readouterr().err
    assert "train_000000.bin holds token id 4000 but" in err and "has 512 tokens" in err
    assert "model.vocab_size=" not in err and "prepare the folder again" in err


def test_the_command_prepare_ends_with_trains(small_corpus, workdir, capsys):
    assert main(["prepare", "--data", str(small_corpus), "--vocab-size", "512", "--out", "t"]) == 0
    command = _said(capsys.readouterr().out, r"train on it: (gpuflow train .*)")
    argv = shlex.split(command)
    assert "--preset" in argv and "model.vocab_size=512" in argv
    assert main([*argv[1:], "--steps", "2", "--device", "cpu"]) == 0  # a short run of it


def test_a_missing_token_folder_names_the_prepare_that_fits_the_model(
    small_corpus, workdir, capsys
):
    assert _train("--steps", "2", sets=("data.dir=absent",)) == 2
    argv = shlex.split(_said(capsys.readouterr().err, r"run `(gpuflow prepare [^`]*)`"))
    assert argv[argv.index("--vocab-size") + 1] == "512"  # the model's, from FAST
    # (named with your own corpus, as the refusal says; the built-in one takes longer)
    assert main([*argv[1:], "--data", str(small_corpus)]) == 0
    assert _train("--steps", "2", sets=("data.dir=absent",)) == 0


def test_a_finished_run_names_the_settings_that_train_it_further(prepared, workdir, capsys):
    sets = (f"data.dir={prepared}", "train.warmup_steps=1")  # the schedule decays from step 1
    for name in ("keep", "stretch"):
        assert _train("--name", name, "--steps", "3", sets=sets) == 0
    capsys.readouterr()
    assert _train("--name", "keep", "--resume", sets=sets) == 2
    err = capsys.readouterr().err
    assert "already finished 3 of 3 steps" in err
    keep = _said(err, r"--steps N \(N > 3\) and --set (train\.decay_steps=\d+) to keep")
    assert _train("--name", "keep", "--resume", "--steps", "5", sets=(*sets, keep)) == 0
    # Its schedule now has its own length: more --steps alone is what the next advice says.
    assert _train("--name", "keep", "--resume", sets=sets) == 2
    err = capsys.readouterr().err
    assert "train further with --steps N (N > 5)" in err and "decay_steps" not in err
    assert _train("--name", "keep", "--resume", "--steps", "6", sets=sets) == 0
    # More --steps alone on a schedule that follows them: refused, naming both ways on.
    assert _train("--name", "stretch", "--resume", "--steps", "5", sets=sets) == 2
    stretch = _said(capsys.readouterr().err, r"or --set (train\.decay_steps=\d+) to stretch")
    assert _train("--name", "stretch", "--resume", "--steps", "5", sets=(*sets, stretch)) == 0


def test_fewer_steps_than_a_run_trained_name_the_schedule_it_trained_with(
    prepared, workdir, capsys
):
    sets = (f"data.dir={prepared}", "train.warmup_steps=1")
    assert _train("--name", "r", "--steps", "4", sets=sets) == 0
    capsys.readouterr()
    assert _train("--name", "r", "--resume", "--steps", "2", sets=sets) == 2
    err = capsys.readouterr().err
    assert "already trained 4 steps, more than the 2 asked for" in err
    keep = _said(err, r"--steps N \(N > 4\) and --set (train\.decay_steps=\d+) to keep")
    assert keep == "train.decay_steps=4"  # the run's own schedule, not the 2 asked for


def test_a_run_that_ended_in_its_warm_up_is_told_to_give_more_steps_alone(
    prepared, workdir, capsys
):
    """Its rate at the end rises by a warm-up that knows no length: a decay setting would
    only cut the warm-up short."""
    sets = (f"data.dir={prepared}", "train.warmup_steps=30")
    assert _train("--name", "w", "--steps", "2", sets=sets) == 0
    capsys.readouterr()
    assert _train("--name", "w", "--resume", sets=sets) == 2
    err = capsys.readouterr().err
    assert "train further with --steps N (N > 2)" in err and "decay_steps" not in err
    assert _train("--name", "w", "--resume", "--steps", "4", sets=sets) == 0


def test_the_batch_tokens_named_are_whole_micro_batches(prepared, workdir, capsys):
    data = f"data.dir={prepared}"
    assert _train("--steps", "1", sets=(data, "train.batch_tokens=1000")) == 2
    tokens = _said(capsys.readouterr().err, r"whole sequences, e\.g\. (\d+)")
    assert _train("--steps", "1", sets=(data, f"train.batch_tokens={tokens}")) == 0
    assert _train("--steps", "1", sets=(data, "train.batch_size=0")) == 2
    setting = _said(capsys.readouterr().err, r"e\.g\. --set (train\.batch_tokens=\d+)")
    assert _train("--steps", "1", sets=(data, "train.batch_size=0", setting)) == 0
    # Over ranks: 1024 tokens are no whole sequences of 32 on each of 3.
    with pytest.raises(GpuflowError, match=r"such as (\d+)") as refused:
        plan_batching(resolve_config("tiny", None, [*FAST, "train.batch_tokens=1024"]), 3)
    near = re.search(r"such as (\d+)", str(refused.value))[1]
    plan = plan_batching(resolve_config("tiny", None, [*FAST, f"train.batch_tokens={near}"]), 3)
    assert plan.micro_batch == 8 and plan.tokens_per_step == int(near)


def test_a_run_that_ends_inside_its_warm_up_is_told(prepared, workdir, capsys):
    own_warmup = tuple(s for s in FAST if not s.startswith("train.warmup_steps"))
    sets = [a for s in (*own_warmup, f"data.dir={prepared}") for a in ("--set", s)]
    train = ["train", "--device", "cpu", "--preset", "tiny", *sets]
    assert main([*train, "--steps", "30"]) == 0  # tiny warms up over 30 steps
    err = capsys.readouterr().err
    assert "trains entirely in warm-up" in err and "train.warmup_steps is 30" in err
    fewer = _said(err, r"e\.g\. --set (train\.warmup_steps=\d+)")
    assert main([*train, "--steps", "30", "--set", fewer]) == 0
    assert "warm-up" not in capsys.readouterr().err
    for decay in (3, 6):  # 6: step 5 at the peak, step 6 at the floor: no decay either
        inside = ("--set", "train.warmup_steps=5", "--set", f"train.decay_steps={decay}")
        assert main([*train, "--steps", "8", *inside]) == 0
        err = capsys.readouterr().err
        assert f"train.decay_steps ({decay}) leaves no room for a decay" in err
        assert "rises over steps 0 to 4, trains step 5 at its peak" in err
    inside = ("--set", "train.warmup_steps=5", "--set", "train.decay_steps=7")
    assert main([*train, "--steps", "8", *inside]) == 0
    assert "no room for a decay" not in capsys.readouterr().err
