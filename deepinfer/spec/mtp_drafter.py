"""MTP drafting: the checkpoint's MTP module runs after each step's verification, over the positions
whose next token is now known, and then chains on its own output to draft up to k tokens.

The MTP module at position i reads the main model's final hidden state h_i and the token t_{i+1}, and
attends over its own KV cache of earlier positions (layer id num_hidden_layers, in the MLA group: the
same blocks and slots as the main layers; models/deepseek_v3/mtp.py). So after a step:

1. the pass: for every scheduled sequence, the MTP module runs over the step's rows whose next token is
   known on the host (a prompt chunk: all its rows; a verified decode: its real token and the accepted
   drafts), writing the MTP KV of those positions, exactly as training evaluated it
   (tools/stdlib_coder/evaluate_heldout.py: `mtp_hidden(h[:, :-1], ids[:, 1:])`);
2. draft 1 of a sequence that sampled is the argmax of the MTP logits at its last such row (the token two
   ahead of the last verified one: one ahead of the token just emitted);
3. the chain (k > 1, the one module reused as vLLM does): the MTP module's own normed output state takes
   the place of h, the previous draft the place of the next token, one position further; each link writes
   MTP KV one position ahead (the "lookahead"), which the caller has allocated and which the next step's
   pass rewrites before anything reads it (the MTP attention is causal).

Confidence of a draft: the MTP distribution's probability of its own (argmax) token; a function of the
context only, so the confidence scheduler stays non-anticipating (spec/scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backend import ForwardBatch, KVCaches, token_slots
from deepinfer.worker.transfer import tensor_to, to_device


@dataclass
class MTPRows:
    """One sequence's rows in the MTP pass: rows [start, start + count) of the step's hidden states, the
    token after each, and whether it drafts (it sampled this step and goes on)."""

    start: int
    count: int
    next_ids: list[int]
    context_len: int
    drafts: bool
    state_row: int  # its row in the KV manager's tables


@dataclass
class Drafts:
    """Per drafting sequence (pass order): the drafted ids and their confidences."""

    tokens: list[list[int]]
    confidence: list[list[float]]


class MTPDrafter:
    """Drafts with MTP module 0 of `model` (model.mtp_forward / model.mtp_logits)."""

    def __init__(self, model, caches: KVCaches, block_tables: dict[str, torch.Tensor], block_size: int,
                 specs, device: torch.device):
        self.model = model
        self.caches = caches
        self.tables = block_tables  # the KV manager's host tables (token slots are read from them)
        self.block_size = block_size
        self.specs = list(specs)
        self.device = device

    def _batch(self, rows: list[int], positions: torch.Tensor, query_lens: list[int], context_lens: list[int],
               device_tables: dict[str, torch.Tensor]) -> ForwardBatch:
        """A ForwardBatch over `rows` of the KV tables: query_lens tokens each after context_lens, at `positions`."""
        req_idx = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(query_lens, dtype=torch.int64))
        token_rows = torch.tensor(rows, dtype=torch.int64)[req_idx]
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        slot_mapping, block_tables = {}, {}
        rows_dev = tensor_to(rows, torch.int64, self.device)
        for spec in self.specs:
            width = max(-(-(max(seq_lens) // spec.tokens_per_entry) // self.block_size), 1)
            block_tables[spec.name] = device_tables[spec.name][:, :width].index_select(0, rows_dev)
            slot_mapping[spec.name] = to_device(token_slots(self.tables[spec.name], token_rows, positions,
                                                            spec.tokens_per_entry, self.block_size), self.device)
        return ForwardBatch(
            input_ids=torch.zeros(int(positions.numel()), dtype=torch.int64, device=self.device),
            positions=to_device(positions, self.device),
            query_start_loc=tensor_to(qsl, torch.int32, self.device),
            seq_lens=tensor_to(seq_lens, torch.int32, self.device),
            context_lens=tensor_to(context_lens, torch.int32, self.device),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=torch.empty(0, dtype=torch.int64, device=self.device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=seq_lens,
            context_lens_cpu=list(context_lens),
            block_size=self.block_size,
        )

    def _draft_from(self, state: torch.Tensor, mask=None, live: list[int] | None = None,
                    tokens: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax ids [N], their probabilities [N]) of the MTP head at the normed states [N, D]; mask(live, tokens,
        logits): a structured request's grammar mask (spec/grammar_drafts.py), applied before both."""
        logits = self.model.mtp_logits(state)[:, : self.model.vocab_size].float()
        if mask is not None:
            logits = mask(live, tokens, logits)
        probs = torch.softmax(logits, dim=-1)
        conf, ids = probs.max(dim=-1)
        return ids, conf

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, items: list[MTPRows], chain_lens: list[int],
            device_tables: dict[str, torch.Tensor], mask=None) -> Drafts:
        """The pass over `items` (hidden [T, D] of the step) and the chain: drafting item j (in order) gets
        1 + (chain_lens[j] - 1) drafts; chain_lens[j] = 0 drafts nothing (positions the caller could not
        allocate). device_tables: the step's block tables on the device, current (the batch builder's mirror).
        mask: the drafting sequences' grammar masks (spec/grammar_drafts.py), or None."""
        items = [it for it in items if it.count > 0]
        if not items:
            return Drafts([], [])
        idx = torch.cat([torch.arange(it.start, it.start + it.count) for it in items])
        positions = torch.cat([torch.arange(it.context_len, it.context_len + it.count) for it in items])
        batch = self._batch([it.state_row for it in items], positions, [it.count for it in items],
                            [it.context_len for it in items], device_tables)
        next_ids = tensor_to([t for it in items for t in it.next_ids], torch.int64, self.device)
        state = self.model.mtp_forward(hidden.index_select(0, to_device(idx, self.device)), next_ids, batch,
                                       self.caches)
        ends, pos, rows = [], [], []
        end = 0
        for it in items:
            end += it.count
            if it.drafts:
                ends.append(end - 1)
                pos.append(it.context_len + it.count - 1)  # the last row's position
                rows.append(it.state_row)
        if not ends:
            return Drafts([], [])
        state = state.index_select(0, tensor_to(ends, torch.int64, self.device))
        ids, conf = self._draft_from(state, mask, list(range(len(ends))), [[] for _ in ends])
        tokens = [[t] for t in ids.tolist()]
        confs = [[c] for c in conf.tolist()]
        live = [j for j, n in enumerate(chain_lens) if n > 1]
        if live:
            sel = tensor_to(live, torch.int64, self.device)
            state, ids = state.index_select(0, sel), ids.index_select(0, sel)
        link = 1
        while live:  # link l: MTP at position pos + l, from its own state at pos + l - 1 and draft l
            p = torch.tensor([pos[j] + link for j in live], dtype=torch.int64)
            b = self._batch([rows[j] for j in live], p, [1] * len(live), p.tolist(), device_tables)
            state = self.model.mtp_forward(state, ids, b, self.caches)
            ids, conf = self._draft_from(state, mask, live, tokens)
            for j, t, c in zip(live, ids.tolist(), conf.tolist()):
                tokens[j].append(t)
                confs[j].append(c)
            link += 1
            keep = [i for i, j in enumerate(live) if chain_lens[j] > link]
            live = [live[i] for i in keep]
            if keep and len(keep) < len(ids):
                k_sel = tensor_to(keep, torch.int64, self.device)
                state, ids = state.index_select(0, k_sel), ids.index_select(0, k_sel)
        for j, n in enumerate(chain_lens):
            if n == 0:
                tokens[j], confs[j] = [], []
        return Drafts(tokens, confs)


def step_pass_rows(sched, emitted: list[list[int]], kv) -> tuple[list[MTPRows], list]:
    """Per scheduled sequence of a step (a SchedulerOutput), the rows whose next token is known after it: the MTP
    pass's input (emitted: the tokens each sequence emitted; kv: the KV manager, for the state rows). Returns the
    rows and their sequences."""
    rows: list[MTPRows] = []
    start = 0
    for item, toks in zip(sched.scheduled, emitted):
        seq, c = item.seq, item.context_len
        q0 = item.num_tokens - len(item.draft)
        if item.samples and toks:
            count = q0 + len(toks) - 1
            next_ids = seq.token_ids_slice(c + 1, c + q0) + toks
        elif item.samples:  # it drew nothing (its grammar mask failed): its last row's next token is unknown
            count = q0 - 1
            next_ids = seq.token_ids_slice(c + 1, c + q0)
        else:
            count = q0
            next_ids = seq.token_ids_slice(c + 1, c + q0 + 1)
        rows.append(MTPRows(start, count, next_ids, c, bool(item.samples and toks), kv.state_slot(seq.seq_id)))
        start += item.num_tokens
    return rows, [it.seq for it in sched.scheduled]
