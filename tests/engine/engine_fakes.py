"""A tiny arithmetic CausalLM for testing scheduling and KV bookkeeping (not model math).

It stores each token id in its KV groups and predicts the next token from what it
reads back through the block tables, so any wrong slot, stale block, block shared
between sequences, window block freed too early, or state row not kept / not reset
changes the tokens. `reference_next` computes the same function from the token list.

Groups (each optional):
  full  tokens_per_entry=1: the token id;
  swa   sliding_window=W: the token id (read only inside the window);
  cmp   tokens_per_entry=M, state_shape=(1,): entry = sum of its M tokens; state = tokens seen.
"""

from __future__ import annotations

import torch

from deepinfer.backend import BackendCaps, KVCacheSpec, KVLayout
from deepinfer.models.base import CausalLM

VOCAB = 300


def reference_next(tokens: list[int], window: int | None, m: int | None) -> int:
    """The token the fake model predicts after `tokens` (whole context, current token last)."""
    n = len(tokens)
    a = sum(tokens)
    b = sum(tokens[max(0, n - window):]) if window else 0
    c = sum(tokens[: (n // m) * m]) if m else 0
    d = n if m else 0
    return (a + 3 * b + 5 * c + 7 * d + 11 * n) % VOCAB


class FakeBackend:
    """Just enough of a backend for from_components: caps and a device."""

    name = "fake-cpu"

    def __init__(self, block_size: int = 4):
        self.caps = BackendCaps(device_type="cpu", dtypes=(torch.float32,), kv_block_sizes=(block_size,))
        self.device = torch.device("cpu")

    def kv_cache_layout(self, spec: KVCacheSpec) -> KVLayout:
        return KVLayout.single(spec)


class FakeCausalLM(CausalLM):
    model_type = "fake"
    quantization = None

    def __init__(self, window: int | None = None, m: int | None = None, full: bool = True, max_pos: int = 512):
        super().__init__(config={}, backend=None, dtype=torch.float32)
        self.window, self.m, self.full = window, m, full
        self.vocab_size = VOCAB
        self.max_position_embeddings = max_pos
        self.calls: list[list[int]] = []  # query lens of every forward, for budget checks

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        specs = []
        if self.full or self.m:  # the compressed group reads token ids back from the full group
            specs.append(KVCacheSpec("full", (0,), (1,), torch.float32))
        if self.window:
            specs.append(KVCacheSpec("swa", (1,), (1,), torch.float32, sliding_window=self.window))
        if self.m:
            specs.append(KVCacheSpec("cmp", (2,), (1,), torch.float32, tokens_per_entry=self.m, state_shape=(1,)))
        return specs

    def load_weights(self, weights) -> None:
        return None

    def finalize(self) -> None:
        return None

    @staticmethod
    def _read(cache: torch.Tensor, table: torch.Tensor, entry: int, bs: int) -> float:
        block = int(table[entry // bs])
        assert block >= 0, f"entry {entry} read from a freed block"
        return float(cache[block, entry % bs, 0])

    def forward(self, batch, caches) -> torch.Tensor:
        bs = batch.block_size
        self.calls.append(list(batch.query_lens_cpu))
        for name in ("full", "swa"):
            if name in batch.slot_mapping:
                layer = 0 if name == "full" else 1
                flat = caches.get(name, layer).view(-1, 1)
                sm = batch.slot_mapping[name]
                assert bool((sm >= 0).all()), f"{name}: every token needs a slot"
                flat[sm] = batch.input_ids.to(torch.float32).unsqueeze(1)
        out = torch.zeros(batch.num_tokens, 1)
        qsl = batch.query_start_loc.tolist()
        for i in range(batch.num_seqs):
            ctx = batch.context_lens_cpu[i]
            if self.m:
                state = caches.get_state("cmp", 2)
                slot = batch.state_slots_cpu[i]
                assert float(state[slot, 0]) == ctx, f"state row holds {float(state[slot, 0])}, context is {ctx}"
            for row in range(qsl[i], qsl[i + 1]):
                p = int(batch.positions[row])
                n = p + 1
                a = b = c = d = 0.0
                if "full" in batch.block_tables:
                    t = batch.block_tables["full"][i]
                    a = sum(self._read(caches.get("full", 0), t, e, bs) for e in range(n))
                if self.window:
                    t = batch.block_tables["swa"][i]
                    b = sum(self._read(caches.get("swa", 1), t, e, bs) for e in range(max(0, n - self.window), n))
                if self.m:
                    t = batch.block_tables["cmp"][i]
                    cm = caches.get("cmp", 2)
                    if n % self.m == 0:  # this token completes entry n/m - 1: write it
                        e = n // self.m - 1
                        slot = int(batch.slot_mapping["cmp"][row])
                        assert slot == int(t[e // bs]) * bs + e % bs
                        ft = batch.block_tables["full"][i]
                        cm.view(-1, 1)[slot] = sum(
                            self._read(caches.get("full", 0), ft, k, bs) for k in range(e * self.m, n)
                        )
                    else:
                        assert int(batch.slot_mapping["cmp"][row]) == -1
                    c = sum(self._read(cm, t, e, bs) for e in range(n // self.m))
                    d = n
                    caches.get_state("cmp", 2)[batch.state_slots_cpu[i], 0] = n
                out[row, 0] = (a + 3 * b + 5 * c + 7 * d + 11 * n) % VOCAB
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], VOCAB)
        logits.scatter_(1, hidden.long(), 10.0)
        return logits
