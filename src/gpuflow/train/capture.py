"""The whole training step as one CUDA graph: sample, forward, backward, clip, update, sum.

``CapturedStep`` runs the sequence: the first ``warmup`` calls eagerly on a side stream, then
one capture (which runs nothing), then ``after_capture`` (MasterAdamW points its table at the
graph's gradients), then a replay per call; ``release`` drops the graph, before a
data-parallel job leaves its process group. The graph API is a ``Graphs`` object, so that the
sequence runs on the CPU with a stand-in.

Why a graph, and what makes the step capturable: docs/architecture/training.md (The captured
step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

WARMUP_STEPS = 3


class Graph(Protocol):
    def replay(self) -> None: ...

    def reset(self) -> None:
        """Free the graph; replays in flight finish first (CUDA frees it when they do)."""


class Graphs(Protocol):
    """What capturing needs from the device."""

    def run_on_side_stream(self, body: Callable[[], None]) -> None: ...

    def capture(self, body: Callable[[], None]) -> Graph: ...


class CudaGraphs:
    """``torch.cuda``'s graphs: warm-up on a side stream, as capture requires."""

    def run_on_side_stream(self, body: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, body: Callable[[], None]) -> Graph:
        """Record ``body`` without running it: the device state does not move."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph


class CapturedStep:
    """``body`` (one training step, device work only): eager ``warmup`` times, then captured
    once and replayed on every later call."""

    def __init__(
        self,
        body: Callable[[], None],
        warmup: int = WARMUP_STEPS,
        after_capture: Callable[[], None] = lambda: None,
        graphs: Graphs | None = None,
    ) -> None:
        self.body = body
        self.warmup = warmup
        self.after_capture = after_capture
        self.graphs = graphs if graphs is not None else CudaGraphs()
        self.graph: Graph | None = None
        self.calls = 0

    def __call__(self) -> None:
        if self.calls < self.warmup:
            self.graphs.run_on_side_stream(self.body)
        else:
            if self.graph is None:
                self.graph = self.graphs.capture(self.body)
                self.after_capture()
            self.graph.replay()
        self.calls += 1

    def release(self) -> None:
        """Drop the captured graph, if any (a later call captures anew). Never waits for the
        device: a replay still running, or stuck in a collective whose peer is gone, keeps
        the graph alive until it ends."""
        graph, self.graph = self.graph, None
        if graph is not None:
            graph.reset()
