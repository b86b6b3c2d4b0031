"""Probe: the image loop at 3.1 MB batches (a ``DataLoader`` with 6 workers, the small CNN),
each feed against the idiom (``DataLoader(pin_memory=True)`` + ``.to()``) in six pairs of
rounds whose order alternates; the median of the pairs' ratios.

Feeds: ``ours`` (DeviceLoader with ``narrow=True``, its default when this ran: the int64
labels cross as uint16), ``narrow_off`` (``narrow=False``: they cross as they are),
``lean_thread`` (the floor of a reader thread: a thread of the probe's taking each batch
from the workers, ``pin_memory().to()`` on a stream of its own, the training thread
waiting on an event), ``pinned_source`` and ``pinned_source_narrow_off`` (DeviceLoader
over ``DataLoader(pin_memory=True)``, with and without ``narrow``). Cited by
docs/decisions/038.

PYTHONPATH=src python3 benchmarks/probes/readerfeeds.py OUT.txt [FEED ...]
"""

import queue
import statistics
import sys
import threading

import torch

from gpuflow.bench.loaders import SyntheticImages, small_cnn, train_images
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

dev = Device.resolve("cuda")
model = small_cnn().cuda().to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
B, steps = 256, 300
data = SyntheticImages(B * steps, 64)


def source(pin):
    return torch.utils.data.DataLoader(
        data, batch_size=B, num_workers=6, pin_memory=pin, prefetch_factor=4
    )


def lean(loader, ahead=2):
    q = queue.Queue(ahead)
    stream = torch.cuda.Stream()

    def run():
        torch.cuda.set_device(0)
        with torch.cuda.stream(stream):
            for b in loader:
                o = {k: v.pin_memory().to("cuda", non_blocking=True) for k, v in b.items()}
                ev = torch.cuda.Event()
                ev.record(stream)
                q.put((o, ev))
        q.put(None)

    threading.Thread(target=run, daemon=True).start()
    while True:
        item = q.get()
        if item is None:
            return
        o, ev = item
        cur = torch.cuda.current_stream()
        cur.wait_event(ev)
        for v in o.values():
            v.record_stream(cur)
        yield o


def idiom():
    feed = ({k: v.to("cuda", non_blocking=True) for k, v in b.items()} for b in source(True))
    return train_images(dev, feed, model, opt, 30)


def ours(**kw):
    with DeviceLoader(source(False), dev, **kw) as L:
        return train_images(dev, L, model, opt, 30)


def ours_pinned(**kw):
    with DeviceLoader(source(True), dev, **kw) as L:
        return train_images(dev, L, model, opt, 30)


variants = {
    "ours": lambda: ours(narrow=True),
    "narrow_off": lambda: ours(narrow=False),
    "lean_thread": lambda: train_images(dev, lean(source(False)), model, opt, 30),
    "pinned_source": lambda: ours_pinned(narrow=True),
    "pinned_source_narrow_off": lambda: ours_pinned(narrow=False),
}
chosen = sys.argv[2:] or list(variants)
idiom()
lines = []
for name in chosen:
    fn = variants[name]
    ratios = []
    for pair in range(6):
        order = [("idiom", idiom), (name, fn)]
        rates = {}
        for label, f in order if pair % 2 == 0 else order[::-1]:
            s, n = f()
            rates[label] = n / s
        ratios.append(rates[name] / rates["idiom"])
    lines.append(
        f"{name}: median pair ratio {statistics.median(ratios):.3f} "
        f"pairs {[round(r, 3) for r in ratios]}"
    )
    print(lines[-1], flush=True)
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
