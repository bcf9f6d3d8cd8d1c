"""CUDA-graph decode: one captured forward per batch size, replayed with padded batches.

At engine start `CudaGraphRunner` captures the model's decode forward at each batch size of
`EngineConfig.cuda_graph_batch_sizes` (1, 2, 4, 8, 16, 24, ... 256), largest first, all graphs
sharing one memory pool (the approach of vLLM's and SGLang's CUDA-graph runners). Inputs live in
static buffers: `input_ids` and `positions` here, the attention inputs (page table, seq_lens,
out_cache_loc, FlashInfer's page lists) in the backend's graph buffers
(`init_cuda_graph` / `prepare_capture` / `prepare_replay`, see ARCHITECTURE.md). A decode batch
of n sequences replays the smallest graph of bs >= n sequences: rows n..bs-1 are padding (their
ids and positions are stale but valid, the backend points them at page 0 and slot 0) and their
logits are ignored. Prefill and larger batches run eagerly.
"""

from __future__ import annotations

import bisect
import logging

import torch

from tritonllm.attention.base import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    """Captures and replays decode forwards of `model` (see module docstring).

    Args:
        model: the `CausalLM` (its forward must not read device values on the host).
        backend: an attention backend whose `supports_cuda_graph` is True.
        batch_sizes: ascending batch sizes to capture.
        max_pages_per_seq: page-table width of the graphs (pages of one max-length sequence).
        vocab_size: logits width.
        device: a CUDA device.
        capture_error_mode: `torch.cuda.graph`'s: "global" (the default), or "thread_local" for
            a tensor-parallel rank, whose NCCL watchdog thread may query events of earlier
            collectives while this thread captures (legal from another thread, but "global"
            would fail the capture for it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        batch_sizes: list[int],
        max_pages_per_seq: int,
        vocab_size: int,
        device: torch.device,
        capture_error_mode: str = "global",
    ) -> None:
        self.model, self.backend = model, backend
        self.capture_error_mode = capture_error_mode
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        self.max_pages_per_seq = max_pages_per_seq
        self.device = device
        max_bs = self.max_bs
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        backend.init_cuda_graph(max_bs, max_pages_per_seq)
        self._capture_all()

    def _dummy_meta(self, bs: int) -> AttentionMetadata:
        """Metadata of a padding-only decode batch (the model passes it through unused)."""
        ones = torch.ones(bs, dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            num_seqs=bs,
            is_decode=True,
            seq_lens=ones,
            extend_lens=ones,
            prefix_lens=ones - 1,
            cu_extend_lens=torch.arange(bs + 1, dtype=torch.int32, device=self.device),
            page_table=torch.zeros(bs, 1, dtype=torch.int32, device=self.device),
            out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=self.device),
            seq_lens_cpu=[1] * bs,
            extend_lens_cpu=[1] * bs,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.batch_sizes):
            meta = self._dummy_meta(bs)
            args = (self.input_ids[:bs], self.positions[:bs], meta, self.logits_indices[:bs])
            self.backend.prepare_capture(bs)
            # Warm up outside the capture (Triton/FlashInfer compile and autotune here).
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model(*args)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode=self.capture_error_mode
            ):
                out = self.model(*args)
            self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (bs %s)", len(self.graphs), self.batch_sizes)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether `meta` (a batch about to run) can replay a graph."""
        return (
            meta.is_decode
            and meta.num_seqs <= self.max_bs
            and meta.page_table.shape[1] <= self.max_pages_per_seq
        )

    def prepare(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> int:
        """Copy a decode batch of n = `meta.num_seqs` sequences into the static buffers
        (device copies only); returns the graph batch size bs >= n to replay."""
        n = meta.num_seqs
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.backend.prepare_replay(meta, bs)
        return bs

    def replay(self, bs: int, num_seqs: int) -> torch.Tensor:
        """Replay graph `bs`; returns its logits `[num_seqs, vocab]` in the model's dtype (a view
        of the graph's output buffer, overwritten by the next replay of the same graph)."""
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs][:num_seqs]
