"""``gpuflow bench reference`` on the cpu: the token folder as nanoGPT reads it, nanoGPT's
settings and output, the children placed on slots, the configs it refuses, and one whole run
through the command line against a stand-in nanoGPT (tests/bench/nanogpt_standin.py)."""

from __future__ import annotations

import ast
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from gpuflow.bench import reference, reference_curves
from gpuflow.bench.placement import Finished, Job, run_jobs
from gpuflow.bench.reference import ReferenceConfig
from gpuflow.common.errors import GpuflowError
from gpuflow.data.shards import write_shard
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.accelerator import Device
from gpuflow.interface.cli.main import main
from tests.bench.nanogpt_standin import write_standin
from tests.helpers import FAST, SMALL_VOCAB, interrupt_as_children_start, stopped


def _shards(folder: Path, sizes: dict[str, list[int]], dtype=np.uint16, high=500) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for split, counts in sizes.items():
        for i, n in enumerate(counts):
            write_shard(folder / f"{split}_{i:06d}.bin", rng.integers(0, high, n).astype(dtype))
    return folder


def test_the_token_folder_becomes_nanogpts_bins_byte_for_byte(tmp_path, monkeypatch):
    tokens = TokenFolder.open(_shards(tmp_path / "tok", {"train": [1001, 7, 640], "val": [333]}))
    monkeypatch.setattr(reference, "CHUNK_BYTES", 10)  # many pieces per shard, one cut mid-shard
    target = tmp_path / "data" / "gpuflow"
    counts = reference.write_nanogpt_data(tokens, target, vocab_size=512)
    assert counts == {"train": 1648, "val": 333}
    for split in ("train", "val"):
        bodies = b"".join(s.path.read_bytes()[1024:] for s in getattr(tokens, split))
        assert (target / f"{split}.bin").read_bytes() == bodies
    assert pickle.loads((target / "meta.pkl").read_bytes()) == {"vocab_size": 512}
    # An id the model has no row for is refused while copying, naming the shard.
    refused = r"train_000000.bin holds token id 4\d\d but model.vocab_size is 400"
    with pytest.raises(GpuflowError, match=refused):
        reference.write_nanogpt_data(tokens, tmp_path / "small", vocab_size=400)


def _finished(lines: list[tuple[float, str]], label: str = "nanoGPT") -> Finished:
    return Finished(Job(label, [], Path("x.log")), 0, 9.5, {}, lines)


def test_nanogpt_output_becomes_its_curve_and_speed():
    lines = [(0.5, "tokens per iteration will be: 2,048"), (0.6, "Overriding: batch_size = 8")]
    for it in range(11):
        if it % 5 == 0:
            losses = f"train loss {6 - it / 10:.4f}, val loss {6.5 - it / 10:.4f}"
            lines.append((1.0 + it, f"step {it}: {losses}"))
        ms = 1000.0 if it < 5 else 100.0 + it  # compile and warm-up, then steady
        ms += 5000.0 if it % 5 == 0 else 0.0  # an evaluation (and a checkpoint) falls in it
        lines.append((1.1 + it, f"iter {it}: loss {6 - it / 10:.4f}, time {ms:.2f}ms, mfu 1.00%"))
    run = reference_curves.nanogpt_run(_finished(lines), tokens_per_step=2048, eval_interval=5)
    assert [(p["step"], p["tokens"], p["val_loss"], p["train_loss"], p["seconds"])
            for p in run["curve"]] == [
        (0, 0, 6.5, 6.0, 1.0), (5, 10240, 6.0, 5.5, 6.0), (10, 20480, 5.5, 5.0, 11.0),
    ]  # fmt: skip
    # iterations 6-9: not the warm-up, not those an evaluation fell into
    assert run["iterations_timed"] == 4 and run["iteration_ms"] == pytest.approx(107.5)
    assert run["tokens_per_s"] == pytest.approx(2048 / 0.1075)
    assert run["final_val_loss"] == 5.5 and run["wall_s"] == 9.5
    # Told one batch and training another: its train.py did not take the settings.
    lines[0] = (0.5, "tokens per iteration will be: 491,520")
    with pytest.raises(GpuflowError, match="491,520 tokens an iteration, not the 2,048"):
        reference_curves.nanogpt_run(_finished(lines), tokens_per_step=2048, eval_interval=5)
    with pytest.raises(GpuflowError, match="no 'step N: train loss X, val loss Y' line"):
        reference_curves.nanogpt_run(
            _finished([(0.1, "Traceback"), (0.2, "KeyError: 'x'")]), 2048, eval_interval=5
        )


