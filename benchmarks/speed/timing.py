"""GPU timing helpers shared by the benchmarks (run as scripts: `import timing` finds this file).

    graph_time_us(fn, copies)   median µs of one fn() call: `copies` calls captured in one CUDA
                                graph and replayed, so launch gaps are not timed (what the
                                runtime's decode graphs see)
    event_ms(fn, reps)          median ms of one eager fn() call (CUDA events, after a warm-up)
    sync_time(fn, reps)         wall seconds of one fn() call, synchronized before and after
                                (whole requests: host work included)

Without a GPU (a --smoke run on the CPU: benchmarks/speed/tiny.py) each helper times fn() with
perf_counter instead, so the same code runs; those numbers mean nothing.
"""

from __future__ import annotations

import statistics
import time

import torch


def graph_time_us(fn, copies: int = 20, replays: int = 10) -> float:
    """Median time of one fn() call in µs over `replays` replays of a graph of `copies` calls."""
    if not torch.cuda.is_available():
        return _wall_ms(fn, 3) * 1e3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(copies):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    del graph
    return statistics.median(times)


def event_ms(fn, reps: int = 5) -> float:
    """Median ms of one fn() call (CUDA events, after a warm-up call)."""
    if not torch.cuda.is_available():
        return _wall_ms(fn, min(reps, 2))
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sync_time(fn, reps: int = 1) -> float:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def _wall_ms(fn, reps: int) -> float:
    """The CPU stand-in: median perf_counter ms of one fn() call after a warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
