"""CUDA graphs for fixed-shape steps: capture once per shape, then replay with new inputs copied into place.

On by default for CUDA models (the runtime config's cuda_graphs; `--no-cuda-graphs` turns them off). Never used on
CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch

Outputs = tuple[torch.Tensor | None, ...]


def cache_span(end: int, capacity: int, smallest: int = 256) -> int:
    """How much of a cache a fixed-shape step attends to: the next power of two >= end, within the capacity.

    One graph per span keeps attention cost within twice the used length, with few captures.
    """
    span = smallest
    while span < end:
        span *= 2
    return min(span, capacity)


class CapturedStep:
    """fn captured on static copies of its inputs; calling it copies new inputs in, replays, returns fn's outputs."""

    def __init__(self, fn: Callable[..., Outputs], inputs: tuple[torch.Tensor, ...]) -> None:
        self.inputs = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*self.inputs)  # warm-up outside the capture: Triton compiles, cuBLAS picks kernels
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> Outputs:
        for static, new in zip(self.inputs, inputs, strict=True):
            static.copy_(new)
        self.graph.replay()
        return self.outputs


class StepGraphs:
    """Captured steps by key, captured on first use; a capture that CUDA refuses turns graphs off (eager from then)."""

    def __init__(self) -> None:
        self.steps: dict[Hashable, CapturedStep] = {}
        self.enabled = True

    def run(self, key: Hashable, fn: Callable[..., Outputs], *inputs: torch.Tensor) -> Outputs:
        """fn(*inputs), replayed from a graph when possible; outputs are cloned, the graph reuses its buffers."""
        step = self.steps.get(key)
        if step is None and self.enabled:
            try:
                step = self.steps[key] = CapturedStep(fn, inputs)
            except RuntimeError as exc:
                torch.cuda.synchronize()
                self.enabled = False
                warnings.warn(f"CUDA graph capture failed, running eagerly ({exc}).", RuntimeWarning, stacklevel=2)
        if step is None:
            return fn(*inputs)
        return tuple(None if out is None else out.clone() for out in step(*inputs))