def test_the_gap_the_seed_spread_and_when_gpuflow_reached_nanogpts_final():
    def run(label, points):
        curve = [{"step": s, "tokens": s * 10, "val_loss": v, "seconds": t} for s, v, t in points]
        return {"label": label, "curve": curve, "final_val_loss": curve[-1]["val_loss"],
                "tokens_per_s": 200.0}  # fmt: skip

    nano = run("nanoGPT", [(0, 7.0, 3.0), (5, 6.0, 8.0), (10, 5.0, 13.0)])
    nano["tokens_per_s"] = 100.0
    ours = [run("a", [(0, 7.1, 2.0), (5, 5.9, 4.0), (10, 4.8, 6.0)]),
            run("b", [(0, 7.0, 2.0), (5, 6.2, 4.0), (10, 4.9, 6.0)])]  # fmt: skip
    got = reference_curves.compare(nano, ours)
    assert [g["step"] for g in got["gaps"]] == [0, 5, 10]
    assert [g["gap"] for g in got["gaps"]] == pytest.approx([0.1, -0.1, -0.2])
    assert [g["seed_spread"] for g in got["gaps"]] == pytest.approx([0.1, 0.3, 0.1])
    assert got["seed_spread_max"] == pytest.approx(0.3)
    assert got["final"]["gap"] == pytest.approx(-0.2)
    assert got["gpuflow_s_to_nanogpt_final"] == 6.0 and got["nanogpt_s_to_final"] == 13.0
    assert got["speedup"] == 2.0
    assert got["best"] == {"nanogpt": 5.0, "gpuflow": 4.8}
    assert (got["gpuflow_s_to_nanogpt_best"], got["nanogpt_s_to_best"]) == (6.0, 13.0)
    assert reference_curves.compare(nano, ours[:1])["seed_spread_max"] is None
    ours[0]["curve"][-1]["val_loss"] = ours[0]["final_val_loss"] = 5.2
    assert reference_curves.compare(nano, ours)["gpuflow_s_to_nanogpt_final"] is None
    # A curve that rises again (a corpus read many times over): nanoGPT's best is not its last.
    nano["curve"][-1]["val_loss"] = nano["final_val_loss"] = 6.5
    got = reference_curves.compare(nano, ours)
    assert got["best"]["nanogpt"] == 6.0 and got["nanogpt_s_to_best"] == 8.0
    assert got["gpuflow_s_to_nanogpt_best"] == 4.0 and got["gpuflow_s_to_nanogpt_final"] == 4.0


def test_nanogpt_is_given_the_configs_batch_accumulation_and_schedule(tmp_path, prepared):
    standin = write_standin(tmp_path / "nanoGPT")
    sets = (*FAST, f"data.dir={prepared}", "train.batch_tokens=1024", "train.decay_steps=80",
            "train.eval_interval=20", "train.min_lr_ratio=0.25", "train.grad_clip=1")  # fmt: skip
    bench = ReferenceConfig(str(standin), preset="tiny", overrides=sets, steps=60)
    plan = reference.check_reference(bench, Device("cpu"))
    assert (plan.batching.micro_batch, plan.batching.accumulation) == (8, 4)  # 1024 / (8 x 32)
    settings = reference.nanogpt_settings(plan.config, plan.batching, False, "cpu")
    expected = {
        "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32, "batch_size": 8,
        "gradient_accumulation_steps": 4, "learning_rate": 0.003, "min_lr": 0.003 * 0.25,
        "warmup_iters": 5, "lr_decay_iters": 80, "max_iters": 60, "eval_interval": 20,
        "eval_iters": 2, "grad_clip": 1.0, "compile": False, "dtype": "float32",
        "device": "cpu", "bias": False, "dropout": 0.0, "decay_lr": True,
    }  # fmt: skip
    assert {key: settings[key] for key in expected} == expected
    # Each flag reads back, through literal_eval as nanoGPT's configurator reads it, as the
    # value and type given: a float stays a float (its defaults are floats).
    command = reference.nanogpt_command(standin, settings)
    assert command[:2] == [sys.executable, str(standin / "train.py")]
    for flag in command[2:]:
        key, value = flag[2:].split("=")
        try:
            read = ast.literal_eval(value)
        except (SyntaxError, ValueError):
            read = value
        assert type(read) is type(settings[key]) and read == settings[key], flag


