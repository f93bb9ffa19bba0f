# SPDX-License-Identifier: Apache-2.0
"""CUDA-graph capture for the GPU tests: warm up on a side stream (config caches, workspace
and allocator pools, cuBLAS handles stay out of the capture), then capture one call."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(
    fn: Callable[[], torch.Tensor], warmups: int = 2
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Returns (graph, static output of fn): replaying the graph rewrites that output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
