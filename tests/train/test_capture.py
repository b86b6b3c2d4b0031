"""The captured step's logic on the CPU: warm-up, capture, rebind, replay, with a stand-in
for CUDA's graphs; the device-side schedule and draw against their eager forms."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch

import gpuflow.bench.baselines  # noqa: F401  (registers the naive and standard paths)
from gpuflow.device.accelerator import Device
from gpuflow.train.capture import CapturedStep
from gpuflow.train.config import TrainConfig, resolve_config
from gpuflow.train.datapath import DataPath, open_batches
from gpuflow.train.optim.master_adamw import MasterAdamW
from gpuflow.train.schedule import lr_at, lr_tensor
from gpuflow.train.step import GraphStep, StepOptions, StepParts, build_step
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST


class StandInGraphs:
    """CUDA graphs' contract on the CPU: a capture records the body without running it,
    and each replay runs what was recorded. Every call is logged."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def run_on_side_stream(self, body):
        self.log.append("eager")
        body()

    def capture(self, body):
        self.log.append("capture")
        graphs = self

        class Recorded:
            def replay(self) -> None:
                graphs.log.append("replay")
                body()

            def reset(self) -> None:
                graphs.log.append("reset")

        return Recorded()


def test_warm_up_then_one_capture_then_the_rebind_then_replays():
    graphs = StandInGraphs()
    ran = []
    step = CapturedStep(
        lambda: ran.append(len(graphs.log)),
        warmup=3,
        after_capture=lambda: graphs.log.append("rebind"),
        graphs=graphs,
    )
    for _ in range(6):
        step()
    assert graphs.log == [
        "eager", "eager", "eager", "capture", "rebind", "replay", "replay", "replay",
    ]  # fmt: skip
    assert len(ran) == 6  # the capture itself ran nothing
    assert step.calls == 6
    step.release()  # frees the graph; a later call captures anew
    step.release()  # nothing left to free
    step()
    assert graphs.log[8:] == ["reset", "capture", "rebind", "replay"]


@pytest.mark.parametrize("fails", [False, True])
def test_the_runs_step_frees_its_graph_when_it_closes(prepared, workdir, fails):
    """``Trainer.open_step`` releases the captured graph on the way out, also when the loop
    inside fails: a graph that captured NCCL collectives would keep the job from leaving
    its process group (``gpuflow.train.distributed.stop``)."""
    cpu = Device("cpu")
    sets = [*FAST, f"data.dir={prepared}", "train.steps=8", "train.warmup_steps=3"]
    graphs = StandInGraphs()
    trainer = Trainer(resolve_config("tiny", None, sets), workdir / "runs" / "g", cpu,
                      options=StepOptions(graphs=graphs))  # fmt: skip
    trainer.build(resume=False, say=lambda note: None)
    trainer.setup = dataclasses.replace(  # as on CUDA; the stand-in records the graph
        trainer.setup,
        path=DataPath.RESIDENT_GRAPH,
        optimizer=MasterAdamW(trainer.setup.optimizer),
    )
    failure = pytest.raises(RuntimeError, match="mid-loop") if fails else nullcontext()
    with failure, trainer.open_step(0, 8) as train_step:
        for step in range(5):
            train_step(step)
        assert graphs.log[-1] == "replay"
        if fails:
            raise RuntimeError("mid-loop")
    assert graphs.log[-1] == "reset" and graphs.log.count("reset") == 1
    assert train_step.captured.graph is None


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(steps=50, warmup_steps=10),
        TrainConfig(steps=50, warmup_steps=0, min_lr_ratio=0.0),
        TrainConfig(steps=50, warmup_steps=5, decay_steps=20),  # steps past the schedule
    ],
)
def test_the_schedules_tensor_form_is_its_float_form(config):
    steps = torch.arange(60)
    on_device = [lr_tensor(s, config).item() for s in steps]
    on_host = [lr_at(int(s), config) for s in steps]
    assert on_device == pytest.approx(on_host, rel=1e-6, abs=1e-6 * config.lr)  # fp32 vs float
    assert lr_at(config.warmup_steps, config) == pytest.approx(config.lr)


def _losses(train_step, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        train_step(step)
        losses += [means["loss"] for _, means in train_step.scalars.drain(step + 1)]
    return losses


def test_the_captured_step_trains_as_the_eager_step_with_master_weights(prepared, workdir):
    """The captured path on the CPU through the stand-in: batches drawn from the device step
    counter, the learning rate computed from it, MasterAdamW's update (its reference path,
    which reads the lr from a tensor), the scalars summed on the device. Against the eager
    step with the same optimizer, the losses agree step by step."""
    cpu = Device("cpu")
    sets = [*FAST, f"data.dir={prepared}", "train.steps=8", "train.warmup_steps=3"]
    config = resolve_config("tiny", None, [*sets, "train.data_path=resident"])
    losses = {}
    for path in (DataPath.RESIDENT, DataPath.RESIDENT_GRAPH):
        trainer = Trainer(config, workdir / "runs" / path, cpu)
        trainer.build(resume=False, say=lambda note: None)
        optimizer = MasterAdamW(trainer.setup.optimizer)  # reference path: no triton on the CPU
        graphs = StandInGraphs()
        with open_batches(path, trainer.setup.plan, cpu, 0, 8) as batches:
            parts = StepParts(
                trainer.setup.model, trainer.setup.model, optimizer, config.train, cpu,
                StepOptions(graphs=graphs),
            )  # fmt: skip
            train_step = build_step(path, parts, batches)
            losses[path] = _losses(train_step, 8)
        if path is DataPath.RESIDENT_GRAPH:
            assert isinstance(train_step, GraphStep)
            assert graphs.log == ["eager"] * 3 + ["capture"] + ["replay"] * 5
            assert batches.counter.item() == 8  # each replay drew the next step's batch
            assert train_step.lr.item() == pytest.approx(lr_at(7, config.train), rel=1e-6)
    eager, captured = losses[DataPath.RESIDENT], losses[DataPath.RESIDENT_GRAPH]
    assert len(captured) == 8 and captured[-1] < captured[0]
    assert captured == pytest.approx(eager, rel=1e-4)


def test_a_source_without_a_device_draw_is_refused_for_the_captured_step(prepared, workdir):
    cpu = Device("cpu")
    sets = [*FAST, f"data.dir={prepared}", "train.steps=4", "train.data_path=standard"]
    config = resolve_config("tiny", None, sets)
    trainer = Trainer(config, workdir / "runs" / "s", cpu)
    trainer.build(resume=False, say=lambda note: None)
    with (
        open_batches(DataPath.STANDARD, trainer.setup.plan, cpu, 0, 4) as batches,
        pytest.raises(ValueError, match="cannot be drawn inside a CUDA graph"),
    ):
        parts = StepParts(
            trainer.setup.model,
            trainer.setup.model,
            trainer.setup.optimizer,
            config.train,
            cpu,
            StepOptions(),
        )
        build_step(DataPath.RESIDENT_GRAPH, parts, batches)


def test_compile_options_leave_out_what_this_torchs_inductor_lacks():
    import torch._inductor.config as inductor_config

    from gpuflow.train.step import COMPILE_OPTIONS, known_to_inductor

    kept = known_to_inductor({"combo_kernels": True, "an_option_no_torch_has": 1})
    assert kept == {"combo_kernels": True}
    assert COMPILE_OPTIONS["combo_kernels"] is True
    assert all(hasattr(inductor_config, name) for name in COMPILE_OPTIONS)