def _refusal(capsys, standin: Path, out: Path, *extra: str) -> list[str]:
    args = ["bench", "reference", "--nanogpt", str(standin), "--device", "cpu"]
    assert main([*args, "--preset", "tiny", "--out", str(out), *extra]) == 2
    captured = capsys.readouterr()
    assert "bench reference on" not in captured.out  # refused before anything was said
    return captured.err.strip().splitlines()


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["train.batch_size=0", "train.batch_tokens=4096"], "set it, e.g. --set train.batch_size"),
        (["UINT32"], "32-bit tokens and nanoGPT's train.py reads uint16 only"),
        (["train.steps=30", "train.eval_interval=20"], "not a multiple of train.eval_interval"),
        (["model.vocab_size=70000"], "needs uint32 tokens"),
    ],
)
def test_what_nanogpt_cannot_run_is_one_line(sets, words, tmp_path, capsys):
    standin = write_standin(tmp_path / "nanoGPT")
    if sets == ["UINT32"]:
        wide = _shards(tmp_path / "wide", {"train": [500], "val": [100]}, dtype=np.uint32)
        sets = [f"data.dir={wide}"]
    err = _refusal(capsys, standin, tmp_path, *(a for s in sets for a in ("--set", s)))
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_bad_nanogpt_folders_and_devices_are_one_line(tmp_path, capsys):
    err = _refusal(capsys, tmp_path, tmp_path)
    assert len(err) == 1 and "lacks train.py, model.py, configurator.py" in err[0]
    standin = write_standin(tmp_path / "nanoGPT")
    err = _refusal(capsys, standin, tmp_path, "--devices", "0,1")
    assert err == ["error: --devices names GPUs; on the cpu the runs go one after another: "
                   "leave it out"]  # fmt: skip
    err = _refusal(capsys, standin, tmp_path, "--devices", "0,x")
    assert len(err) == 1 and "like 0,1; got '0,x'" in err[0]


