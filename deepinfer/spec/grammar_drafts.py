"""Grammar masks of speculation: a structured request's MTP drafts drawn under its grammar, so that they can be
accepted (`DraftGrammarMask`), and the masks of a step's verified positions (`verify_masks`).

Why. The verification draws every verified position under the grammar mask (sample/grammar/draft_mask.py), so a
drafted token the grammar forbids is rejected for sure, and the draft is cut before it (`clip_draft`). The MTP
module of a code model proposes code: under a JSON Schema most of its unmasked drafts were cut at the first slot.
Masking the MTP logits at each link with the grammar state after the tokens before it makes every draft valid;
the argmax of the masked MTP distribution is what the masked target most likely draws there.

How. At each link (the pass's draft, then each chain link) the drafter calls the mask with the drafting sequences
still chaining and their drafts so far; for the constrained ones whose state is not in error and whose drafts
hold no EOS, `fill_draft_grammar_mask` fills the masks of the state after output + this step's emitted tokens +
the drafts so far (the matcher moves tentatively and is rolled back; the emitted tokens are committed when output
processing appends them, as always), and the last row of each, the next draft's mask, is applied by the sampler's
backend op. A sequence whose state fails is left unmasked: its verification fails it (never silently). The
confidence of a masked draft is its probability under the masked MTP distribution: a function of the context and
the grammar only, so the confidence scheduler stays non-anticipating.

Cost: per link, one fill of j + 1 rows per constrained sequence (the state walks the j drafts before it) and one
masked-logits op; unconstrained sequences pay nothing. With MTP graphs (backend/mtp_graph_runner.py) the
constrained sequences' chains run eagerly (their masks need each link's drafts on the host, a sync per link), the
others' replay; the pass over everyone's rows replays either way.
"""

from __future__ import annotations

import torch

from deepinfer.sample.grammar.bitmask import GrammarMask
from deepinfer.sample.grammar.draft_mask import fill_draft_grammar_mask


class DraftGrammarMask:
    """The mask callable MTPDrafter.run applies to its logits: (live drafting indices, drafts so far per drafting
    index, logits [len(live), V]) -> masked logits."""

    def __init__(self, seqs: list, emitted: list[list[int]], facts, forbidden: torch.Tensor, sampler):
        self.seqs, self.emitted = seqs, emitted  # per drafting sequence: the sequence, its tokens emitted this step
        self.facts, self.forbidden, self.sampler = facts, forbidden, sampler
        self.eos = set(facts.eos_token_ids)
        self.num_masked = 0  # drafts drawn under a grammar mask (engine life, through the pipeline)

    @staticmethod
    def needed(seqs: list) -> bool:
        return any(s.grammar is not None for s in seqs)

    def constrains(self, j: int) -> bool:
        """Whether drafting sequence j is structured (its chain runs eagerly: its mask needs the drafts so far)."""
        return self.seqs[j].grammar is not None

    def __call__(self, live: list[int], tokens: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        states, rows, last = [], [], []
        first = 0
        for r, j in enumerate(live):
            seq = self.seqs[j]
            if seq.grammar is None:
                continue
            output = seq.output_token_ids + self.emitted[j]
            draft = tokens[j]
            if (output and output[-1] in self.eos) or any(t in self.eos for t in draft):
                continue  # nothing follows EOS: the draft is cut there at verification
            states.append((first, seq.grammar, output, list(draft)))
            rows.append(r)
            first += len(draft) + 1
            last.append(first - 1)
        if not states:
            return logits
        mask, failed = fill_draft_grammar_mask(states, self.facts, self.forbidden)
        bad = {st[0] for st in states if st[0] in failed}
        keep = [(r, b) for (r, b, st) in zip(rows, last, states) if st[0] not in bad]
        if not keep or mask is None:
            return logits
        self.num_masked += len(keep)
        bitmask = mask.bitmask[[b for _, b in keep]]
        return self.sampler.apply_grammar(logits, GrammarMask([r for r, _ in keep], bitmask))


def verify_masks(items, sampling: list[int], facts, forbidden: torch.Tensor):
    """The masks of every verified position of a step's constrained sequences (sample/grammar/draft_mask.py; items:
    the step's ScheduledSeqs, sampling: the indices that draw, len(draft) + 1 rows each), and {index into items:
    error} for those that cannot be sampled. Host work, done while the forward runs."""
    states, r = [], 0
    for i in sampling:
        seq, draft = items[i].seq, items[i].draft
        if seq.grammar is not None:
            states.append((r, seq.grammar, seq.output_token_ids, draft))
        r += len(draft) + 1
    if not states:
        return None, {}
    mask, failed = fill_draft_grammar_mask(states, facts, forbidden)
    first = {}
    r = 0
    for i in sampling:
        first[r] = i
        r += len(items[i].draft) + 1
    return mask, {first[row]: message for row, message in failed.items()}
