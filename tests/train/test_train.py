"""Training runs on the cpu: learning, checkpoints, exact resume, and refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import gpuflow.bench.baselines  # noqa: F401  (registers the naive and standard paths)
from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.pipeline import PrepareConfig, prepare
from gpuflow.data.resident.batches import validation_windows
from gpuflow.data.shards import Shard, write_shard
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import GPT
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import resolve_config
from gpuflow.train.optim.adamw import build_optimizer
from gpuflow.train.runfolder import read_metrics
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST, load_checkpoint


def _config(data: Path, *sets: str):
    return resolve_config("tiny", None, [*FAST, f"data.dir={data}", *sets])


def _train(config, run_dir: Path, resume: bool = False):
    return Trainer(config, run_dir, Device("cpu")).run(resume=resume)


def test_tiny_preset_lowers_validation_loss(prepared, workdir):
    config = resolve_config(
        "tiny",
        None,
        [
            f"data.dir={prepared}",
            "train.steps=40",
            "train.eval_interval=40",
            "train.warmup_steps=4",
        ],
    )
    result = _train(config, workdir / "runs" / "tiny")
    val = [r["val_loss"] for r in read_metrics(result.run_dir) if "val_loss" in r]
    assert [r["step"] for r in read_metrics(result.run_dir) if "val_loss" in r] == [0, 40]
    assert val[0] > 6.0  # untrained: about ln(512)
    assert val[-1] < val[0] - 1.0
    assert result.last_step == 40 and not result.interrupted


def test_run_folder_holds_everything(prepared, workdir):
    run_dir = workdir / "runs" / "r"
    _train(
        _config(
            prepared,
            "train.steps=6",
            "train.checkpoint_interval=2",
            "train.keep_checkpoints=2",
            "train.log_interval=3",
        ),
        run_dir,
    )
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "tokenizer.json").read_text() == (prepared / "tokenizer.json").read_text()
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step_000004", "step_000006"]
    files = sorted(p.name for p in (run_dir / "checkpoints" / "step_000006").iterdir())
    assert files == ["model.safetensors", "optimizer.safetensors", "state.json"]
    # Records fall on logging steps alone; a checkpoint inside an interval keeps its part.
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == [3, 6]
    state = json.loads((run_dir / "checkpoints" / "step_000006" / "state.json").read_text())
    assert state["step"] == 6 and state["data"]["next_step"] == 6 and "interval" not in state
    inside = json.loads((run_dir / "checkpoints" / "step_000004" / "state.json").read_text())
    assert {k: inside["interval"][k] for k in ("through", "steps")} == {"through": 4, "steps": 1}
    assert set(inside["interval"]["means"]) == {"loss", "grad_norm"}


@pytest.mark.parametrize(
    "extra", [(), ("train.batch_size=4", "train.batch_tokens=256")], ids=["batch", "accumulated"]
)
def test_resume_reproduces_the_uninterrupted_loss_curve_bit_exactly(prepared, workdir, extra):
    sets = (
        *extra,
        "train.steps=12",
        "train.log_interval=1",
        "train.checkpoint_interval=4",
        "train.keep_checkpoints=5",
        "train.eval_interval=6",
    )
    straight = workdir / "runs" / "straight"
    _train(_config(prepared, *sets), straight)

    resumed = workdir / "runs" / "resumed"
    _train(_config(prepared, *sets), resumed)
    for later in ckpt.list_checkpoints(resumed)[1:]:  # as if the run had died after step 4
        shutil.rmtree(later)
    result = _train(_config(prepared, *sets), resumed, resume=True)
    assert result.start_step == 4

    def curve(run_dir):
        return [
            (r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss"))
            for r in read_metrics(run_dir)
        ]

    assert curve(resumed) == curve(straight)
    assert len([c for c in curve(straight) if c[1] is not None]) == 12
    a = ckpt.latest_checkpoint(straight) / "model.safetensors"
    b = ckpt.latest_checkpoint(resumed) / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()


def test_finished_run_asks_for_more_steps(prepared, workdir):
    run_dir = workdir / "runs" / "done"
    _train(_config(prepared, "train.steps=3"), run_dir)
    with pytest.raises(GpuflowError, match="already finished 3 of 3 steps; train further with"):
        _train(_config(prepared, "train.steps=3"), run_dir, resume=True)
    result = _train(_config(prepared, "train.steps=5"), run_dir, resume=True)
    assert (result.start_step, result.last_step) == (3, 5)


def test_checkpoint_of_another_model_shape_is_refused(prepared, workdir):
    run_dir = workdir / "runs" / "shape"
    _train(_config(prepared, "train.steps=2"), run_dir)
    wider = _config(prepared, "train.steps=4", "model.d_model=96")
    with pytest.raises(GpuflowError, match=r"gives model d_model 96 \(trained with 64\)"):
        _train(wider, run_dir, resume=True)
    # A checkpoint from before the model's shape was recorded: its weights' shapes tell.
    state = ckpt.checkpoint_dir(run_dir) / "step_000002" / ckpt.STATE_FILE
    record = json.loads(state.read_text())
    del record[ckpt.MODEL_KEY]
    record[ckpt.RECORD_DIGEST] = ckpt.record_digest(record)
    state.write_text(json.dumps(record))
    with pytest.raises(
        GpuflowError,
        match=r"wte.weight of shape \(512, 64\) but this model's "
        r"is \(512, 96\)",
    ):
        _train(wider, run_dir, resume=True)


def test_incomplete_checkpoint_folders_are_ignored(prepared, workdir):
    run_dir = workdir / "runs" / "crash"
    _train(_config(prepared, "train.steps=2"), run_dir)
    partial = run_dir / "checkpoints" / ".step_000009.tmp-123"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    no_state = run_dir / "checkpoints" / "step_000008"
    no_state.mkdir()
    assert ckpt.latest_checkpoint(run_dir).name == "step_000002"


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(prepared, workdir, capsys):
    run_dir = workdir / "runs" / "corrupt"
    sets = ("train.checkpoint_interval=2", "train.log_interval=1")
    _train(_config(prepared, "train.steps=4", *sets), run_dir)
    damaged = ckpt.latest_checkpoint(run_dir) / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # a torn write
    capsys.readouterr()
    result = _train(_config(prepared, "train.steps=6", *sets), run_dir, resume=True)
    err = capsys.readouterr().err
    assert "skipping checkpoint step_000004" in err and "it is damaged" in err
    assert "resuming from the intact checkpoint step_000002" in err
    assert result.start_step == 2 and result.last_step == 6
    # Training past step 4 again wrote it again, whole.
    assert ckpt.read_checkpoint(ckpt.checkpoint_dir(run_dir) / "step_000004").step == 4


def _flip_a_byte(file) -> None:
    data = bytearray(file.read_bytes())
    data[-100] ^= 0x01  # inside the last tensor's data: same size, still a safetensors file
    file.write_bytes(bytes(data))


def _edit_state(folder, change) -> None:
    record = json.loads((folder / "state.json").read_text())
    change(record)
    (folder / "state.json").write_text(json.dumps(record))


@pytest.mark.parametrize(
    "damage,said",
    [
        (lambda f: _flip_a_byte(f / "model.safetensors"), "checksum differs"),
        (lambda f: _flip_a_byte(f / "optimizer.safetensors"), "checksum differs"),
        (lambda f: _edit_state(f, lambda r: r.update(step=3)), "was changed after"),
        (lambda f: _edit_state(f, lambda r: r["rng"].update(torch="AAAA")), "was changed after"),
    ],
    ids=["weights", "moments", "step", "rng"],
)
def test_a_checkpoint_changed_after_it_was_written_is_skipped(
    prepared, workdir, capsys, damage, said
):
    run_dir = workdir / "runs" / "flipped"
    sets = ("train.checkpoint_interval=2", "train.log_interval=1")
    _train(_config(prepared, "train.steps=4", *sets), run_dir)
    damage(ckpt.latest_checkpoint(run_dir))
    capsys.readouterr()
    result = _train(_config(prepared, "train.steps=6", *sets), run_dir, resume=True)
    err = capsys.readouterr().err
    assert "skipping checkpoint step_000004" in err and said in err, err
    assert "resuming from the intact checkpoint step_000002" in err
    assert result.start_step == 2 and result.last_step == 6


def test_every_checkpoint_damaged_is_a_clear_error(prepared, workdir):
    run_dir = workdir / "runs" / "corrupt"
    _train(_config(prepared, "train.steps=2"), run_dir)
    (ckpt.latest_checkpoint(run_dir) / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(GpuflowError, match=r"every checkpoint of .* is damaged"):
        _train(_config(prepared, "train.steps=4"), run_dir, resume=True)


def test_optimizer_state_survives_the_round_trip(prepared, workdir):
    run_dir = workdir / "runs" / "optim"
    config = _config(prepared, "train.steps=3")
    _train(config, run_dir)
    model = GPT(config.model)
    optimizer = build_optimizer(model, config.train, Device("cpu"))
    record = load_checkpoint(ckpt.latest_checkpoint(run_dir), model, optimizer)
    assert record["step"] == 3
    state = optimizer.state[model.wte.weight]
    assert float(state["step"]) == 3.0
    assert state["exp_avg"].abs().sum() > 0
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    decayed, not_decayed = (len(g["params"]) for g in optimizer.param_groups)
    assert decayed == 2 + 4 * config.model.n_layer  # wte, wpe and four matrices per block
    assert not_decayed == 2 * config.model.n_layer + 1  # LayerNorm gains


def _shard_of(tmp_path, name, n_tokens, first_id=0):
    """A shard whose token ids are their positions (plus ``first_id``)."""
    path = tmp_path / name
    write_shard(path, np.arange(first_id, first_id + n_tokens, dtype=np.uint16))
    return Shard.open(path)


def test_validation_windows_are_disjoint_and_cover_the_split(tmp_path):
    shards = (_shard_of(tmp_path, "a.bin", 1000), _shard_of(tmp_path, "b.bin", 600, 5000))
    batches = validation_windows(shards, batch_size=4, seq_len=16, max_batches=100)
    windows = np.concatenate(batches)  # (N, 17)
    assert all(b.shape == (4, 17) for b in batches)
    assert len(windows) == 4 * ((999 // 16 + 599 // 16) // 4)
    # Each window is a run of consecutive tokens from one shard (the ids are positions).
    assert np.all(np.diff(windows.astype(np.int64), axis=1) == 1)
    starts = np.sort(windows[:, 0].astype(np.int64))
    assert starts[0] == 0 and windows[:, -1].max() >= 5583  # from the start to the end
    for shard_starts in (starts[starts < 5000], starts[starts >= 5000]):
        assert np.all(np.diff(shard_starts) >= 16)  # disjoint: no token is predicted twice


def test_short_validation_split_still_gives_one_batch(tmp_path):
    shards = (_shard_of(tmp_path, "v.bin", 300),)
    batches = validation_windows(shards, batch_size=8, seq_len=128, max_batches=20)
    assert len(batches) == 1 and batches[0].shape == (8, 129)
    with pytest.raises(GpuflowError, match="no run of 129 tokens"):
        validation_windows((_shard_of(tmp_path, "w.bin", 100),), 8, 128, 20)


def test_the_largest_preset_trains_on_the_builtin_corpus_shapes(tmp_path, stdlib_documents):
    """seed-d512 needs 64 windows of 513 tokens; the built-in val split must supply them."""
    out = tmp_path / "stdlib"
    prepare(PrepareConfig(out=str(out), vocab_size=2000))
    folder = TokenFolder.open(out)
    batches = validation_windows(folder.val, batch_size=64, seq_len=512, max_batches=20)
    assert batches and batches[0].shape == (64, 513)


@pytest.mark.parametrize(
    "data_path", ["naive", "standard", "streamed", "resident", "resident-graph"]
)
def test_every_data_path_trains_tiny_to_a_lower_loss(prepared, workdir, data_path, capsys):
    config = _config(
        prepared, "train.steps=30", "train.eval_interval=30", f"train.data_path={data_path}"
    )
    result = _train(config, workdir / "runs" / data_path)
    val = [r["val_loss"] for r in read_metrics(result.run_dir) if "val_loss" in r]
    assert val[-1] < val[0] - 0.3
    if data_path == "resident-graph":  # no CUDA graphs on the cpu: said, then run eagerly
        assert (
            "resident-graph needs CUDA graphs; running resident eagerly" in capsys.readouterr().err
        )


def test_an_unknown_data_path_is_refused(prepared):
    with pytest.raises(GpuflowError, match=r"train\.data_path must be one of"):
        _config(prepared, "train.data_path=teleport")


def test_interval_throughput_leaves_pauses_out():
    import time

    from gpuflow.train.meter import Throughput

    throughput = Throughput(tokens_per_step=1000, device=Device.resolve("cpu"))
    throughput.restart()
    for _ in range(2):
        time.sleep(0.05)  # a 50 ms step
        throughput.step()
    with throughput.paused():  # an evaluation: not training time
        time.sleep(0.2)
    rate = throughput.rate(throughput.close_interval())
    assert 2000 / 0.2 < rate <= 2000 / 0.1  # 2 steps in 0.1 s (+ overhead), pause excluded
    with throughput.paused():  # an interval whose only step ran under the ledger
        time.sleep(0.01)
    assert throughput.rate(throughput.close_interval()) is None
    assert throughput.rates == [rate]


def test_the_report_says_what_chunk_turns_cost(prepared, workdir):
    from gpuflow.train.report import build_report

    streamed = _config(prepared, "train.steps=30", "data.device_budget_mb=0.01")
    report = build_report(streamed, _train(streamed, workdir / "runs" / "chunks"))
    turns = report["chunk_turns"]
    assert turns["turns"] >= 1 and turns["bytes"] > 0 and turns["seconds"] > 0
    resident = _config(prepared, "train.steps=2")
    assert (
        build_report(resident, _train(resident, workdir / "runs" / "whole"))["chunk_turns"] is None
    )


def test_evaluation_in_pieces_gives_the_whole_batches_loss(prepared, workdir, monkeypatch):
    """Validation runs in pieces of at most EVAL_PIECE_TOKENS (beside a captured step's
    memory a whole micro-batch's logits may not fit); the mean over every token is the same."""
    from gpuflow.train import trainer as trainer_module

    config = _config(prepared, "train.steps=2", "train.eval_batches=3")
    trainer = Trainer(config, workdir / "runs" / "e", Device("cpu"))
    trainer.build(resume=False, say=lambda note: None)
    whole = trainer.evaluate()
    monkeypatch.setattr(trainer_module, "EVAL_PIECE_TOKENS", 3 * config.model.max_len)
    # pieces of 3, 3 and 2 rows: float32 rounding only (kernels may sum fewer rows in
    # another order on other CPUs)
    assert trainer.evaluate() == pytest.approx(whole, rel=1e-5)
    batches = trainer.setup.val_batches
    model = trainer.setup.model
    with torch.no_grad():
        by_hand = sum(float(model(b[:, :-1], b[:, 1:])) for b in batches) / len(batches)
    assert whole == pytest.approx(by_hand, rel=1e-6)
