"""Shared helpers for the V4 tests: tiny checkpoints, the HF reference, and a small paged runner.

The runner is test-only: it gives each request block tables in every KV group
(sliding-window blocks that fall out of the window are freed and marked -1,
compressed groups grow one entry per m tokens) and a per-sequence state row,
and builds ForwardBatch exactly as the contract describes, so the model is
checked on the hybrid cache independently of the engine's KV manager.
"""

from __future__ import annotations

import json
import os

import torch

from deepinfer.backend.forward_batch import ForwardBatch, token_slots
from deepinfer.backend.kv_caches import KVCaches
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.checkpoints.presets_v4 import tiny_v4_config, v4_tensor_plan
from deepinfer.checkpoints.random_weights import write_safetensors
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.models.loader import iter_checkpoint


def write_tiny(out_dir: str, seed: int = 0, **overrides) -> dict:
    cfg = {**tiny_v4_config(), **overrides, "torch_dtype": "float32"}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_safetensors(out_dir, v4_tensor_plan(cfg, False), seed, torch.float32)
    return cfg


FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def write_fp8_pair(fp8_dir: str, ref_dir: str) -> dict:
    """tiny-v4 with fp8 e4m3 128x128 block linears at fp8_dir (as V4 releases ship them) and the same weights
    dequantized to fp32 at ref_dir; returns the fp8 checkpoint's tensors."""
    from safetensors.torch import load_file, save_file

    cfg = {**tiny_v4_config(), "torch_dtype": "float32"}
    os.makedirs(fp8_dir, exist_ok=True)
    os.makedirs(ref_dir, exist_ok=True)
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": FP8_QUANT}, f)
    with open(os.path.join(ref_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_safetensors(fp8_dir, v4_tensor_plan(cfg, True), 0, torch.float32)
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    dense = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name[: -len("weight")] + "weight_scale_inv"]
            t = t.float() * s.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
        dense[name] = t.contiguous()
    save_file(dense, os.path.join(ref_dir, "model.safetensors"))
    return tensors


def engine(path: str, **kw):
    """A DeepInferenceEngine on a tiny-v4 checkpoint (CPU, fp32, 128 tokens)."""
    from deepinfer import DeepInferenceEngine, EngineConfig

    return DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=path, device="cpu", dtype="float32",
                                                        max_model_len=128, load_progress=False, **kw))


def off_prompts() -> list[list[int]]:
    """The speculation tests' prompts: 1..30 tokens after BOS, so chunks land at every phase of W = 8, m = 4, 16."""
    g = torch.Generator().manual_seed(3)
    return [[0] + torch.randint(2, 1024, (n,), generator=g).tolist() for n in (1, 4, 9, 17, 30)]


def load_hf(path: str):
    from transformers import DeepseekV4ForCausalLM as HF

    return HF.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def load_ours(path: str, dtype: torch.dtype = torch.float32, load_mtp: bool = False) -> DeepseekV4ForCausalLM:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    model = DeepseekV4ForCausalLM(cfg, CPUBackend(), dtype, load_mtp=load_mtp)
    model.load_weights(iter_checkpoint(path, progress=False))
    model.finalize()
    return model.eval()


