"""Gradient accumulation on the cpu: k micro-batches give one batch k times their size's
update, in the eager step and the captured one (bf16 weights summed in fp32), and the step's
batching is planned, refused and found as the config asks."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.train.accumulate import FP32Sum, accumulated_loss
from gpuflow.train.batching import plan_batching
from gpuflow.train.config import resolve_config
from gpuflow.train.datapath import DataPath, open_batches
from gpuflow.train.optim.master_adamw import MasterAdamW
from gpuflow.train.report import build_report
from gpuflow.train.step import StepOptions, StepParts, build_step
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST
from tests.train.test_capture import StandInGraphs

STEPS = 4
WHOLE = ("train.batch_size=8",)  # one batch of 8 windows of 32 tokens a step
SPLIT = ("train.batch_size=2", "train.batch_tokens=256")  # the same 256 tokens, in 4 parts


def _trained(prepared, workdir, name, path: DataPath, master: bool, sets: tuple[str, ...]):
    """The losses and weights of STEPS steps of ``path``'s step (over MasterAdamW's bf16
    weights where ``master``: its reference path, as the captured step runs it on CUDA)."""
    cpu = Device("cpu")
    sets = (*FAST, f"data.dir={prepared}", *sets, f"train.steps={STEPS}", "train.warmup_steps=2")
    config = resolve_config("tiny", None, sets)
    trainer = Trainer(config, workdir / "runs" / name, cpu)
    trainer.build(resume=False, say=lambda note: None)
    setup = trainer.setup
    optimizer = MasterAdamW(setup.optimizer) if master else setup.optimizer
    initial = {k: v.float().clone() for k, v in setup.model.state_dict().items()}
    graphs = StandInGraphs()
    losses = []
    with open_batches(path, setup.plan, cpu, 0, STEPS) as batches:
        parts = StepParts(
            setup.model, setup.model, optimizer, config.train, cpu, StepOptions(graphs=graphs),
            None, setup.batching.accumulation,
        )  # fmt: skip
        train_step = build_step(path, parts, batches)
        for step in range(STEPS):
            train_step(step)
            losses += [means["loss"] for _, means in train_step.scalars.drain(step + 1)]
    # the fp32 values: MasterAdamW's masters where it holds them
    held = optimizer.full_precision_state(setup.model) if master else setup.model.state_dict()
    weights = {k: v.float().clone() for k, v in held.items()}
    moved = {k: (weights[k] - initial[k]).abs().mean() for k in weights}
    return losses, weights, train_step, setup.batching, moved


@pytest.mark.parametrize(
    ("path", "master"), [(DataPath.RESIDENT, False), (DataPath.RESIDENT_GRAPH, True)]
)
def test_micro_batches_update_as_one_batch_of_their_sum(prepared, workdir, path, master):
    whole = _trained(prepared, workdir, "whole", path, master, WHOLE)
    split = _trained(prepared, workdir, "split", path, master, SPLIT)
    assert (whole[3].accumulation, split[3].accumulation) == (1, 4)
    assert whole[3].tokens_per_step == split[3].tokens_per_step == 256
    # The same windows each step (drawn whole, then split), the same mean loss over them.
    tolerance = {"rel": 2e-3} if master else {"rel": 1e-5}  # bf16 weights: rounded products
    assert split[0] == pytest.approx(whole[0], **tolerance)
    assert split[0][-1] < split[0][0]
    # AdamW's first steps divide by tiny second moments, so a rare weight may differ by a few
    # percent of a step (in fp32), or by a step (bf16 weights: a gradient's rounding flips the
    # sign of a near-zero one); on average the runs must agree to a small part of how far the
    # weights moved (a wrong batch or scale would move them differently by about as much).
    for name, weight in whole[1].items():
        gap = (split[1][name] - weight).abs()
        assert gap.mean() < (0.02 if master else 1e-4) * whole[4][name], name
        if not master:
            assert gap.max() < 1e-4, name
    if master:
        assert split[2].sum is not None  # bf16 weights: the micro-batches summed in fp32
        assert split[2].captured.graph is not None  # and the captured body ran the parts


def test_the_validation_windows_do_not_depend_on_the_micro_batch(prepared, workdir):
    """A step's split (or the device its micro-batch was found on) is no reason to validate
    on other text: the same windows, and at the same weights the same loss."""
    digests, losses = set(), []
    for rows in (8, 4, 2):
        sets = (*FAST, f"data.dir={prepared}", f"train.batch_size={rows}", *SPLIT[1:])
        trainer = Trainer(resolve_config("tiny", None, sets), workdir / f"v{rows}", Device("cpu"))
        trainer.build(resume=False, say=lambda note: None)
        assert trainer.setup.batching.micro_batch == rows
        digests.add(trainer.setup.val_set)
        losses.append(trainer.evaluate())
    assert len(digests) == 1
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) == losses[2]


def test_bf16_gradients_are_summed_in_fp32_and_rounded_once():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, bias=False).bfloat16()
    inputs = torch.randn(16, 64).bfloat16()  # (4 micro-batches of 4, 64)
    parts = [layer(x).float().square().mean() for x in inputs.chunk(4)]
    grads = [torch.autograd.grad(p, layer.weight)[0] / 4 for p in parts]  # bf16 each
    summed = FP32Sum([layer.weight])
    loss = accumulated_loss(
        lambda x, _: layer(x).float().square().mean(), inputs, inputs, 4, nullcontext, summed.add
    )
    summed.finish()
    exact = sum(g.float() for g in grads).bfloat16()  # fp32 sum, one rounding
    assert torch.equal(layer.weight.grad, exact)
    assert float(loss) == pytest.approx(sum(float(p.detach()) for p in parts) / 4, rel=1e-6)
    assert FP32Sum.needed_for([layer.weight], 1) is None  # one micro-batch: nothing to sum
    assert FP32Sum.needed_for([torch.nn.Parameter(torch.ones(2))], 4) is None  # fp32: autograd


def test_the_step_is_planned_from_its_tokens():
    config = resolve_config("gpt2-124m", None, ["train.batch_tokens=524288"])
    one = plan_batching(config)
    assert (one.micro_batch, one.accumulation, one.tokens_per_step) == (16, 32, 524288)
    four = plan_batching(config, world_size=4)
    assert (four.micro_batch, four.accumulation, four.rows) == (16, 8, 128)
    assert "524,288 tokens a step, 8 micro-batches of 16 x 1024 on each of 4 ranks" in (
        four.describe()
    )
    plain = plan_batching(resolve_config("gpt2-124m"))  # no batch_tokens: one micro-batch
    assert (plain.micro_batch, plain.accumulation, plain.tokens_per_step) == (16, 1, 16384)
    with pytest.raises(
        GpuflowError, match="does not share out into whole sequences of 1024 over 3"
    ):
        plan_batching(config, world_size=3)
    odd = resolve_config("gpt2-124m", None, ["train.batch_tokens=524288", "train.batch_size=24"])
    with pytest.raises(GpuflowError, match=r"train.batch_size \(24\) does not divide"):
        plan_batching(odd)


def test_an_automatic_micro_batch_is_the_largest_divisor_that_fits():
    config = resolve_config("gpt2-350m")  # 512 sequences a step, micro-batch found
    fits = lambda b: b <= 12  # noqa: E731 - a device where 12 sequences fit
    found = plan_batching(config, fits=fits)
    assert (found.micro_batch, found.accumulation) == (8, 64)  # 12 does not divide 512
    assert "the largest that fits the device" in found.describe()
    assert plan_batching(config, fits=lambda b: True).micro_batch == 64  # capped: 65,536 tokens
    assert plan_batching(config).micro_batch == 8  # off a GPU: at most 8,192 tokens
    with pytest.raises(GpuflowError, match="not even one sequence"):
        plan_batching(config, fits=lambda b: False)


def test_the_run_says_and_reports_its_step(prepared, workdir, capsys):
    config = resolve_config("tiny", None, [*FAST, f"data.dir={prepared}", *SPLIT,
                                           "train.steps=4", "train.log_interval=2"])  # fmt: skip
    result = Trainer(config, workdir / "runs" / "acc", Device("cpu")).run()
    assert result.tokens_per_step == 256
    said = capsys.readouterr()
    assert "batch: 256 tokens a step, 4 micro-batches of 2 x 32" in said.err + said.out
    report = build_report(config, result)
    assert (report["tokens_per_step"], report["micro_batch"], report["accumulation"]) == (256, 2, 4)
