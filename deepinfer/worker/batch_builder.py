"""SchedulerOutput -> ForwardBatch: the step's token ids, positions, block tables and KV slots.

This is the host work of every step, so its cost follows the batch, never the context: one pass
over the scheduled sequences, each token's KV slot read from the KV manager's host tables at
(row, entry // block_size), and the step's block tables gathered ON THE DEVICE from a mirror of
those tables that is kept current by applying only the entries the manager changed (a new block
every block_size tokens, a trimmed window, a freed sequence). A decode step at 32k tokens of
context copies a few dozen bytes of tables to the device, not B x 500 entries.
"""

from __future__ import annotations

import torch

from deepinfer.backend import ForwardBatch, KVCacheSpec, token_slots
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
        fill_dst: list[int] = []  # input rows whose id is a pending token ...
        fill_src: list[int] = []  # ... and its row in last_tokens
        total = 0
        for i, it in enumerate(items):  # one pass; a decode's input is its last output token (no slice)
            seq, c, q = it.seq, it.context_len, it.num_tokens - len(it.draft)  # drafts go after (spec/)
            n = seq.num_tokens
            query_lens.append(q + len(it.draft))
            ctx_lens.append(c)
            seq_lens.append(c + q + len(it.draft))
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
            if it.draft:  # verified in one forward: logits for the last real token and every drafted one
                input_ids.extend(it.draft)
                logits_idx.extend(range(total - 1, total + len(it.draft)))
                total += len(it.draft)
            elif it.samples:
                logits_idx.append(total - 1)
            qsl.append(total)
            if it.samples:
                sampling.append(i)

        ctx_t = torch.tensor(ctx_lens, dtype=torch.int64)
        if total == len(items):  # decode-only: one token per sequence
            req_idx = torch.arange(len(items))
            positions = ctx_t
        else:
            q_t = torch.tensor(query_lens, dtype=torch.int64)
            req_idx = torch.repeat_interleave(torch.arange(len(items)), q_t)
            starts = torch.repeat_interleave(torch.tensor(qsl[:-1], dtype=torch.int64), q_t)
            positions = ctx_t[req_idx] + torch.arange(total, dtype=torch.int64) - starts

        bs = self.kv.block_size
        row_list = [self.kv.state_slot(it.seq.seq_id) for it in items]
        rows = torch.tensor(row_list, dtype=torch.int64)
        longest = max(seq_lens, default=0)
        dev = self.device
        self.sync_tables()
        token_rows = rows[req_idx]
        # every integer input in ONE host tensor and ONE host-to-device copy (each copy from the host costs a pinned
        # staging buffer and a launch): ids, then the int32 fields, logits rows, table rows, pending-token indices,
        # positions and each group's KV slots (these from the host tables: O(tokens), not O(context))
        n, t = len(items), total
        head = torch.tensor(input_ids + qsl + seq_lens + ctx_lens + logits_idx + row_list + fill_dst + fill_src,
                            dtype=torch.int64)
        slots = [token_slots(self.kv.block_tables[name], token_rows, positions, spec.tokens_per_entry, bs)
                 for name, spec in self.specs.items()]
        packed = to_device(torch.cat([head, positions, *slots]), dev)
        o = 0

        def take(m: int) -> torch.Tensor:
            nonlocal o
            o += m
            return packed[o - m : o]

        ids, qsl_d, seq_d, ctx_d = take(t), take(n + 1), take(n), take(n)
        logits_d, rows_dev = take(len(logits_idx)), take(n)
        fill = take(2 * len(fill_dst)).view(2, -1)
        positions_d = take(t)
        block_tables: dict[str, torch.Tensor] = {}
        slot_mapping: dict[str, torch.Tensor] = {}
        for name, spec in self.specs.items():
            width = max(self.kv.table_len(spec, longest), 1)  # tables cover seq_lens exactly
            # a copy (index_select): the mirror changes under later steps
            block_tables[name] = self.mirror[name][:, :width].index_select(0, rows_dev)
            slot_mapping[name] = take(t)

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
            query_start_loc=qsl_d.to(torch.int32),
            seq_lens=seq_d.to(torch.int32),
            context_lens=ctx_d.to(torch.int32),
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
        return batch, sampling
