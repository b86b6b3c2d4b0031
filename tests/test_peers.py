"""Peer copies and the peer table on the cpu: peer_copy's checks and accounting, the access
matrix's shape, and the peers section of ``gpuflow info``.

Meta tensors stand in for device tensors (as in tests/test_ledger.py): a copy between them
moves nothing but goes through peer_copy's checks and report. Copies between two real GPUs
are in tests/gpu/test_peers.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gpuflow
from gpuflow.accounting.ledger import TransferLedger
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.device.peers import (
    enable_peer_access,
    measure_d2d,
    peer_access_matrix,
    peer_bandwidth_table,
    peer_report,
)
from gpuflow.transfer.peer import peer_copy

from .conftest import gpuflow_cli, line_holding

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return line_holding(__file__, marker)


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("dst", "src", "message"),
    [
        (
            _meta(2, 3),
            _meta(3, 2),
            "peer_copy needs equal shapes, got dst (2, 3) and src (3, 2); "
            "it neither broadcasts nor reshapes",
        ),
        (
            _meta(4),
            _meta(4, dtype=torch.bfloat16),
            "peer_copy needs equal dtypes, got dst torch.float32 and src torch.bfloat16; "
            "convert on one device before or after the copy",
        ),
        (
            _meta(4),
            torch.zeros(4),
            "peer_copy copies between device tensors, but src is on the cpu; "
            "host copies go through DeviceLoader, unpack or HostMirror",
        ),
        (_meta(4), [0.0] * 4, "peer_copy takes tensors, got list for src"),
    ],
)
def test_peer_copy_refuses_with_one_line_before_any_device_work(dst, src, message):
    with TransferLedger("cpu") as ledger, pytest.raises(GpuflowError) as caught:
        peer_copy(dst, src)
    assert str(caught.value) == message
    assert "\n" not in message
    assert ledger.events == []  # refused before the copy: nothing counted


def test_peer_copy_counts_once_as_d2d_with_its_bytes_and_caller():
    dst, src = _meta(16, 8, dtype=torch.bfloat16), _meta(16, 8, dtype=torch.bfloat16)
    with TransferLedger("cpu") as ledger:
        out = peer_copy(dst, src)  # the-copy
    assert out is dst
    [event] = ledger.events
    assert (event.kind, event.op, event.nbytes, event.dtype) == (
        "d2d",
        "peer_copy",
        256,
        "bfloat16",
    )
    assert (event.pinned, event.blocking) == (None, False)
    assert event.location.endswith(f"{HERE}:{_line('# the-copy')}")
    totals = ledger.summary().totals
    assert (totals.d2d_bytes, totals.d2d_copies, totals.h2d_bytes, totals.syncs) == (256, 1, 0, 0)


def test_peer_copy_is_a_public_name():
    assert gpuflow.peer_copy is peer_copy
    assert "peer_copy" in gpuflow.__all__


def test_the_access_matrix_is_square_with_the_diagonal_true():
    assert peer_access_matrix([]) == []
    assert peer_access_matrix(["cpu"]) == [[True]]
    assert peer_access_matrix([Device("cpu"), "cpu"]) == [[True, True], [True, True]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without cuda")
def test_without_cuda_no_peer_access_is_reported():
    assert enable_peer_access(0, 1) is False


def test_measure_d2d_on_the_host_and_its_refusals():
    assert measure_d2d("cpu", "cpu", nbytes=1 << 16, repeats=2) > 0
    with pytest.raises(GpuflowError, match="devices of one type, got cpu and cuda:0"):
        measure_d2d(Device("cpu"), Device("cuda", 0))  # refused before touching cuda
    with pytest.raises(GpuflowError, match="nbytes >= 4"):
        measure_d2d("cpu", "cpu", nbytes=2)


def test_the_bandwidth_table_covers_every_ordered_pair():
    table = peer_bandwidth_table(["cpu"], nbytes=1 << 16, repeats=2)
    assert table["devices"] == ["cpu"] and table["access"] == [[True]]
    assert len(table["gb_per_s"]) == 1 and table["gb_per_s"][0][0] > 0
    assert (table["bytes"], table["repeats"]) == (1 << 16, 2)
    json.dumps(table)  # what `gpuflow info --json` prints


def test_the_info_section_is_empty_with_a_note_off_cuda():
    report = peer_report("cpu")
    assert (report["devices"], report["access"], report["gb_per_s"]) == ([], [], [])
    assert report["note"].startswith("no peer GPUs" if not torch.cuda.is_available() else "skip")


def test_info_json_has_a_peers_section(workdir):
    result = gpuflow_cli("info", "--json", cwd=workdir)
    assert result.returncode == 0, result.stderr
    peers = json.loads(result.stdout)["peers"]
    if not torch.cuda.is_available():
        assert peers["devices"] == [] and peers["gb_per_s"] == []
        assert peers["note"] == "no peer GPUs: this machine has no cuda device"
        return
    n = torch.cuda.device_count()
    assert peers["devices"] == [f"cuda:{i}" for i in range(n)] and peers["note"] is None
    assert [len(row) for row in peers["access"]] == [n] * n
    assert all(peers["access"][i][i] for i in range(n))
    assert all(rate > 0 for row in peers["gb_per_s"] for rate in row)


def test_info_prints_the_peers_section(workdir):
    result = gpuflow_cli("info", cwd=workdir)
    assert result.returncode == 0, result.stderr
    expected = "d2d GB/s" if torch.cuda.is_available() else "peers: no peer GPUs"
    assert expected in result.stdout
