"""Which .bin files of a token folder are train shards and which val: the split is a word of
the name, so a train shard whose name holds 'val' inside a word is never validated on."""

from __future__ import annotations

import numpy as np
import pytest

from gpuflow.common.errors import GpuflowError
from gpuflow.data.shards import write_shard
from gpuflow.data.tokens import TokenFolder


def _folder(tmp_path, names):
    for i, name in enumerate(names):
        write_shard(tmp_path / name, np.full(64, i, dtype=np.uint16))
    return TokenFolder.open(tmp_path)


def _names(shards):
    return [s.path.name for s in shards]


def test_a_split_inside_a_word_does_not_name_the_split(tmp_path):
    folder = _folder(tmp_path, [
        "retrieval_train_000000.bin", "interval_train_000001.bin", "medieval_val_000000.bin",
        "eval_notes.bin",  # neither split's word: left out
    ])  # fmt: skip
    assert _names(folder.train) == ["interval_train_000001.bin", "retrieval_train_000000.bin"]
    assert _names(folder.val) == ["medieval_val_000000.bin"]


def test_the_namings_of_gpuflow_llmc_and_others_are_read(tmp_path):
    folder = _folder(tmp_path, [
        "train_000000.bin", "fineweb_train_000001.bin", "tiny_training.bin", "train0.bin",
        "val_000000.bin", "fineweb_val_000000.bin", "tiny-validation.bin", "VAL1.bin",
    ])  # fmt: skip
    assert _names(folder.train) == [
        "fineweb_train_000001.bin",
        "tiny_training.bin",
        "train0.bin",
        "train_000000.bin",
    ]
    assert _names(folder.val) == ["fineweb_val_000000.bin", "tiny-validation.bin", "val_000000.bin"]


def test_a_name_with_both_splits_is_refused(tmp_path):
    with pytest.raises(GpuflowError, match="names both a train and a val split"):
        _folder(tmp_path, ["train_000000.bin", "val_000000.bin", "train_val.bin"])
