"""What the engine needs from a model class; every DeepSeek family implements it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Iterable

import torch
from torch import nn

if TYPE_CHECKING:
    from deepinfer.backend import Backend, ForwardBatch, KVCaches, KVCacheSpec


class CausalLM(nn.Module, ABC):
    """A decoder-only model over the paged KV cache.

    Built on the meta device or the backend's device from the parsed config,
    filled by `load_weights`, then `finalize` hands converted weights to the
    backend ops.
    """

    # the class splits its weights over the backend's "tp" communicator (load_model refuses
    # tensor_parallel_size > 1 for a class that does not)
    supports_tensor_parallel: ClassVar[bool] = False
    # load_weights takes `StoredTensor` handles (models/loader.py) and reads them through `deliver`, so a
    # rank reads only its part; a class without it gets every tensor read whole
    reads_stored_tensors: ClassVar[bool] = False

    def __init__(self, config, backend: "Backend", dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.backend = backend
        self.dtype = dtype

    @abstractmethod
    def kv_cache_specs(self) -> list["KVCacheSpec"]:
        """The KV groups this model needs (V3: one; V4: several)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (Hugging Face name, tensor) pairs; MTP weights are kept aside, not an error."""

    @abstractmethod
    def finalize(self) -> None:
        """After loading: let the backend convert weights (fp8 dequant, absorb, stacking)."""

    @abstractmethod
    def forward(self, batch: "ForwardBatch", caches: "KVCaches") -> torch.Tensor:
        """Hidden states [T, hidden_size] for every scheduled token."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab_size]."""
