"""pack's planner: write jobs that fill a buffer as write_into does, one layout shared among like
batches, direct leaves that cross where they lie, and table columns crossing as one run."""

from __future__ import annotations

import torch

from gpuflow.transfer.packing import ALIGN, pack, plan_pack, rebuild, unpack


def test_write_jobs_fill_the_buffer_exactly_as_write_into_does():

    batch = {
        "x": torch.randn(3000),  # crosses as it is: split into 1 KiB byte ranges
        "ids": torch.arange(500),  # narrowed to uint16: written at once
        "rows": [torch.randn(7) for _ in range(4)],  # stacked: written at once
        "t": torch.randn(10, 12).t(),  # stored in its memory order: one byte range
    }
    plan = plan_pack(batch)
    whole = torch.zeros(plan.nbytes, dtype=torch.uint8)
    plan.write_into(whole)
    jobs_buffer = torch.zeros(plan.nbytes, dtype=torch.uint8)
    jobs = plan.write_jobs(jobs_buffer, chunk=1024)
    assert len(jobs) == 12 + 1  # ceil(12000 / 1024) ranges for x, one for t's 480 bytes
    x, ids, rows, t = plan.layout.leaves
    for leaf in (ids, rows):  # converted or stacked: written already, by torch
        where = slice(leaf.offset, leaf.offset + leaf.nbytes)
        assert torch.equal(jobs_buffer[where], whole[where])
    for leaf in (x, t):
        assert not jobs_buffer[leaf.offset : leaf.offset + leaf.nbytes].any()
    for job in reversed(jobs):  # in any order
        job()
    assert torch.equal(whole, jobs_buffer)


def test_a_planner_shares_one_layout_among_like_batches_and_only_among_them():
    from gpuflow.transfer.packing import Planner

    planner = Planner(narrow=True, lossy_float=None)

    def plan(x, ids):
        return planner.plan_pack({"x": x, "ids": torch.tensor(ids)})

    x = torch.ones(3, 4)
    first, like = plan(torch.zeros(3, 4), [1, 2]), plan(x, [5, 6])
    assert like.layout is first.layout and like.sources[0] is x
    assert plan(x, [70000, 1]).layout is not first.layout  # ids no longer fit uint16
    assert plan(torch.ones(3, 5), [5, 6]).layout is not first.layout
    assert plan(x, [5, 6]).layout is first.layout
    # a batch outside the quick walk (a string in it) is planned in full every time
    odd = [planner.plan_pack({"x": x, "name": "a"}) for _ in range(2)]
    assert odd[0].layout is not odd[1].layout


def _run_and_each_alone(planner, batches):
    """``batches`` planned by ``planner`` (one layout), written end to end into one buffer:
    (rebuilt as one run, rebuilt alone, as sent) for each."""
    from gpuflow.transfer.packing import rebuild_run

    plans = [planner.plan_pack(b) for b in batches]
    stride = plans[0].nbytes
    assert stride % ALIGN == 0
    buffer = torch.zeros(stride * len(plans), dtype=torch.uint8)
    for i, plan in enumerate(plans):
        plan.write_into(buffer, i * stride)
    run = rebuild_run(buffer, plans[0].spec, 0, stride, len(plans))
    alone = [rebuild(buffer[i * stride : (i + 1) * stride], p.spec) for i, p in enumerate(plans)]
    return list(zip(run, alone, batches, strict=True))


def test_rebuilding_a_run_of_like_batches_equals_rebuilding_each():
    from gpuflow.transfer.packing import Planner

    planner = Planner(narrow=True, lossy_float=None)
    batches = [
        {"x": torch.randn(2, 3), "ids": torch.arange(i, i + 4), "pair": (torch.ones(1) * i, 7)}
        for i in range(5)
    ]
    for got, alone, sent in _run_and_each_alone(planner, batches):
        for out in (got, alone):
            assert torch.equal(out["x"], sent["x"])
            assert out["ids"].dtype == torch.int64 and torch.equal(out["ids"], sent["ids"])
            assert torch.equal(out["pair"][0], sent["pair"][0]) and out["pair"][1] == 7


