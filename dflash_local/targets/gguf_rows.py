"""A GGUF file's embedding and output-head rows for a torch drafter: dequantized on demand, the head built once."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import torch

from ..quant import Int8Matrix

HEAD_CHUNK = 512  # output-head rows dequantized at a time when the head is first built (gguf-py dequantizes via
# int and float intermediates several times the rows' fp32 size: 2048 rows of a 1B head peaked 0.3 GB above the rest)


class GGUFRows:
    """The embedding matrix and output head of a memory-mapped GGUF file (the tied head is the embedding matrix, so
    that is the only copy): `embed` reads just the rows asked for, `lm_head` materializes the head on first use."""

    def __init__(self, tensors: dict, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        self.embed_tensor = tensors["token_embd.weight"]
        self.head_tensor = tensors.get("output.weight", self.embed_tensor)
        self.hidden, self.vocab = hidden, vocab
        self.dtype, self.device = dtype, device
        self.head: torch.Tensor | Int8Matrix | None = None
        self.int8_head = False  # materialize the head as packed int8 rows (for a torch drafter on the CPU)

    def dequantize(self, tensor, rows) -> np.ndarray:
        """fp32 [n, hidden] of the given rows (an index array or a slice) of a GGUF tensor, read from the file."""
        values = gguf.quants.dequantize(tensor.read_rows(rows), tensor.tensor_type)
        return np.asarray(values, dtype=np.float32).reshape(-1, self.hidden)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding matrix: from the tied head once it exists in `dtype` (no host work: CUDA graphs can
        capture it), else dequantized from the file."""
        if isinstance(self.head, torch.Tensor) and self.head_tensor is self.embed_tensor:
            return torch.nn.functional.embedding(ids.to(self.device), self.head)
        rows = self.dequantize(self.embed_tensor, ids.reshape(-1).cpu().numpy())
        return torch.from_numpy(rows).to(self.device, self.dtype).reshape(*ids.shape, self.hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head applied to hidden rows, materialized from the file on first use: in `dtype`, or as packed
        int8 rows where int8_head is set (Int8Matrix: on the CPU faster than fp32, a quarter of the memory)."""
        if self.head is None:
            self.head = Int8Matrix(self._head_chunks()) if self.int8_head else self._float_head()
        if isinstance(self.head, Int8Matrix):
            return self.head.linear(hidden)
        return hidden.to(self.head.dtype) @ self.head.T

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the output head, dequantized from the file."""
        rows = self.dequantize(self.head_tensor, ids.reshape(-1).cpu().numpy())
        return torch.from_numpy(rows).to(self.device, self.dtype)

    def _head_chunks(self) -> Iterator[torch.Tensor]:
        for begin in range(0, self.vocab, HEAD_CHUNK):
            yield torch.from_numpy(self.dequantize(self.head_tensor, slice(begin, begin + HEAD_CHUNK)))

    def _float_head(self) -> torch.Tensor:
        head = torch.empty((self.vocab, self.hidden), dtype=self.dtype, device=self.device)
        begin = 0
        for chunk in self._head_chunks():
            head[begin : begin + len(chunk)] = chunk
            begin += len(chunk)
        return head
