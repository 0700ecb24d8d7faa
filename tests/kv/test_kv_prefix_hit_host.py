"""The host fast paths of a prefix hit (benchmarks/prefix_hit_host.py): all block keys of a prompt hashed in one
pass must give exactly the per-block keys (disk-tier file names depend on those bytes), keys extended piecewise
must equal keys made at once, and the prompt-id fast path must still refuse what the slow loop refuses."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from deepinfer.errors import DeepInferError, InvalidRequestError
from deepinfer.kv.prefix_admission import PrefixAdmission
from deepinfer.kv.prefix_cache import block_key, chain_keys
from deepinfer.text.inputs import prompt_token_ids

SALT = b"model-fingerprint|float32|bs16"


def per_block(tokens: list[int], bs: int, parent: bytes = b"") -> list[bytes]:
    """The reference: block_key over each block, chained."""
    out = []
    for i in range(0, len(tokens), bs):
        parent = block_key(parent, tokens[i: i + bs], SALT)
        out.append(parent)
    return out


def test_chain_keys_equal_block_key_bytes():
    rng = random.Random(0)
    tokens = [rng.randrange(0, 2**31) for _ in range(16 * 9)]
    want = per_block(tokens, 16)
    assert chain_keys(b"", tokens, 16, SALT) == want
    assert chain_keys(b"", np.asarray(tokens, dtype=np.int32), 16, SALT) == want  # any int dtype: int64 bytes
    # chained from a parent: the tail of a prefix continues the chain of its head
    assert chain_keys(want[3], tokens[64:], 16, SALT) == want[4:]
    assert chain_keys(b"", [], 16, SALT) == []
    # a different salt or one changed token changes every key from that block on, and none before
    assert chain_keys(b"", tokens, 16, SALT + b"x")[0] != want[0]
    tokens[40] += 1
    changed = chain_keys(b"", tokens, 16, SALT)
    assert changed[:2] == want[:2] and all(a != b for a, b in zip(changed[2:], want[2:]))


def test_chain_keys_refuses_a_partial_block():
    with pytest.raises(DeepInferError, match="not whole blocks of 16"):
        chain_keys(b"", list(range(20)), 16, SALT)


@dataclass
class FakeSeq:
    tokens: list[int]
    block_keys: list[bytes] = field(default_factory=list)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


class Keys(PrefixAdmission):
    block_size = 16
    cache_salt = SALT


def test_block_keys_extend_piecewise_like_at_once():
    rng = random.Random(1)
    tokens = [rng.randrange(0, 50000) for _ in range(16 * 12 + 5)]
    want = per_block(tokens[: 16 * 12], 16)
    keys, seq = Keys(), FakeSeq(tokens)
    assert keys.block_keys(seq, 3) == want[:3]
    assert keys.block_key_at(seq, 7) == want[7]  # makes 3..7 on the way
    assert len(seq.block_keys) == 8
    assert keys.block_keys(seq, 5) == want[:5]  # shorter: a prefix of what is kept, nothing recomputed
    assert keys.block_keys(seq, 12) == want
    assert seq.block_keys == want


def test_prompt_id_fast_path_still_refuses_bad_entries():
    ids = list(range(5, 3000))
    assert prompt_token_ids(ids, None, 4096, 8192) == (None, ids)
    bad = ids[:]
    bad[17] = True  # a bool is an int subclass: the fast path must not let it through
    with pytest.raises(InvalidRequestError, match="prompt token 17 is True, not an integer id"):
        prompt_token_ids(bad, None, 4096, 8192)
    bad[17] = 2.0
    with pytest.raises(InvalidRequestError, match="prompt token 17 is 2.0, not an integer id"):
        prompt_token_ids(bad, None, 4096, 8192)
    with pytest.raises(InvalidRequestError, match="prompt token 2994 has id 2999, outside the vocabulary"):
        prompt_token_ids(ids, None, 2999, 8192)
    mixed = ids[:]
    mixed[3] = np.int64(9)  # numpy ints are ids: converted to int by the slow loop
    _, got = prompt_token_ids(mixed, None, 4096, 8192)
    assert got[3] == 9 and type(got[3]) is int
