"""The peer table on the cpu: the access matrix's shape, device-to-device bandwidth and its
refusals, and the peers section of ``gpuflow info`` (peer_copy: tests/transfer/test_peer.py;
on real GPUs: tests/device/test_peers_gpu.py)."""

from __future__ import annotations

import json

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.device.peers import (
    enable_peer_access,
    measure_d2d,
    peer_access_matrix,
    peer_bandwidth_table,
    peer_report,
)
from tests.helpers import gpuflow_cli


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