def test_device_slots_name_one_gpu_each_through_the_visible_ones(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert reference.device_slots(()) == [{}]
    assert reference.device_slots((0, 2)) == [
        {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "2"}
    ]  # fmt: skip
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert reference.device_slots((1,)) == [{"CUDA_VISIBLE_DEVICES": "6"}]


def _job(tmp_path: Path, name: str, code: str) -> Job:
    return Job(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def test_jobs_share_the_slots_and_queue_for_them(tmp_path):
    code = ("import os, time; print('start', time.time(), os.environ['SLOT'], flush=True); "
            "time.sleep(0.6); print('end', time.time())")  # fmt: skip
    jobs = [_job(tmp_path, name, code) for name in ("a", "b", "c")]
    slots = [{"SLOT": "x"}, {"SLOT": "y"}]
    done = run_jobs(jobs, slots, tmp_path, dict(os.environ), "test")
    said = {f.job.label: [t.split() for _, t in f.lines] for f in done}
    start = {k: float(v[0][1]) for k, v in said.items()}
    end = {k: float(v[1][1]) for k, v in said.items()}
    assert start["b"] < end["a"] and start["a"] < end["b"]  # two slots: at once
    assert start["c"] >= min(end["a"], end["b"])  # the third waited for a slot
    assert {said["a"][0][2], said["b"][0][2]} == {"x", "y"}
    assert all(f.returncode == 0 and f.seconds >= 0.6 for f in done)
    # Each line is in its log behind the seconds since its child started.
    log = (tmp_path / "a.log").read_text().splitlines()
    assert len(log) == 2 and log[0].startswith("[") and "] start " in log[0]


def test_a_failing_child_stops_the_others_and_names_itself(tmp_path):
    sleeper = _job(tmp_path, "sleeper", f"import os, time; open({str(tmp_path / 'pid')!r}, 'w')"
                   ".write(str(os.getpid())); time.sleep(60)")  # fmt: skip
    failing = _job(tmp_path, "failing", "import time; time.sleep(0.5); raise KeyError('no such')")
    started = time.perf_counter()
    with pytest.raises(GpuflowError) as caught:
        run_jobs([sleeper, failing], [{}, {}], tmp_path, dict(os.environ), "bench reference")
    assert time.perf_counter() - started < 20
    assert str(caught.value) == (
        "bench reference: failing failed (exit status 1): KeyError: 'no such'"
    )
    pid = int((tmp_path / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists()  # stopped and reaped


def test_an_interrupt_as_a_job_starts_stops_it(tmp_path, monkeypatch):
    children = interrupt_as_children_start(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_jobs([_job(tmp_path, "sleeper", "import time; time.sleep(60)")], [{}], tmp_path,
                 dict(os.environ), "test")  # fmt: skip
    assert len(children) == 1 and stopped(children)


def _bench(standin: Path, prepared: Path, tmp_path: Path, monkeypatch, capsys):
    """The bench through the command line, in this process (torch is imported already);
    its scratch folder under ``tmp_path``. (exit status, stdout, stderr)"""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sets = (*FAST, f"data.dir={prepared}", "train.batch_tokens=512", "train.eval_interval=2",
            "train.log_interval=1", "train.warmup_steps=2")  # fmt: skip
    status = main([
        "bench", "reference", "--nanogpt", str(standin), "--device", "cpu", "--preset", "tiny",
        "--steps", "6", "--out", str(tmp_path / "results"),
        *(a for s in sets for a in ("--set", s)),
    ])  # fmt: skip
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_whole_run_against_a_standin_writes_both_curves_and_a_plot(
    tmp_path, prepared, monkeypatch, capsys
):
    standin = write_standin(tmp_path / "nanoGPT")
    status, out, err = _bench(standin, prepared, tmp_path, monkeypatch, capsys)
    assert status == 0, err
    assert "[1/2] nanoGPT: started" in err and "[2/2] gpuflow: ended" in err
    (path,) = (tmp_path / "results").glob("*-reference-tiny-cpu.json")
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads(path.read_text())
    assert record["benchmark"] == "reference" and record["nanogpt"]["commit"] is None
    assert record["batching"] == {"micro_batch": 8, "accumulation": 2, "tokens_per_step": 512}
    assert record["config"]["data"]["dir"] == str(prepared)
    assert record["nanogpt"]["settings"]["gradient_accumulation_steps"] == 2
    nano, ours = record["runs"]
    assert (nano["trainer"], ours["trainer"]) == ("nanogpt", "gpuflow")
    steps = [(0, 0), (2, 1024), (4, 2048), (6, 3072)]
    for run in (nano, ours):  # every 2 steps from the untrained start, timed from the start
        assert [(p["step"], p["tokens"]) for p in run["curve"]] == steps
        seconds = [p["seconds"] for p in run["curve"]]
        assert seconds == sorted(seconds) and 0 < seconds[-1] <= run["wall_s"]
    assert [p["val_loss"] for p in nano["curve"]] == [6.0, 5.8, 5.6, 5.4]  # the stand-in's
    assert nano["tokens_per_s"] == pytest.approx(512 / 0.015)  # iteration 5 (6 evaluated)
    assert ours["tokens_per_s"] > 0
    assert ours["curve"][0]["val_loss"] == pytest.approx(np.log(SMALL_VOCAB), abs=0.3)
    assert [g["gap"] for g in record["gaps"]] == pytest.approx(
        [o["val_loss"] - n["val_loss"] for o, n in zip(ours["curve"], nano["curve"], strict=True)]
    )
    assert record["final"]["nanogpt"] == 5.4 and len(record["differences"]) >= 4
    assert "val loss gap (gpuflow - nanoGPT) over 4 shared steps" in out
    assert "nanoGPT's tokens/s is the median of 1 timed iteration (the first 5" in out
    assert list(tmp_path.glob("gpuflow-reference-*")) == []  # the scratch folder is gone


def test_a_failing_nanogpt_is_one_line_with_its_last_words(tmp_path, prepared, monkeypatch, capsys):
    standin = write_standin(tmp_path / "nanoGPT", fail="Unknown config key: nope")
    status, _, err = _bench(standin, prepared, tmp_path, monkeypatch, capsys)
    assert status == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: bench reference: nanoGPT failed (exit status 1): ValueError: Unknown config "
        "key: nope"
    ]  # fmt: skip
    assert "gpuflow: started" not in err  # the queue stopped at the failure
    assert not list((tmp_path / "results").glob("*"))
    assert list(tmp_path.glob("gpuflow-reference-*")) == []
