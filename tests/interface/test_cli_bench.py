"""`gpuflow bench` and `gpuflow profile` end to end: what each measures, the JSON each writes,
and what each refuses."""

from __future__ import annotations

import json
import time

from gpuflow.interface.cli.main import main
from tests.helpers import FAST, gpuflow_cli


def test_bench_transfer_runs_and_writes_json(workdir):
    result = gpuflow_cli("bench", "transfer", "--quick", "--device", "cpu", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "do not describe a GPU link" in result.stdout  # the cpu's figures are the host's
    assert not (workdir / "benchmarks").exists()  # never into a checkout's tracked results
    files = list((workdir / "runs" / "bench").glob("*-transfer-quick-cpu.json"))
    assert len(files) == 1
    record = json.loads(files[0].read_text())
    assert record["benchmark"] == "transfer" and record["machine"]["type"] == "cpu"
    assert {row["memory"] for row in record["memory_kinds"]} == {
        "pageable",
        "fresh_pinned",
        "pooled",
    }
    assert record["small_tensors"]["tensors"] == 200
    assert record["flat_memory"]["flat"] is True
    assert "targets" in result.stdout and str(files[0].relative_to(workdir)) in result.stdout


def test_bench_transfer_measures_only_the_sections_asked_for(workdir, capsys):
    args = ["bench", "transfer", "--quick", "--device", "cpu", "--sections"]
    # asked out of order and twice: each measured once, named in the bench's order
    assert main([*args, "text_loop,payloads,text_loop"]) == 0
    results = workdir / "runs" / "bench"
    files = list(results.glob("*-transfer-quick-payloads-textloop-cpu.json"))
    assert len(files) == 1 and len(list(results.iterdir())) == 1
    record = json.loads(files[0].read_text())
    assert {"text_loop", "payloads"} <= record.keys()
    assert not {"peak", "loader_sweep", "image_loop", "flat_memory"} & record.keys()
    assert [t["target"].split(",")[0] for t in record["targets"]] == [
        "text loop",  # the loop's rounds
        "text loop",  # its feeds timed alone
        "bf16 payload >= 1.8x fp32 effective rate",
    ]
    capsys.readouterr()
    assert main([*args, "text_loop,sweep"]) == 2
    assert "unknown --sections sweep; choose from peak," in capsys.readouterr().err


def test_bench_train_measures_each_data_path_and_writes_json(workdir, prepared):
    sets = [a for s in (*FAST, f"data.dir={prepared}") for a in ("--set", s)]
    result = gpuflow_cli(
        "bench", "train", "--preset", "tiny", "--modes", "streamed,resident",
        "--steps", "3", "--warmup", "1", "--device", "cpu", *sets, cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [path] = (workdir / "runs" / "bench").glob("*-train-*-cpu.json")
    record = json.loads(path.read_text())
    rows = {row["mode"]: row for row in record["rows"]}
    assert set(rows) == {"streamed", "resident", "resident (synthetic batch)"}
    ids = 8 * 33  # FAST: batch 8, windows of 32 + 1
    assert rows["streamed"]["h2d_bytes_per_step"] == 2 * ids
    assert rows["resident"]["h2d_bytes_per_step"] == 0
    assert all(row["tokens_per_s"] > 0 and row["syncs_per_step"] == 0 for row in rows.values())
    assert str(path.relative_to(workdir)) in result.stdout


def test_bench_train_refuses_an_unknown_mode(workdir):
    result = gpuflow_cli("bench", "train", "--modes", "teleport", "--device", "cpu", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: unknown data path 'teleport' in --modes; choose from naive, standard, streamed, "
        "resident, resident-graph"
    )


def test_profile_writes_trace_timeline_and_counts(workdir, prepared):
    sets = [
        a for s in (*FAST, f"data.dir={prepared}", "train.data_path=streamed") for a in ("--set", s)
    ]
    result = gpuflow_cli(
        "profile", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--device", "cpu",
        "--out", "prof", *sets, cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # The profile folder holds the profile and nothing a run would: it is not a run.
    assert sorted(p.name for p in (workdir / "prof").iterdir()) == ["profile.json", "trace.json"]
    assert (workdir / "prof" / "trace.json").stat().st_size > 0
    record = json.loads((workdir / "prof" / "profile.json").read_text())
    assert record["data_path"] == "streamed" and record["steps"] == 2
    assert record["metrics"]["h2d_bytes_per_batch"] == 2 * 8 * 33  # uint16 ids, one batch
    assert record["metrics"]["syncs_per_batch"] == 0
    # The cpu has no device to trace: the step is timed by the host clock, and it says so.
    assert record["step_clock"] == "host" and record["metrics"]["step_ms"] > 0
    assert "no device to trace" in result.stdout and "0.00 ms" not in result.stdout
    # nor overlap or exposed copies to measure: not 0% of them (said as 0.0% before)
    assert record["metrics"]["overlap_efficiency"] is None
    assert record["metrics"]["transfer_overhead"] is None and "0.0%" not in result.stdout


def test_profile_refuses_a_folder_it_did_not_write(workdir, prepared):
    (workdir / "mine").mkdir()
    (workdir / "mine" / "trace.json").write_text("my own trace")
    result = gpuflow_cli(
        "profile", "--steps", "1", "--warmup", "0", "--device", "cpu", "--out", "mine",
        "--set", f"data.dir={prepared}", *[a for s in FAST for a in ("--set", s)], cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 2
    assert "mine exists and is not a gpuflow profile folder" in result.stderr
    assert (workdir / "mine" / "trace.json").read_text() == "my own trace"


def test_bench_checkpoint_compares_blocking_and_async_saves(workdir, prepared):
    sets = [a for s in (*FAST, f"data.dir={prepared}") for a in ("--set", s)]
    result = gpuflow_cli(
        "bench", "checkpoint", "--preset", "tiny", "--rounds", "1", "--window", "3",
        "--device", "cpu", "--out", "res", *sets, cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [path] = (workdir / "res").glob("*-checkpoint-*-cpu.json")
    record = json.loads(path.read_text())
    assert [row["kind"] for row in record["rows"]] == ["pytorch", "blocking", "async"]
    assert all(len(row["stall_ms_rounds"]) == 1 for row in record["rows"])
    assert record["step_ms"] > 0 and record["async_write_s"] > 0
    # model + optimizer files: the fp32 weights and two moments, and their headers.
    assert record["file_bytes"] > 3 * 4 * 60_000 and record["state_bytes"] < record["file_bytes"]
    assert "async write took" in result.stdout
    assert not list(workdir.glob("gpuflow-bench-checkpoint-*"))  # scratch removed


def test_bench_soak_samples_memory_over_a_run(workdir, prepared):
    sets = [
        a
        for s in (*FAST, f"data.dir={prepared}", "train.log_interval=2", "train.eval_interval=4")
        for a in ("--set", s)
    ]
    result = gpuflow_cli(
        "bench", "soak", "--steps", "24", "--device", "cpu", "--out", "res",
        "--set", "train.checkpoint_interval=4", *sets, cwd=workdir,
    )  # fmt: skip
    [path] = (workdir / "res").glob("*-soak-*-cpu.json")
    record = json.loads(path.read_text())
    assert result.returncode == (0 if record["flat"] else 1), result.stderr
    assert record["steps"] == 24 and record["warmup_steps"] == 6
    rss = record["samples"]["rss_bytes"]
    assert [step for step, _ in rss] == list(range(2, 25, 2)) and all(v > 0 for _, v in rss)
    assert set(record["verdicts"]) == {"rss_bytes"}  # the cpu reports no pinned or device memory
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_a_bench_whose_results_cannot_be_written_says_so_before_it_runs(tmp_path, capsys):
    blocker = tmp_path / "results"
    blocker.write_text("a file where the results folder would go")
    started = time.perf_counter()
    assert main(["bench", "transfer", "--quick", "--device", "cpu", "--out", str(blocker)]) == 2
    assert time.perf_counter() - started < 5  # refused before measuring anything
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot write bench results into") and "\n" not in err
    assert blocker.read_text() == "a file where the results folder would go"