class PagedRunner:
    """Runs steps of (request id, new token ids) chunks over a paged hybrid cache."""

    def __init__(self, model: DeepseekV4ForCausalLM, block_size: int = 4, num_blocks: int = 512, max_seqs: int = 8,
                 specs=None):
        """specs: the KV groups (default: the model's main layers'; the MTP tests pass include_mtp=True's)."""
        self.model = model
        self.specs = {s.name: s for s in (specs if specs is not None else model.kv_cache_specs())}
        self.bs = block_size
        self.caches = KVCaches.allocate(list(self.specs.values()), {n: num_blocks for n in self.specs}, block_size,
                                        max_seqs, torch.device("cpu"))
        self.free = {n: list(range(num_blocks - 1, -1, -1)) for n in self.specs}
        self.tables: dict[int, dict[str, list[int]]] = {}
        self.lens: dict[int, int] = {}
        self.slots: dict[int, int] = {}
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.freed_swa = 0  # sliding-window blocks returned to the pool (checks the window really slides)

    def add(self, rid: int) -> None:
        self.tables[rid] = {n: [] for n in self.specs}
        self.lens[rid] = 0
        self.slots[rid] = self.free_slots.pop()

    def release(self, rid: int) -> None:
        for n, t in self.tables.pop(rid).items():
            self.free[n] += [b for b in t if b >= 0]
        self.free_slots.append(self.slots.pop(rid))
        del self.lens[rid]

    def _grow(self, rid: int, new_len: int) -> None:
        for n, spec in self.specs.items():
            table = self.tables[rid][n]
            need = -(-spec.num_entries(new_len) // self.bs) if spec.tokens_per_entry > 1 else -(-new_len // self.bs)
            while len(table) < need:
                table.append(self.free[n].pop())

    def _shrink(self, rid: int) -> None:
        for n, spec in self.specs.items():
            if spec.sliding_window is None:
                continue
            live = spec.first_live_entry(self.lens[rid])
            table = self.tables[rid][n]
            for j in range(live // self.bs):
                if table[j] >= 0:
                    self.free[n].append(table[j])
                    table[j] = -1
                    self.freed_swa += 1

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Logits [sum of chunk lengths, V] (every row) for one mixed step."""
        batch = self.batch(chunks)
        hidden = self.model(batch, self.caches)
        self.advance(chunks)
        return self.model.compute_logits(hidden)

    def advance(self, chunks: list[tuple[int, list[int]]]) -> None:
        """The chunks' tokens are computed: lengths grow, the window's old blocks go back."""
        for rid, toks in chunks:
            self.lens[rid] += len(toks)
            self._shrink(rid)

    def batch(self, chunks: list[tuple[int, list[int]]]) -> ForwardBatch:
        """The ForwardBatch of one mixed step of `chunks` after each request's computed tokens (blocks grown)."""
        ids, pos, qsl, ctx, seq, slots = [], [], [0], [], [], []
        for rid, toks in chunks:
            c = self.lens[rid]
            self._grow(rid, c + len(toks))
            ids += toks
            pos += list(range(c, c + len(toks)))
            qsl.append(qsl[-1] + len(toks))
            ctx.append(c)
            seq.append(c + len(toks))
            slots.append(self.slots[rid])
        tables, slot_map = {}, {}
        for n, spec in self.specs.items():
            width = max(1, max(len(self.tables[r][n]) for r, _ in chunks))
            bt = torch.full((len(chunks), width), -1, dtype=torch.int32)
            for i, (r, _) in enumerate(chunks):
                t = self.tables[r][n]
                bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
            tables[n] = bt
            req_idx = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor([len(t) for _, t in chunks]))
            slot_map[n] = token_slots(bt, req_idx, torch.tensor(pos, dtype=torch.int64), spec.tokens_per_entry, self.bs)
        T = len(ids)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.tensor(pos, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32), block_tables=tables, slot_mapping=slot_map,
            logits_indices=torch.arange(T), query_lens_cpu=[len(t) for _, t in chunks], seq_lens_cpu=seq,
            context_lens_cpu=ctx, state_slots=torch.tensor(slots, dtype=torch.int32), state_slots_cpu=slots,
            block_size=self.bs,
        )


def run_chunks(model, ids: list[int], chunk_sizes: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits of every position of `ids`, fed in consecutive chunks of the given sizes (cycled)."""
    r = PagedRunner(model, block_size=block_size)
    r.add(0)
    out, i, j = [], 0, 0
    while i < len(ids):
        n = chunk_sizes[j % len(chunk_sizes)]
        out.append(r.step([(0, ids[i : i + n])]))
        i += n
        j += 1
    return torch.cat(out)
