"""SchedulerOutput -> ForwardBatch: the step's token ids, positions, block tables and KV slots.

This is the host work of every step, so its cost follows the batch, never the context: one pass
over the scheduled sequences, each token's KV slot read from the KV manager's host tables at
(row, entry // block_size), and the step's block tables gathered ON THE DEVICE from a mirror of
those tables that is kept current by applying only the entries the manager changed (a new block
every block_size tokens, a trimmed window, a freed sequence). A decode step at 32k tokens of
context copies a few dozen bytes of tables to the device, not B x 500 entries.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.backend import DECODE_ROWS, TOKEN_REQUESTS, ForwardBatch, KVCacheSpec, token_slots_host
from deepinfer.errors import DeepInferError
from deepinfer.kv.manager import KVCacheManager
from deepinfer.sched.scheduler import SchedulerOutput
from deepinfer.worker.transfer import to_device


class BatchBuilder:
    """Builds each step's ForwardBatch on the device from the scheduler's output and the KV manager."""

    def __init__(self, kv: KVCacheManager, device: torch.device, separate_mirror: bool | None = None):
        """separate_mirror: keep the device copy apart from the host tables (None: wherever the device is
        not the CPU; on the CPU the forward runs inside the step, so the host tables serve directly)."""
        self.kv = kv
        self.device = device
        self.specs: dict[str, KVCacheSpec] = {s.name: s for s in kv.specs}
        # numpy views of the host tables (the manager writes them in place): each token's KV slot comes from them
        self.tables_np = {name: t.numpy() for name, t in kv.block_tables.items()}
        self.separate = device.type != "cpu" if separate_mirror is None else separate_mirror
        self.mirror: dict[str, torch.Tensor] = (
            {g: t.clone().to(device) for g, t in kv.block_tables.items()} if self.separate else dict(kv.block_tables)
        )

    def sync_tables(self) -> None:
        """Apply the KV manager's table changes to the device mirror (stream-ordered before this step's
        gathers and after every earlier step's, so a step in flight keeps the tables it launched with)."""
        changes = self.kv.take_table_changes()
        if not self.separate or not changes:
            return
        for group, ranges in changes.items():
            host = self.kv.block_tables[group]
            rows = torch.cat([torch.full((e - a,), r, dtype=torch.int64) for r, a, e in ranges])
            cols = torch.cat([torch.arange(a, e, dtype=torch.int64) for _, a, e in ranges])
            vals = host[rows, cols]
            dev = to_device(torch.stack([rows, cols, vals.to(torch.int64)]), self.device)
            self.mirror[group].index_put_((dev[0], dev[1]), dev[2].to(torch.int32))

    def build(self, sched: SchedulerOutput, last_tokens: torch.Tensor | None) -> tuple[ForwardBatch, list[int]]:
        """The batch, and the indices of the scheduled sequences that sample this step.

        A sequence whose last token is still pending (drawn by the step in flight, async
        scheduling) gets a 0 in the host input ids, overwritten on the device from `last_tokens`
        (the in-flight step's drawn ids, row seq.pending_row): the host never waits for it.
        """
        items = sched.scheduled
        query_lens: list[int] = []
        ctx_lens: list[int] = []
        seq_lens: list[int] = []
        input_ids: list[int] = []
        qsl = [0]
        logits_idx: list[int] = []
        sampling: list[int] = []
        row_list: list[int] = []
        fill_dst: list[int] = []  # input rows whose id is a pending token ...
        fill_src: list[int] = []  # ... and its row in last_tokens
        total = 0
        verifies = False  # a draft is verified (spec/): the step's forward runs as decode rows
        state_slot = self.kv.state_slot
        for i, it in enumerate(items):  # one pass; a decode's input is its last output token (no slice)
            seq, c, draft = it.seq, it.context_len, it.draft
            d = len(draft)
            q = it.num_tokens - d  # drafts go after (spec/)
            n = seq.num_tokens
            query_lens.append(q + d)
            ctx_lens.append(c)
            seq_lens.append(c + q + d)
            row_list.append(state_slot(seq.seq_id))
            if seq.num_pending:
                if seq.num_pending != 1 or c + q != n or last_tokens is None:
                    raise DeepInferError(
                        f"{seq.seq_id!r}: {seq.num_pending} pending tokens, scheduled [{c}, {c + q}) of {n}: "
                        "only the last token may be pending, drawn by the last launched step"
                    )
                if q > 1:
                    input_ids.extend(seq.token_ids_slice(c, n - 1))
                input_ids.append(0)
                fill_dst.append(total + q - 1)
                fill_src.append(seq.pending_row)
            elif q == 1 and c == n - 1 and seq.output_token_ids:
                input_ids.append(seq.output_token_ids[-1])
            else:
                input_ids.extend(seq.token_ids_slice(c, c + q))
            total += q
            samples = c + q == n  # ScheduledSeq.samples, without its property lookups
            if d:  # verified in one forward: logits for the last real token and every drafted one
                verifies = True
                input_ids.extend(draft)
                logits_idx.extend(range(total - 1, total + d))
                total += d
            elif samples:
                logits_idx.append(total - 1)
            qsl.append(total)
            if samples:
                sampling.append(i)

        bs = self.kv.block_size
        longest = max(seq_lens, default=0)
        dev = self.device
        self.sync_tables()
        # every integer input in ONE host array and ONE host-to-device copy (each copy from the host costs a pinned
        # staging buffer and a launch): ids, logits rows, table rows, pending-token indices, positions, each
        # token's request (batches that are not decode-only: the memo's TOKEN_REQUESTS), the int32 words and each
        # group's KV slots (these from the host tables: O(tokens), not O(context)). Python lists up to the one
        # np.array, one torch tensor at the end: every small numpy or torch call costs a few us of host time, and
        # a step's host time before its forward is time its device idles (a one-sync speculative step at one
        # sequence spent ~0.15 ms here on this CPU with numpy per field, 2026-12-05). The int32 fields (query
        # starts, sequence and context lengths; for a step that verifies drafts, the same as decode rows: the
        # memo's DECODE_ROWS) travel as int32 words (`int32_words`) in one block, split once on the device.
        n, t, nl, nf = len(items), total, len(logits_idx), len(fill_dst)
        if total == n:  # decode-only: one token per sequence
            positions, tail, rows_fields = ctx_lens, [], []
        else:  # each token's position and request; a verify step runs as decode rows (spec/verify_batch.py)
            positions, tail, rows_fields = token_fields(query_lens, ctx_lens, t, verifies, t <= SMALL_BATCH_TOKENS)
        base = input_ids + logits_idx + row_list + fill_dst + fill_src
        if isinstance(positions, list):  # one conversion of one list
            head = np.array(base + positions + tail, dtype=np.int64)
        else:
            head = np.concatenate([np.array(base, dtype=np.int64), positions, tail])
        positions_np = head[t + nl + n + 2 * nf : 2 * t + nl + n + 2 * nf]
        token_rows_np = head[t + nl : t + nl + n]
        if len(tail):
            token_rows_np = token_rows_np[head[-t:]]
        words = int32_words(qsl, seq_lens, ctx_lens, *rows_fields)
        slots = [token_slots_host(self.tables_np[name], token_rows_np, positions_np, spec.tokens_per_entry, bs)
                 for name, spec in self.specs.items()]
        packed = to_device(torch.from_numpy(np.concatenate([head, words, *slots])), dev)
        ids, logits_d, rows_dev, fill, positions_d, req_d, words_d, *slot_d = packed.split_with_sizes(
            [t, nl, n, 2 * nf, t, len(tail), len(words)] + [t] * len(slots))
        lens = [n + 1, n, n] + ([t + 1, t, t] if rows_fields else [])
        qsl_d, seq_d, ctx_d, *rows_i32 = int32_views(words_d, lens)
        fill = fill.view(2, -1)
        block_tables: dict[str, torch.Tensor] = {}
        slot_mapping: dict[str, torch.Tensor] = {}
        for (name, spec), slot in zip(self.specs.items(), slot_d):
            width = max(self.kv.table_len(spec, longest), 1)  # tables cover seq_lens exactly
            # a copy (index_select): the mirror changes under later steps
            block_tables[name] = self.mirror[name][:, :width].index_select(0, rows_dev)
            slot_mapping[name] = slot

        state_slots_cpu: list[int] = []
        state_slots = None
        if self.kv.uses_state:
            state_slots_cpu = row_list
            state_slots = rows_dev.to(torch.int32)

        if fill_dst:  # device-side: pending tokens' ids from the last step's draw (stream-ordered after it)
            ids.index_copy_(0, fill[0], last_tokens.index_select(0, fill[1]))
        batch = ForwardBatch(
            input_ids=ids,
            positions=positions_d,
            query_start_loc=qsl_d,
            seq_lens=seq_d,
            context_lens=ctx_d,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=logits_d,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx_lens,
            state_slots=state_slots,
            state_slots_cpu=state_slots_cpu,
            block_size=bs,
        )
        if len(tail):
            batch.derived[TOKEN_REQUESTS] = req_d
        if rows_i32:
            batch.derived[DECODE_ROWS] = tuple(rows_i32)
        return batch, sampling