def test_direct_leaves_take_no_room_in_the_buffer_and_come_back_in_order(monkeypatch):
    """Pinned tensors of DIRECT_MIN_BYTES or more are copied into device tensors of their
    own, so the staging buffer holds only the rest (pinning is faked: no pinned memory on a
    machine without an accelerator)."""
    from gpuflow.transfer.packing import DIRECT_MIN_BYTES, Planner, rebuild_run

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    planner = Planner(narrow=True, lossy_float=None, direct=True)
    big = DIRECT_MIN_BYTES // 4  # float32 elements of a direct leaf
    batches = [
        {"image": torch.full((big,), float(i)), "label": torch.tensor([i]),
         "extra": torch.full((big,), -float(i))}
        for i in range(3)
    ]  # fmt: skip
    plans = [planner.plan_pack(b) for b in batches]
    plan = plans[0]
    assert [leaf.direct for leaf in plan.layout.leaves] == [True, False, True]
    assert plan.nbytes == ALIGN  # the label (narrowed to uint16) alone, padded
    assert plan.wire_nbytes == 2 + 2 * DIRECT_MIN_BYTES
    assert [source for _, source in plan.direct_pairs()] == [batches[0]["image"],
                                                             batches[0]["extra"]]  # fmt: skip
    buffer = torch.zeros(3 * plan.nbytes, dtype=torch.uint8)
    for i, p in enumerate(plans):
        p.write_into(buffer, i * plan.nbytes)
    # the "device" copies of the direct leaves: the consumer would get these tensors
    own = [[src.clone() for _, src in p.direct_pairs()] for p in plans]
    alone = rebuild(buffer[: plan.nbytes], plan.spec, iter(own[0]))
    assert alone["image"] is own[0][0] and alone["extra"] is own[0][1]
    run = rebuild_run(buffer, plan.spec, 0, plan.nbytes, 3, [iter(o) for o in own])
    for i, got in enumerate(run):
        assert got["image"] is own[i][0] and got["extra"] is own[i][1]
        assert got["label"].dtype == torch.int64 and got["label"].item() == i


