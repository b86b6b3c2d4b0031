"""``gpuflow info``: accelerators, software versions, allocator, link speeds."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="accelerators, software versions, allocator, link speeds",
        description="Show what this machine gives gpuflow: each accelerator (cuda, xpu, mps, "
        "cpu) with its name and memory; the torch, CUDA and cuDNN versions; the allocator's "
        "settings; what data.io=auto takes here and why; and a measured probe of the link, "
        "host->device and device->host from pinned and pageable memory and device->device, "
        "in GB/s. With a CUDA device, which GPUs reach each other's memory, and how fast.",
    )
    p.add_argument("--json", action="store_true", help="print the same facts as JSON")
    p.add_argument("--device", default="auto", help="device to probe (default: auto)")
    p.set_defaults(func=run)


def _gather_info(device_spec: str) -> dict[str, Any]:
    import platform

    import torch

    from gpuflow.device.accelerator import Device, allocator_settings, available_devices
    from gpuflow.device.linkprobe import PROBE_BYTES, probe_link
    from gpuflow.device.peers import peer_report
    from gpuflow.transfer.diskread import choose_io

    device = Device.resolve(device_spec)
    link = probe_link(device)
    return {
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        },
        "devices": [d.describe() for d in available_devices()],
        "selected": str(device),
        "allocator": allocator_settings(),
        "data_io": dataclasses.asdict(choose_io("auto", device)),  # what data.io=auto takes
        "link_probe": {
            "device": str(device),
            "bytes": PROBE_BYTES if link else None,
            "gb_per_s": link,
            "note": None if link else "skipped: the cpu has no host-device link to measure",
        },
        "peers": peer_report(device),
    }


def _print_info(info: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    sw = info["software"]
    out_console.print(
        f"[bold]gpuflow info[/]  python {sw['python']}  torch {sw['torch']}  "
        f"cuda {sw['cuda'] or '-'}  cudnn {sw['cudnn'] or '-'}"
    )
    devices = table("device", "name", "memory", "details", title="devices")
    for d in info["devices"]:
        memory = d.get("total_memory_bytes")
        details = ", ".join(
            f"{k.replace('_', ' ')} {v}"
            for k, v in d.items()
            if k in ("compute_capability", "multiprocessors", "peak_bf16_tflops", "threads") and v
        )
        devices.add_row(
            d["device"], d["name"], f"{memory / 2**30:.1f} GiB" if memory else "-", details
        )
    out_console.print(devices)
    allocator = info["allocator"]
    out_console.print(
        "allocator: "
        + (", ".join(f"{k}={v}" for k, v in allocator.items()) if allocator else "torch defaults")
    )
    io = info["data_io"]
    out_console.print(f"data.io auto takes {io['path']}: {io['reason']}", markup=False)
    probe = info["link_probe"]
    if not probe["gb_per_s"]:
        out_console.print(f"link probe: {probe['note']}")
    else:
        rates = table(
            "copy",
            "GB/s",
            title=f"link probe on {probe['device']}, {probe['bytes'] >> 20} MiB per copy, "
            "median of 5",
        )
        for name, rate in probe["gb_per_s"].items():
            label = "d2d (read + write)" if name == "d2d" else name.replace("_", " ")
            rates.add_row(label, f"{rate:.1f}")
        out_console.print(rates)
    peers = info["peers"]
    if not peers["devices"]:
        out_console.print(f"peers: {peers['note']}")
        return
    names = peers["devices"]
    access = table("from \\ to", *names, title="peer access")
    mib = peers["bytes"] >> 20
    copies = table("from \\ to", *names, title=f"d2d GB/s, {mib} MiB, median of {peers['repeats']}")
    for name, can, rates in zip(names, peers["access"], peers["gb_per_s"], strict=True):
        access.add_row(name, *("yes" if c else "no" for c in can))
        copies.add_row(name, *(f"{r:.1f}" for r in rates))
    out_console.print(access)
    out_console.print(copies)
    out_console.print("d2d: within a GPU, bytes read + written; between GPUs, bytes moved once")


def run(args: argparse.Namespace) -> int:
    info = _gather_info(args.device)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0