SMALL_BATCH_TOKENS = 32  # up to this many tokens `token_fields` uses Python lists: numpy's few us a call cost more


def token_fields(query_lens: list[int], ctx_lens: list[int], t: int, decode_rows: bool, lists: bool):
    """(each token's position, each token's request, and for decode rows their int32 fields: query starts 0..t,
    sequence lengths positions + 1, context lengths positions), for a batch of t tokens that is not decode-only:
    request i's tokens sit at positions ctx_lens[i] .. ctx_lens[i] + query_lens[i] - 1. As Python lists (`lists`,
    small batches: a numpy call costs more than the work) or numpy arrays (large ones: a list costs ~40 ns an
    element to convert); the same values either way."""
    if lists:
        positions: list[int] = []
        req: list[int] = []
        for i, (q, c) in enumerate(zip(query_lens, ctx_lens)):
            positions.extend(range(c, c + q))
            req.extend([i] * q)
        if not decode_rows:
            return positions, req, []
        return positions, req, [list(range(t + 1)), [p + 1 for p in positions], positions]
    q_np = np.array(query_lens, dtype=np.int64)
    starts = np.cumsum(q_np) - q_np
    positions_np = np.arange(t, dtype=np.int64) + np.repeat(np.array(ctx_lens, dtype=np.int64) - starts, q_np)
    req_np = np.repeat(np.arange(len(query_lens), dtype=np.int64), q_np)
    if not decode_rows:
        return positions_np, req_np, []
    return positions_np, req_np, [np.arange(t + 1), positions_np + 1, positions_np]


def int32_words(*fields) -> np.ndarray:
    """int32 fields (lists, or numpy arrays, of values that fit int32) packed into int64 words for the step's one
    int64 copy, each field starting on a word (an odd-length field gets one int32 of padding): `int32_views` on the
    device gives them back as int32 tensors without a cast."""
    if all(isinstance(f, list) for f in fields):  # one conversion of one list
        flat: list[int] = []
        for f in fields:
            flat += f
            if len(f) % 2:
                flat.append(0)
        return np.array(flat, dtype=np.int32).view(np.int64)
    sizes = [len(f) + len(f) % 2 for f in fields]
    out = np.zeros(sum(sizes), dtype=np.int32)  # each field written into its slice: no array per field
    o = 0
    for f, size in zip(fields, sizes):
        out[o : o + len(f)] = f
        o += size
    return out.view(np.int64)


def int32_views(words: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    """The int32 fields of lengths `lens` that `int32_words` packed, as views of the int64 `words` (on the device)."""
    sizes = []
    for m in lens:  # each field, then its padding (0 or 1): one split, no slice per field
        sizes += (m, m % 2)
    return list(words.view(torch.int32).split_with_sizes(sizes)[::2])
