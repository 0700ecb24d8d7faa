"""Token embedding and the LM head (kept dense in every checkpoint, fp8 ones included)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.backend import Backend
from deepinfer.models.layers.linear import Linear
from deepinfer.models.weights import Loader, tensor_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.backend = backend
        self.dtype = dtype
        self.weight: torch.Tensor | None = None

    def loaders(self, prefix: str) -> dict[str, Loader]:
        name = f"{prefix}.weight"
        return {name: tensor_loader(self, "weight", name, (self.vocab_size, self.hidden_size), self.dtype,
                                    self.backend.device)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(Linear):
    """hidden [N, D] -> fp32 logits [N, V]; the matmul runs in compute dtype like the reference."""

    def __init__(self, vocab_size: int, hidden_size: int, backend: Backend, dtype: torch.dtype):
        super().__init__(hidden_size, vocab_size, backend, dtype)
        self.comm = backend.communicator()

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """tie_word_embeddings: the head reuses the embedding matrix."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # column-parallel over the vocabulary: each rank's slice of the logits, gathered in rank order
        return self.comm.all_gather(super().forward(hidden), dim=-1).float()
