"""Capturing a step in a CUDA graph as the GPU tests do."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(step: Callable):
    """(graph, what the captured call returned): the step runs once on a side stream first, so its kernels compile
    outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured
