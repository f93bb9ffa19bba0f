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


def assert_pdl_matches_plain(monkeypatch, chain: Callable[[torch.Tensor], torch.Tensor],
                             xs: list[torch.Tensor], warmups: int = 2) -> None:  # fmt: skip
    """chain(x) (ops each reading the previous one's output) with KBIT_PDL=1 (programmatic
    dependent launch) is bit-identical to KBIT_PDL=0: eagerly for xs[0], and replayed from a graph
    captured with PDL for every x in xs[1:]."""
    monkeypatch.setenv("KBIT_PDL", "0")
    want = chain(xs[0])
    assert bool(torch.isfinite(want).all()) and want.abs().max() > 1e-2
    monkeypatch.setenv("KBIT_PDL", "1")
    assert torch.equal(chain(xs[0]), want)
    static_x = xs[0].clone()
    graph, static_y = capture(lambda: chain(static_x), warmups)
    for x in xs[1:]:
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("KBIT_PDL", "0")
        assert torch.equal(static_y, chain(x))
        monkeypatch.setenv("KBIT_PDL", "1")
