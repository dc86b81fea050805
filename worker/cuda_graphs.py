"""Decode steps replayed from CUDA graphs captured at bucketed batch sizes (as vLLM does).

A decode step (every sequence adds one token) of n sequences is padded up to the next
capture size (1, 2, 4, then multiples of 8 up to the largest) and replays the graph
captured at that size. The graph was recorded reading persistent input buffers (token ids,
positions, slot mapping, sequence lengths, block tables, query start offsets): a replay
copies the step's inputs into them, and the first n rows of the graph's output are the
step's hidden states. Padded rows are harmless: slot -1 (the cache write skips it), sequence
length 1 over the null block (block 0, zeros), and their outputs are sliced away.
Prefill, mixed and speculative steps, and batches above the largest size, run without graphs.

Only attention backends whose kernels read every length from device tensors can be
replayed (a graph freezes the host-side values): the triton backend. What a graph records
is the forward the worker would run anyway (compiled or eager `ModelForward`). How a graph
is captured is injectable (`CudaGraphCapture` on a GPU; tests replay the recorded step
eagerly), and a capture that fails leaves the worker without graphs, with a warning.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from worker.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

GRAPH_SAFE_BACKENDS = frozenset({"triton"})  # kernels read lengths and tables on the device
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_size: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8 up to `max_size` (none for 0)."""
    if max_size < 0:
        raise ValueError(f"the largest CUDA graph batch size must be >= 0, got {max_size}")
    return [size for size in (1, 2, 4) if size <= max_size] + list(range(8, max_size + 1, 8))


def graph_size_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest capture size holding `num_seqs` sequences; None above the largest."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


class GraphCapture(Protocol):
    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record `step`; return (replay, output): replay reruns it, refreshing `output` in place."""
        ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph capture; every graph shares one memory pool (captured largest
    first, the smaller ones fit in its blocks). Each step runs once on the capture stream
    before it is recorded: kernels compile and libraries set up their per-stream state
    (cuBLAS workspaces) outside the capture, as torch's documentation asks."""

    def __init__(self) -> None:
        self._pool = None
        self._stream = torch.cuda.Stream()

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            step()
        torch.cuda.current_stream().wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            output = step()
        self._pool = graph.pool()
        return graph.replay, output  # (the bound method keeps the graph alive, and only it)


class DecodeGraphBuffers:
    """The persistent inputs every decode graph reads; graph size s uses the first s rows."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device):
        def int_buffer(*shape: int, dtype: torch.dtype = torch.int32, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)
        self.input_ids = int_buffer(max_size, dtype=torch.int64)
        self.positions = int_buffer(max_size, dtype=torch.int64)
        self.slot_mapping = int_buffer(max_size, dtype=torch.int64, fill=-1)
        self.seq_lens = int_buffer(max_size, fill=1)
        self.block_tables = int_buffer(max_size, max_blocks_per_seq)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def meta(self, size: int) -> AttentionMetadata:
        """Metadata over the first `size` rows: a graph's kernels read these tensors at replay.
        Host-side fields hold the all-padding values of capture time and are never updated."""
        return AttentionMetadata(
            num_decodes=size, slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_query_len=1, max_seq_len=1,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[1] * size)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy a decode step of n <= size sequences into the first n rows; rows n..size-1
        become padding (token 0 at position 0, slot -1, length 1, block table of the null block)."""
        n, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:n, width:].zero_()  # columns a wider earlier step left behind
        self.pad(n, size)

    def pad(self, start: int, size: int) -> None:
        """Rows start..size-1 become padding rows."""
        n = start
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()


class DecodeGraphRunner:
    """Captures `forward` on the buffers at every size, then serves decode steps by replay."""

    def __init__(self, forward: Forward, sizes: list[int], max_blocks_per_seq: int, device: torch.device,
                 capture: GraphCapture):
        self.forward = forward
        self.sizes = list(sizes)
        self.buffers = DecodeGraphBuffers(max(self.sizes, default=0), max_blocks_per_seq, device)
        self._capture = capture
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0  # steps served from a graph (tests, logs)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def capture_all(self) -> bool:
        """Capture every size, largest first; on any failure keep none (a warning) and return False."""
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                for size in sorted(self.sizes, reverse=True):
                    self._graphs[size] = self._capture.capture(self._step(size))
        except Exception as exc:  # a capture that fails must not take the worker down: run without
            self._graphs.clear()
            logger.warning("capturing CUDA graphs failed (%s: %s); decode steps run without graphs",
                           type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
            return False
        self.capture_seconds = time.perf_counter() - started
        return True

    def _step(self, size: int) -> Callable[[], torch.Tensor]:
        buffers, meta = self.buffers, self.buffers.meta(size)
        buffers.pad(0, size)
        return lambda: self.forward(buffers.input_ids[:size], buffers.positions[:size], meta)

    def handles(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step (one token per sequence) small and narrow enough for a graph."""
        n = meta.num_decodes
        return (bool(self._graphs) and n == input_ids.shape[0] == len(meta.seq_lens_cpu) and 0 < n <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.buffers.max_blocks_per_seq)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a step `handles` accepted; a view of the graph's output,
        valid until the next replay."""
        n = input_ids.shape[0]
        size = graph_size_for(n, self.sizes)
        self.buffers.fill(input_ids, positions, meta, size)
        replay, output = self._graphs[size]
        replay()
        self.replays += 1
        return output[:n]


class GraphedForward:
    """The runner's forward on CUDA: decode steps a graph handles replay it, others run `forward`."""

    def __init__(self, forward: Forward, graphs: DecodeGraphRunner):
        self.forward = forward
        self.graphs = graphs

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.graphs.handles(input_ids, meta):
            return self.graphs.run(input_ids, positions, meta)
        return self.forward(input_ids, positions, meta)


def with_decode_graphs(forward: Forward, config: Any, *, backend_name: str, max_model_len: int,
                       device: torch.device, world_size: int = 1, capture: GraphCapture | None = None) -> Forward:
    """`forward` with decode graphs captured (a `GraphedForward`) on a CUDA worker, or `forward`
    itself where they do not apply: CPU (unless a `capture` is given: tests), --enforce-eager, LoRA or
    --max-cudagraph-batch-size 0, an attention backend that is not graph-safe, a worker group."""
    max_size = config.resolved_max_cudagraph_batch_size()
    if max_size == 0 or (device.type != "cuda" and capture is None):
        return forward
    if backend_name not in GRAPH_SAFE_BACKENDS:
        logger.info("No CUDA graphs: the %s attention backend reads host-side lengths; decode steps run "
                    "without graphs (use --attention-backend triton)", backend_name)
        return forward
    if world_size > 1:
        logger.info("No CUDA graphs in a worker group of %d ranks (not supported yet)", world_size)
        return forward
    sizes = capture_sizes(max_size)
    runner = DecodeGraphRunner(forward, sizes, -(-max_model_len // config.block_size) + 1, device,
                               capture or CudaGraphCapture())
    free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    if not runner.capture_all():
        return forward
    used = free_before - torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    logger.info("Captured %d CUDA graphs for decode batches of 1..%d sequences in %.1f s (%.0f MiB)",
                runner.num_graphs, sizes[-1], runner.capture_seconds, used / 2**20)
    return GraphedForward(forward, runner)
