"""Token embedding and the LM head (kept dense in every checkpoint, fp8 ones included).

Tensor parallelism splits the vocabulary over the "tp" ranks: rank r holds rows
[r * ceil(V / tp), (r + 1) * ceil(V / tp)) of the embedding and of the head (the last shard padded with
zero rows, so every rank's part has the same shape). The embedding looks up the ids it holds, zeroes the
rest and all-reduces (exactly one rank contributes each row, so the sum is exact); the head is
column-parallel over the vocabulary: each rank's logits are gathered in rank order and trimmed to
vocab_size. A tied head reuses the rank's embedding shard. One rank: the unsplit layers, no extra ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.backend import Backend, Communicator
from deepinfer.errors import ModelLoadError
from deepinfer.models.layers.linear import Linear, prepare_weight, tp_communicator
from deepinfer.models.weights import Loader, sliced, tensor_loader


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of the vocabulary: [start, stop) as stored, `rows` held (stop - start + padding)."""

    start: int
    stop: int
    rows: int

    @property
    def padding(self) -> int:
        return self.rows - (self.stop - self.start)


def vocab_shard(vocab_size: int, comm: Communicator) -> VocabShard:
    n, r = comm.world_size, comm.rank
    rows = -(-vocab_size // n)
    if rows * (n - 1) >= vocab_size:
        raise ModelLoadError(f"vocab_size {vocab_size} is too small to split over tensor_parallel_size {n} "
                             "(a rank would hold no rows)")
    start = r * rows
    return VocabShard(start, min(start + rows, vocab_size), rows)


def _pad_rows(t: torch.Tensor, padding: int) -> torch.Tensor:
    if not padding:
        return t
    return torch.cat([t, t.new_zeros((padding, *t.shape[1:]))], dim=0)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.backend = backend
        self.dtype = dtype
        self.comm = tp_communicator(backend)
        self.shard = vocab_shard(vocab_size, self.comm) if self.comm.world_size > 1 else None
        self.weight: torch.Tensor | None = None

    def loaders(self, prefix: str) -> dict[str, Loader]:
        name = f"{prefix}.weight"
        if self.shard is None:
            return {name: tensor_loader(self, "weight", name, (self.vocab_size, self.hidden_size), self.dtype,
                                        self.backend.device)}
        sh = self.shard
        check = tensor_loader(self, "weight", name, (sh.stop - sh.start, self.hidden_size), self.dtype,
                              self.backend.device)

        def load(t: torch.Tensor) -> None:
            check(t)
            self.weight = _pad_rows(self.weight, sh.padding)

        return {name: sliced(load, 0, sh.start, sh.stop)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.stop - self.shard.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class LMHead(Linear):
    """hidden [N, D] -> fp32 logits [N, V]; the matmul runs in compute dtype like the reference (never
    quantized online: checkpoints keep the head dense)."""

    quantize_online = False

    def __init__(self, vocab_size: int, hidden_size: int, backend: Backend, dtype: torch.dtype):
        comm = tp_communicator(backend)
        shard = vocab_shard(vocab_size, comm) if comm.world_size > 1 else None
        super().__init__(hidden_size, vocab_size if shard is None else shard.rows, backend, dtype)
        self.comm = comm
        self.vocab_size = vocab_size
        self.shard = shard

    def loaders(self, prefix: str) -> dict[str, Loader]:
        if self.shard is None:
            return super().loaders(prefix)
        self.name = prefix
        return {f"{prefix}.weight": sliced(self._set_shard, 0, self.shard.start, self.shard.stop)}

    def _set_shard(self, t: torch.Tensor) -> None:
        sh = self.shard
        w = prepare_weight(self.name, t, (sh.stop - sh.start, self.in_features), False, self.dtype,
                           self.backend.device)
        self.weight = _pad_rows(w, sh.padding)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """tie_word_embeddings: the head reuses the embedding matrix (this rank's shard of it)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # column-parallel over the vocabulary: each rank's slice of the logits, gathered in rank order
        logits = self.comm.all_gather(super().forward(hidden), dim=-1)
        if logits.shape[-1] > self.vocab_size:  # the last rank's padding rows
            logits = logits[..., : self.vocab_size]
        return logits.float()
