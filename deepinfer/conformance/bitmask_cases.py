"""Conformance cases of the sampling op `apply_token_bitmask` (structured output's grammar mask).

Why bitwise: the op only writes -inf where a bit is clear and leaves every other logit as it was, so
there is nothing to round: a backend's output must equal the native oracle's (backend/native/grammar.py)
bit for bit (compare="bitwise" in runner.py), -inf included.

The cases cover what the sampler hands the op: a subset of the batch's rows in any order (the
constrained rows beside unconstrained ones, which must stay untouched), all rows (rows=None), a vocabulary
that is not a multiple of 32 (the last word's bits beyond V must be ignored, never written past the row),
a mask narrower than the vocabulary (ids beyond 32 W, a padded model vocabulary, are forbidden), and
all-masked rows. The contract for an all-masked row is the plain rule: every logit of the row becomes -inf.
Refusing to sample such a row is the host fill's job (sample/grammar/bitmask.py fails its request before
the draw); the op itself neither raises nor leaves the row as it was.
"""

from __future__ import annotations

import torch

from deepinfer.backend import Backend
from deepinfer.backend.native.grammar import apply_token_bitmask as native_apply_token_bitmask
from deepinfer.conformance.cases_base import Case, Inputs, randn

OP = "apply_token_bitmask"


def random_bitmask(g: torch.Generator, rows: int, words: int, p_allowed: float) -> torch.Tensor:
    """int32 [rows, words]: each bit set with probability p_allowed (bit t % 32 of word t // 32 = token t)."""
    bits = (torch.rand(rows, words, 32, generator=g) < p_allowed).to(torch.int64)
    packed = (bits << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _case(name: str, n: int, vocab: int, words: int, rows: list[int] | None, *, p_allowed: float = 0.3,
          all_masked: tuple[int, ...] = (), all_allowed: tuple[int, ...] = ()) -> Case:
    """n logit rows of width vocab; a mask of `words` int32 words for `rows` (None: every row); the mask rows
    listed in all_masked are all-zero, those in all_allowed all-ones."""
    m = n if rows is None else len(rows)

    def make(g: torch.Generator, dt: torch.dtype) -> Inputs:
        mask = random_bitmask(g, m, words, p_allowed)
        for j in all_masked:
            mask[j] = 0
        for j in all_allowed:
            mask[j] = -1
        return {"logits": randn(g, n, vocab, dtype=dt, scale=3.0), "bitmask": mask,
                "rows": None if rows is None else torch.tensor(rows, dtype=torch.int64)}

    def run(o, i: Inputs) -> tuple[torch.Tensor, ...]:
        logits = i["logits"].clone()  # the op works in place: never on the shared inputs
        # the oracle (NativeOps alone, not a Backend) has no sampling ops: it calls the native op itself
        op = o.apply_token_bitmask if isinstance(o, Backend) else native_apply_token_bitmask
        out = op(logits, i["bitmask"], i["rows"])
        if out is not logits:
            raise AssertionError("apply_token_bitmask must work in place and return its logits")
        return (out,)

    return Case(OP, name, make, run, compare="bitwise")


def bitmask_cases(shapes: str) -> list[Case]:
    """The bitmask cases at "tiny" (tens of logits; CPU CI, TRITON_INTERPRET) or "real" (DeepSeek vocabularies)."""
    if shapes == "tiny":
        return [
            _case("N=5 V=70 W=3 rows [3, 0, 4] (subset, unsorted; V % 32 != 0)", 5, 70, 3, [3, 0, 4]),
            _case("N=4 V=64 W=2 all rows (rows=None)", 4, 64, 2, None),
            _case("N=3 V=100 W=2 rows [2, 1] (mask narrower than the vocabulary: ids >= 64 forbidden)",
                  3, 100, 2, [2, 1], p_allowed=0.6),
            _case("N=4 V=1100 W=35 rows [1, 3] (two column blocks)", 4, 1100, 35, [1, 3]),
            _case("N=4 V=70 W=3 rows [0, 2, 3]: an all-masked row and an all-allowed row", 4, 70, 3, [0, 2, 3],
                  all_masked=(0,), all_allowed=(2,)),
            _case("N=2 V=33 W=2 all rows all-masked", 2, 33, 2, None, all_masked=(0, 1)),
        ]
    if shapes == "real":
        return [
            _case("N=64 V=129280 (V3) rows 40 of 64", 64, 129280, 4040, list(range(0, 64, 8)) + list(range(1, 64, 2))),
            _case("N=16 V=102400 (V2) all rows, one all-masked", 16, 102400, 3200, None, all_masked=(5,)),
            _case("N=8 V=100003 W=3126 rows [7, 2, 5] (V % 32 != 0)", 8, 100003, 3126, [7, 2, 5], p_allowed=0.05),
        ]
    raise ValueError(f"unknown conformance shapes {shapes!r} (choose 'tiny' or 'real')")
