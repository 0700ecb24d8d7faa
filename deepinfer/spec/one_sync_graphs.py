"""The one-sync step's verification and derivation (spec/one_sync.py, step 2) as captured graphs, one per MTP pass
bucket, over the MTP graphs' static buffers and graph API (backend/mtp_graph_runner.py).

Why. After the draw, the one-sync step verifies the drafts and derives the pass's and chain's inputs from the
accepted counts: about fifteen small device ops (the gathers of the draw and the drafts, the greedy rule, the
padding of rejected rows, the next ids, the chain's first rows, positions and lengths). Run eagerly each is a launch
paid in host time (5-8 us each on a GPU, ~2 us on this CPU), and speculative engines are host-bound (on the H200,
2026-12-03: a k = 3 step cost ~1.46 ms against ~0.55 ms for a plain decode step). Captured, they are one replay,
after one copy of the draw into a static buffer.

What verify[T] computes, over the T rows of its pass bucket and all B_max chain rows, from the staged segments:
- the greedy rule (`greedy_accepted`, the function spec/rejection.py's greedy_verify counts with): sequence b's
  target tokens are the draw at rows f_start_b + j (j = 0..K, K the graphs' k, clamped to the bucket), its drafts
  the staged draft tokens f_tok at rows f_start_b + 1 + j, only its f_dlen_b first drafts count;
- into the pass's segments: p_ids = the draw at rows whose p_row was staged (real rows), 0 at padded rows (as
  staged); p_row = -1 at each sequence's rows past its accepted run (read nothing, write nothing);
- into the chain's: c_src, c_pos = f_start, f_ctx + accepted; c_len = max(0, min(c_len, f_room - accepted)).
The same values, row for row, as the eager ops it replaced (tests/spec/test_spec_one_sync.py checks `finish`
against the host path's verification and drafter). Rows past the step's: a padded chain row below the chain
bucket (staged f_dlen 0, f_start 0, f_ctx 0, f_room 0, c_len 0) derives 0, 0, 0: its staged inert values again;
chain rows at or past the chain bucket and pass rows past the pass bucket are never read by the step's replays
(each restages its own bucket's rows before it runs). The draw's rows past the step's count are whatever an
earlier step left there: read only where they are masked (drafts past f_dlen, padded rows' p_ids).

Memory: per pass bucket a graph of these small int64 ops (their intermediates, [B_max, K + 1] at most, in one pool
of their own), a [T_max] and a [B_max] int64 buffer. Captured when the one-sync step is built (engine start-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.spec.rejection import greedy_accepted


@dataclass
class VerifyGraphs:
    """verify[T] per pass bucket (module docstring) over `graphs` (a backend/mtp_graph_runner.MTPGraphRunner)."""

    graphs: object
    chosen: torch.Tensor  # [T_max] int64: the step's draw, copied in before the replay
    accepted: torch.Tensor  # [B_max] int64: the accepted counts (the replay's output)
    cols: torch.Tensor  # [K + 1] int64: 0..K
    by_bucket: dict[int, object] = field(default_factory=dict)
    num_replays: int = 0

    @classmethod
    def capture(cls, graphs, device: torch.device) -> VerifyGraphs:
        st = graphs.static
        vg = cls(graphs=graphs, chosen=torch.zeros(st.t_max, dtype=torch.int64, device=device),
                 accepted=torch.zeros(st.b_max, dtype=torch.int64, device=device),
                 cols=torch.arange(st.k + 1, dtype=torch.int64, device=device))
        api = graphs.api
        pool = api.new_pool()
        with torch.inference_mode():
            for t in sorted(graphs.pass_buckets, reverse=True):  # largest first: the pool is sized once
                vg.by_bucket[t], _ = api.capture_one(lambda t=t: vg._verify(t), pool)
        api.finish_capture()
        return vg

    def _verify(self, t: int) -> torch.Tensor:
        """The captured function of bucket t (module docstring). Device ops only: capturable."""
        st = self.graphs.static
        idx = (st.seg("f_start").unsqueeze(1) + self.cols).clamp(max=t - 1)  # [B_max, K + 1]
        acc = greedy_accepted(self.chosen[idx], st.seg("f_tok")[idx[:, 1:]], st.seg("f_dlen"))
        self.accepted.copy_(acc)
        p_row = st.seg("p_row")[:t]
        st.seg("p_ids")[:t].copy_(torch.where(p_row >= 0, self.chosen[:t], 0))  # real rows: the draw; padding: 0
        p_row.masked_fill_(st.seg("f_j")[:t] > acc[st.seg("f_seq")[:t]], -1)  # rows past the accepted run
        torch.add(st.seg_pair("f_start", "f_ctx"), acc, out=st.seg_pair("c_src", "c_pos"))
        c_len = st.seg("c_len")
        torch.minimum(c_len, st.seg("f_room") - acc, out=c_len).clamp_(min=0)
        return self.accepted

    def run(self, chosen: torch.Tensor, bucket: int) -> torch.Tensor:
        """Copy the draw (its t rows) in and replay verify[bucket]; the accepted counts [B_max] (a static buffer)."""
        self.chosen[: chosen.shape[0]].copy_(chosen)
        self.graphs.api.replay(self.by_bucket[bucket])
        self.num_replays += 1
        return self.accepted