def test_a_lone_small_pinned_tensor_beside_direct_ones_crosses_where_it_lies_when_owned(
    monkeypatch,
):
    """An image batch pinned by DataLoader's thread: the image is copied where it lies, and
    the labels, the only tensor left to stage, are too when the loader owns the batch and it
    is too large to share a crossing; staged when it is not owned (staging is what takes a
    source's memory) or small, when the labels would be narrowed or are not pinned, or when
    a second small tensor shares the staging."""
    from gpuflow.transfer.packing import DIRECT_MIN_BYTES, Planner

    pinned: set[int] = set()  # addresses of tensors kept alive below (no address reused)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.data_ptr() in pinned)
    made = []

    def batch(i: int, labels_pinned: bool = True, extra: bool = False) -> dict:
        out = {"image": torch.full((DIRECT_MIN_BYTES // 4,), float(i)),
               "label": torch.arange(4) + i}  # fmt: skip
        if extra:
            out["weight"] = torch.full((3,), float(i))
            pinned.add(out["weight"].data_ptr())
        pinned.add(out["image"].data_ptr())
        if labels_pinned:
            pinned.add(out["label"].data_ptr())
        made.append(out)
        return out

    over = DIRECT_MIN_BYTES  # a batch of more bytes crosses alone (this one: 32 more)
    planner = Planner(narrow=False, lossy_float=None, direct=True)
    for i in range(3):  # the first planned in full, the rest from the layout it made
        sent = batch(i)
        plan = planner.plan_pack(sent, lone_direct_over=over)
        assert [leaf.direct for leaf in plan.layout.leaves] == [True, True]
        assert plan.nbytes == 0 and not plan.has_staged
        assert plan.wire_nbytes == DIRECT_MIN_BYTES + 32
        own = [src.clone() for _, src in plan.direct_pairs()]  # the device copies
        got = rebuild(None, plan.spec, iter(own))
        assert torch.equal(got["label"], sent["label"]) and got["image"] is own[0]

    def staged(plan) -> list[str]:
        leaves = zip(plan.spec.keys, plan.layout.leaves, strict=True)
        return [key for key, leaf in leaves if not leaf.direct]

    assert staged(planner.plan_pack(batch(3), lone_direct_over=None)) == ["label"]
    pageable = planner.plan_pack(batch(4, labels_pinned=False), lone_direct_over=over)
    assert staged(pageable) == ["label"]
    two_small = planner.plan_pack(batch(5, extra=True), lone_direct_over=over)
    assert staged(two_small) == ["label", "weight"]
    narrowing = Planner(narrow=True, lossy_float=None, direct=True)
    assert staged(narrowing.plan_pack(batch(6), lone_direct_over=over)) == ["label"]
    small = planner.plan_pack(batch(9), lone_direct_over=DIRECT_MIN_BYTES + 32)
    assert staged(small) == ["label"]  # a batch that may share a crossing: labels gathered
    alone = planner.plan_pack({"label": batch(7)["label"]}, lone_direct_over=over)
    assert alone.has_staged  # nothing else crosses where it lies: staging gathers batches
    fresh = Planner(narrow=False, lossy_float=None, direct=True)  # planned in full
    pageable = fresh.plan_pack(batch(8, labels_pinned=False), lone_direct_over=over)
    assert staged(pageable) == ["label"]


def test_a_lone_tensor_stored_in_its_memory_order_goes_direct_and_a_conjugate_one_is_staged(
    monkeypatch,
):
    """The lone small tensor beside a direct one: transposed, it goes direct as well (stored
    in its memory order, a new view at each planning) and comes back with its strides; a
    lazily conjugated one, whose bytes are not its values, is staged and written resolved,
    and so is a large one that would otherwise be copied where it lies."""
    from gpuflow.transfer.packing import DIRECT_MIN_BYTES, Planner

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    image = torch.arange(DIRECT_MIN_BYTES // 4, dtype=torch.float32)
    over = DIRECT_MIN_BYTES

    m = torch.arange(8).reshape(2, 4).t()  # (4, 2), strides (1, 4)
    for planner in (Planner(False, None, direct=True), Planner(False, None, direct=True)):
        for _ in range(2):  # planned in full, then from the cached layout
            plan = planner.plan_pack({"image": image, "m": m}, over, pinned=True)
            assert [leaf.direct for leaf in plan.layout.leaves] == [True, True]
            own = [src.clone() for _, src in plan.direct_pairs()]
            got = rebuild(None, plan.spec, iter(own))
            assert torch.equal(got["m"], m) and got["m"].stride() == m.stride()

    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    big = torch.full((DIRECT_MIN_BYTES // 8,), 1 + 1j, dtype=torch.complex64).conj()
    planner = Planner(False, None, direct=True)
    for batch in ({"image": image, "z": z}, {"image": image, "z": z, "big": big}):
        plan = planner.plan_pack(batch, over)
        staged = {k for k, leaf in zip(batch, plan.layout.leaves, strict=True) if not leaf.direct}
        assert staged == set(batch) - {"image"}
        buffer = torch.zeros(plan.nbytes, dtype=torch.uint8)
        plan.write_into(buffer)
        own = [src.clone() for _, src in plan.direct_pairs()]
        got = rebuild(buffer, plan.spec, iter(own))
        for key in staged:
            assert torch.equal(got[key], batch[key].resolve_conj())


def test_a_batch_known_pinned_is_laid_out_without_asking_each_tensor(monkeypatch):
    """Batches DataLoader's pin thread made are pinned throughout: a later one of the same
    signature is laid out as the first was, asking none of its tensors whether it is pinned
    (each ask cost the training thread time); a batch in a dataclass, which that thread does
    not pin, is still asked about."""
    import dataclasses

    from gpuflow.transfer.packing import DIRECT_MIN_BYTES, Planner

    asked: list[int] = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: asked.append(1) or True)

    def batch(i: int) -> dict[str, torch.Tensor]:
        return {"image": torch.full((DIRECT_MIN_BYTES // 4,), float(i)), "label": torch.arange(4)}

    planner = Planner(narrow=False, lossy_float=None, direct=True)
    first = planner.plan_pack(batch(0), DIRECT_MIN_BYTES, pinned=True)  # planned in full
    assert asked and [leaf.direct for leaf in first.layout.leaves] == [True, True]
    asked.clear()
    later = planner.plan_pack(batch(1), DIRECT_MIN_BYTES, pinned=True)
    assert asked == [] and later.layout is first.layout
    assert [source[0].item() for _, source in later.direct_pairs()] == [1.0, 0]

    @dataclasses.dataclass
    class Pair:
        image: torch.Tensor
        label: torch.Tensor

    for i in range(2):
        asked.clear()
        planner.plan_pack(Pair(**batch(i)), DIRECT_MIN_BYTES, pinned=True)
        assert asked  # not walked: planned in full, asking each tensor


def test_large_pageable_tensors_are_pinned_then_copied_directly_and_smaller_ones_staged():
    from gpuflow.transfer.packing import DIRECT_MIN_BYTES, PIN_MIN_BYTES, Planner

    planner = Planner(narrow=True, lossy_float=None, direct=True)
    plan = planner.plan_pack(
        {
            "large": torch.zeros(PIN_MIN_BYTES // 4),  # pageable: pinned, then direct
            "medium": torch.zeros(DIRECT_MIN_BYTES // 4),  # pageable, under PIN_MIN_BYTES
            "ids": torch.arange(PIN_MIN_BYTES // 8) % 1000,  # large, but narrowed: staged
        }
    )
    large, medium, ids = plan.layout.leaves
    assert large.direct and large.pin
    assert not medium.direct and not ids.direct and ids.wire == torch.uint16
    assert plan.nbytes == DIRECT_MIN_BYTES + PIN_MIN_BYTES // 4
    assert not Planner(True, None, direct=False).plan_pack(torch.zeros(PIN_MIN_BYTES)).has_direct


def _columns(i: int) -> dict[str, torch.Tensor]:
    """A table batch: five fp32 columns (one a strided view), five int64 columns that
    narrow, and a column of another shape between them."""
    g = torch.Generator().manual_seed(i)
    floats = {f"f{k}": torch.randn(64, generator=g) for k in range(4)}
    floats["f4"] = torch.randn(128, generator=g)[::2]  # not contiguous: stacked all the same
    ints = {f"i{k}": torch.randint(0, 1000, (32,), generator=g) for k in range(5)}
    return {**floats, "odd": torch.randn(3, generator=g), **ints}


def test_columns_of_one_shape_cross_as_one_run_and_come_back_as_they_were():
    from gpuflow.transfer.packing import Planner

    batch = _columns(0)
    plan = Planner(narrow=True, lossy_float=None).plan_pack(batch)
    # one run of the five float columns, one of the five narrowed int columns
    assert [whole.shape for _, whole in plan.spec.runs] == [(5, 64), (5, 32)]
    assert plan.spec.runs[1][1].wire == torch.uint16
    assert [count for count, _ in plan.layout.write_runs.values()] == [5]  # (as they are)
    packed = pack(batch, narrow=True)
    back = unpack(packed, "cpu")
    assert list(back) == list(batch)
    for key, sent in batch.items():
        assert back[key].dtype == sent.dtype and torch.equal(back[key], sent), key


def test_a_run_of_like_batches_with_column_runs_equals_each_rebuilt_alone():
    from gpuflow.transfer.packing import Planner

    planner = Planner(narrow=True, lossy_float=None)
    batches = [_columns(i) for i in range(5)]
    assert planner.plan_pack(batches[0]).layout is planner.plan_pack(batches[1]).layout
    for got, alone, sent in _run_and_each_alone(planner, batches):
        for out in (got, alone):
            assert list(out) == list(sent)
            for key in sent:
                assert out[key].dtype == sent[key].dtype and torch.equal(out[key], sent[key])


def test_a_loader_of_table_batches_hands_out_every_column_as_it_was():
    from gpuflow.transfer.loader import DeviceLoader

    batches = [_columns(i) for i in range(40)]  # small: many share one copy
    with DeviceLoader(batches, "cpu", narrow=True) as loader:
        got = list(loader)
        assert loader.stats.copies < 40
    for out, sent in zip(got, batches, strict=True):
        for key in sent:
            assert torch.equal(out[key], sent[key]), key
