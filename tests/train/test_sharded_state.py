"""The split update's optimizer state: each rank holds its part only, rank 0 gathers it
whole for a checkpoint, and that checkpoint resumes on any number of ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpuflow.train.optim import master_adamw
from gpuflow.train.optim.adamw import decay_groups
from gpuflow.train.optim.master_adamw import MasterAdamW
from gpuflow.train.sharded import ShardedAverager
from gpuflow.train.step import Update

SHAPES = [(40, 24), (24,), (7, 9), (70, 64)]  # one not a multiple of 8, one over a block


def _gradients(step: int) -> list[torch.Tensor]:
    """The same on every rank, so their mean is exact and any split updates alike."""
    g = torch.Generator().manual_seed(step)
    return [(torch.randint(-8, 8, s, generator=g) / 64).bfloat16() for s in SHAPES]


def _train(rank: int, world: int, steps: range, load: str | None, save: str | None) -> None:
    """MasterAdamW split ``world`` ways over SHAPES, from ``load`` (a checkpoint as rank 0
    saved it) or from seed 0; rank 0 saves the whole state after ``steps`` to ``save``."""
    torch.manual_seed(0)
    module = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s)) for s in SHAPES)
    adamw = torch.optim.AdamW(decay_groups(list(module), 0.1), lr=1e-2)
    if load is not None:
        saved = torch.load(load)
        with torch.no_grad():
            for p, w in zip(module, saved["weights"], strict=True):
                p.copy_(w)
        adamw.load_state_dict(saved["optimizer"])
    opt = MasterAdamW(adamw, (rank, world))
    whole_size = opt.weights.numel()
    assert opt.master.numel() == opt.exp_avg.numel() == whole_size // world  # a part only
    update = Update(
        module, opt, 0.0, fused_clip=True, averager=ShardedAverager(opt) if world > 1 else None
    )
    for step in steps:
        for p, grad in zip(module, _gradients(step), strict=True):
            p.grad = grad.clone()
        update(torch.tensor(1.0))
    opt.gather_state()
    if rank == 0 and save is not None:
        index = {id(p): i for i, p in enumerate(opt.params)}  # the optimizer's order
        weights = [opt.master_of(index[id(p)]).clone() for p in module]
        optimizer = opt.state_dict()
        optimizer["state"] = {
            i: {k: v.clone() for k, v in slots.items()} for i, slots in optimizer["state"].items()
        }
        torch.save({"weights": weights, "optimizer": optimizer}, save)
    elif rank != 0:
        with pytest.raises(RuntimeError, match="gather_state"):
            opt.state_dict()  # only rank 0 holds the whole state


def _rank(rank: int, world: int, store: str, *args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    master_adamw.GATHER_ELEMENTS = 40  # gathered in many pieces, the last one short
    try:
        _train(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _on_ranks(world: int, tmp_path, name: str, *args) -> None:
    store = tmp_path / f"store.{name}"
    mp.spawn(_rank, args=(world, str(store), *args), nprocs=world)


def test_a_split_state_is_whole_in_its_checkpoint_and_resumes_on_any_number_of_ranks(tmp_path):
    first, rest = range(3), range(3, 6)
    whole = tmp_path / "whole.pt"
    _train(0, 1, range(6), None, str(whole))  # one process, uninterrupted
    expected = torch.load(whole)
    for saved_on, resumed_on in ((4, 1), (4, 2), (2, 4)):
        ckpt, out = tmp_path / f"on{saved_on}.pt", tmp_path / f"{saved_on}to{resumed_on}.pt"
        if not ckpt.exists():
            _on_ranks(saved_on, tmp_path, f"save{saved_on}", first, None, str(ckpt))
        if resumed_on == 1:
            _train(0, 1, rest, str(ckpt), str(out))
        else:
            _on_ranks(resumed_on, tmp_path, f"resume{saved_on}", rest, str(ckpt), str(out))
        result = torch.load(out)
        # every element updated by the rank that owns it, as one process updates it
        for ours, theirs in zip(result["weights"], expected["weights"], strict=True):
            assert torch.equal(ours, theirs)
        for i, slots in expected["optimizer"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(result["optimizer"]["state"][i][key], slots[key]), (i, key)
