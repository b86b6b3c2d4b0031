"""Each command module of ``gpuflow``, called in this process: the subcommand it adds, its
defaults, and its ``run`` on the cpu (the command as a user runs it, in a shell:
test_cli.py)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from gpuflow.common.errors import GpuflowError
from gpuflow.interface.cli import bench, export, info, prepare, profile, sample, train
from gpuflow.interface.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    add_corpus_arguments,
    unescape,
)
from gpuflow.interface.cli.main import COMMANDS, build_parser
from gpuflow.interface.profile import profiler_notices_dropped
from gpuflow.train.suggest import TINY_ON_CPU
from tests.helpers import FAST

SETS = [a for s in FAST for a in ("--set", s)]


def parse(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    return args


@pytest.mark.parametrize("module", [info, prepare, train, bench, profile, sample])
def test_each_command_module_adds_its_own_subcommand_and_runs_it(module):
    name = module.__name__.rsplit(".", 1)[1]
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    module.add_parser(sub)
    assert list(sub.choices) == [name]
    if module is not bench:  # bench's run is set on each of its benches
        assert sub.choices[name].get_default("func") is module.run


def test_main_lists_the_commands_in_helps_order():
    assert (info, prepare, train, bench, profile, sample, export) == COMMANDS
    assert EXIT_BAD_INPUT == 2 and EXIT_INTERRUPTED == 130


def test_escapes_in_an_argument_mean_what_a_shell_user_means():
    assert unescape(r"\n\n") == "\n\n"
    assert unescape(r"a\tb\rc") == "a\tb\rc"
    assert unescape(r"C:\\path\x") == "C:\\path\\x"  # only \n \r \t \\ are escapes
    assert unescape("<|endoftext|> é") == "<|endoftext|> é"


def test_the_corpus_arguments_default_to_one_document_per_file_and_the_text_field():
    parser = argparse.ArgumentParser()
    add_corpus_arguments(parser, data_help="the corpus")
    args = parser.parse_args(["--data", "a.txt", "b/"])
    assert (args.data, args.separator, args.text_field) == (["a.txt", "b/"], None, "text")


def test_info_reports_the_cpu_as_json_and_as_tables(capsys):
    assert info.run(parse("info", "--json", "--device", "cpu")) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["selected"] == "cpu"
    assert not facts["link_probe"]["gb_per_s"] and facts["link_probe"]["bytes"] is None
    assert facts["link_probe"]["note"].startswith("skipped: the cpu has no host-device link")
    assert {"software", "devices", "allocator", "data_io", "peers"} <= set(facts)
    assert info.run(parse("info", "--device", "cpu")) == 0
    assert "gpuflow info" in capsys.readouterr().out


@pytest.mark.parametrize("gpu", [True, False])
def test_prepare_suggests_a_preset_that_suits_the_machine(
    workdir, small_corpus, capsys, monkeypatch, gpu
):  # fmt: skip
    monkeypatch.setattr("gpuflow.train.suggest.gpu_present", lambda: gpu)
    args = ("prepare", "--data", str(small_corpus / "notes"), "--vocab-size", "4096")
    assert prepare.run(parse(*args, "--workers", "1", "--out", "t")) == 0
    out, err = capsys.readouterr()
    assert "train on it: gpuflow train --preset tiny" in out
    assert ("no GPU here" in out and TINY_ON_CPU in out) is not gpu
    assert "note:" not in err  # both splits hold a window of tiny


def test_prepare_says_when_a_split_is_too_short_for_the_command_it_suggests(
    workdir, small_corpus, capsys
):  # fmt: skip
    two = workdir / "two.jsonl"
    two.write_text('{"text": "one short row of text"}\n{"text": "another short row"}\n')
    args = ("prepare", "--data", str(two), "--vocab-size", "300", "--out", "t")
    assert prepare.run(parse(*args)) == 0
    meta = json.loads((workdir / "t" / "meta.json").read_text())
    out, err = capsys.readouterr()
    assert (
        f"note: the train split holds {meta['train_tokens']} tokens and the val split holds "
        f"{meta['val_tokens']} token"
    ) in err and "fewer than one window of tiny (129 tokens)" in err
    # and the command it names does stop, as the note says
    suggested = next(x for x in out.splitlines() if x.startswith("train on it: "))
    argv = suggested.removeprefix("train on it: gpuflow ").split()
    with pytest.raises(GpuflowError, match="split has no run of 129 tokens"):
        train.run(parse(*argv, "--device", "cpu", "--steps", "1"))
    # an appending run counts only what it adds: two short lines added to a folder that
    # holds windows enough are no reason for a note
    notes = ("prepare", "--data", str(small_corpus / "notes"), "--vocab-size", "300")
    assert prepare.run(parse(*notes, "--workers", "1", "--out", "big")) == 0
    assert prepare.run(parse("prepare", "--data", str(two), "--out", "big", "--append")) == 0
    assert "note:" not in capsys.readouterr().err


def test_prepare_turns_its_arguments_into_a_token_folder(workdir, small_corpus, capsys):
    notes = str(small_corpus / "notes")
    base = ("prepare", "--data", notes, "--vocab-size", "300", "--workers", "1")
    assert prepare.run(parse(*base, "--out", "whole")) == 0
    assert prepare.run(parse(*base, "--out", "paragraphs", "--separator", r"\n\n")) == 0
    said = capsys.readouterr()
    assert "train on it: " in said.out and "whole" in said.out
    assert "--separator" not in said.err  # it split the files: nothing to say
    whole = json.loads((workdir / "whole" / "meta.json").read_text())
    split = json.loads((workdir / "paragraphs" / "meta.json").read_text())
    assert whole["documents"] == 20  # one document per file
    assert split["documents"] > whole["documents"]  # \n\n reached prepare as a blank line
    # A separator found in no file (here an escape the shell kept) is said, not ignored.
    assert prepare.run(parse(*base, "--out", "kept", "--separator", r"\\n\\n")) == 0
    err = capsys.readouterr().err
    assert "note: --separator '\\\\n\\\\n' occurs in none of the text files given" in err
    kept = json.loads((workdir / "kept" / "meta.json").read_text())
    assert kept["documents"] == 20


def test_train_then_sample_through_their_command_modules(workdir, prepared, capsys):
    args = parse("train", "--steps", "4", "--device", "cpu", "--name", "cli", *SETS,
                 "--set", f"data.dir={prepared}", "--set", "train.log_interval=2")  # fmt: skip
    assert train.run(args) == 0
    report = json.loads((workdir / "runs" / "cli" / "report.json").read_text())
    assert report["steps_done"] == 4 and report["config"]["model"]["d_model"] == 64
    capsys.readouterr()
    assert parse("sample").run is None  # the run most recently active, chosen when it runs
    defaults = parse("sample", "--run", "runs/cli")
    assert (defaults.checkpoint, defaults.temperature, defaults.top_k) == ("best", 0.8, 50)
    args = parse("sample", "--run", "runs/cli", "--prompt", "The", "--max-tokens", "5",
                 "--device", "cpu")  # fmt: skip
    assert sample.run(args) == 0
    assert capsys.readouterr().out.startswith("The")


def test_profile_writes_its_files_where_it_is_told(workdir, prepared, capsys):
    args = parse("profile", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--device",
                 "cpu", "--out", "prof", *SETS, "--set", f"data.dir={prepared}")  # fmt: skip
    assert (parse("profile").steps, parse("profile").warmup) == (10, 5)
    assert profile.run(args) == 0
    out = capsys.readouterr().out
    assert "profiling 2 steps of tiny on cpu into prof" in out
    wrote = next(line for line in out.splitlines() if line.startswith("wrote "))
    assert sorted(wrote.removeprefix("wrote ").split(", ")) == [
        "prof/profile.json",
        "prof/trace.json",
    ]
    assert (workdir / "prof" / "profile.json").is_file()


def test_profile_keeps_the_profilers_notices_out_of_the_terminal(workdir, prepared, capfd):
    args = parse("profile", "--steps", "1", "--warmup", "0", "--device", "cpu", "--out", "p",
                 *SETS, "--set", f"data.dir={prepared}")  # fmt: skip
    assert profile.run(args) == 0
    out, err = capfd.readouterr()
    assert "wrote p/trace.json, p/profile.json" in out
    assert "USDT:" not in out + err and "SyncActivityProfilerHandler" not in out + err
    # What else reaches stderr meanwhile is passed on, in order.
    with profiler_notices_dropped():
        os.write(2, b"a warning of the step's\n")
        os.write(2, b"USDT:2026-11-28 05:53:47 1:1 SyncActivityProfilerHandler.cpp:52] start\n")
        os.write(2, b"and another\n")
    assert capfd.readouterr().err == "a warning of the step's\nand another\n"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def test_every_command_and_bench_describes_itself_in_its_help():
    commands = _subparsers(build_parser())
    benches = {f"bench {name}": p for name, p in _subparsers(commands["bench"]).items()}
    assert len(commands) == len(COMMANDS) and len(benches) >= 9
    for name, parser in {**commands, **benches}.items():
        assert parser.description and len(parser.description) > 60, name
        printed = "".join(parser.format_help().split())  # wrapped to the terminal's width
        assert "".join(parser.description.split()) in printed, name


def test_bench_has_one_subcommand_per_bench_and_checks_its_folder_first(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    benches = parser._subparsers._group_actions[0].choices["bench"]._subparsers
    assert set(benches._group_actions[0].choices) == set(bench.BENCHES)
    args = parse("bench", "train")
    assert (args.preset, args.steps, args.warmup, args.func) == (None, 50, 10, bench.run)
    assert bench._train_preset(args) == "seed-d384"  # no --preset and no --config
    (tmp_path / "results").write_text("a file")
    measured = []
    monkeypatch.setitem(
        bench.BENCHES,
        "transfer",
        bench.Bench("stand-in", lambda p: None, lambda args, device: measured.append(args)),
    )
    args = parse("bench", "transfer", "--device", "cpu", "--out", str(tmp_path / "results"))
    with pytest.raises(GpuflowError, match="is a file, not a folder"):
        bench.run(args)
    assert measured == []  # refused before the bench spent its time
