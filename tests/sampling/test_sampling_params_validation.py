"""SamplingParams.validate: every documented bound, each refusal naming its field (issue 11).

A value the sampler cannot represent must never be queued: these are the InvalidRequestErrors
the server turns into 400s naming the field. Boundary values that must pass are checked too.
"""

from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from deepinfer.errors import InvalidRequestError
from deepinfer.sampling_params import GREEDY_TEMPERATURE, MAX_N

NAN, INF = float("nan"), float("inf")

REFUSED = [
    # n
    ("n", 0), ("n", MAX_N + 1), ("n", 1.5), ("n", 2.0), ("n", True), ("n", "2"), ("n", None),
    # floats: non-finite, out of range, wrong type
    *[("temperature", v) for v in (NAN, INF, -INF, -1e-9, 100.0001, 1e300, True, "1", None)],
    *[("top_p", v) for v in (NAN, INF, 0.0, -0.5, 1.0000001, False, None)],
    *[("min_p", v) for v in (NAN, INF, -0.1, 1.1, True)],
    *[("repetition_penalty", v) for v in (NAN, INF, 0.0, -1.0, 100.5, 1e308, True)],
    *[("presence_penalty", v) for v in (NAN, INF, -INF, 2.01, -2.01, True)],
    *[("frequency_penalty", v) for v in (NAN, INF, -INF, 2.01, -2.01, False)],
    # integers the engine could not hold
    *[("top_k", v) for v in (2**31, 2**63, 10**30, -2, -(2**63), 1.0, 50.0, True)],
    *[("max_tokens", v) for v in (0, -1, 2**31, 2**63, 16.0, True)],
    *[("min_tokens", v) for v in (-1, 2**31, 1.0, True)],
    *[("seed", v) for v in (2**63, -(2**63) - 1, 2**100, 1.0, True, "7")],
    *[("logprobs", v) for v in (-1, 21, 2**63, 1.0, True)],
    *[("prompt_logprobs", v) for v in (-1, 21, 2.0)],
    # lists
    *[("stop_token_ids", v) for v in ([2**31], [-1], [2**63], [1.0], [True], 5, "12", 1.5)],
    *[("stop", v) for v in ([""], [1], ["ok", None], 5, ["\ud800"], "a\udfffb")],
    # booleans
    *[(f, v) for f in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens") for v in (1, 0, "yes", None)],
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}={v!r}"[:40] for f, v in REFUSED])
def test_refused_values_name_their_field(field, value):
    kwargs = {field: value}
    if field == "min_tokens":
        kwargs["max_tokens"] = None
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field
    assert str(info.value).startswith(field)


def test_revalidation_catches_values_changed_after_construction():
    p = SamplingParams()
    p.top_k = 2**63
    with pytest.raises(InvalidRequestError) as info:
        p.validate()
    assert info.value.param == "top_k"


ACCEPTED = [
    dict(n=MAX_N), dict(temperature=0), dict(temperature=100), dict(temperature=100.0), dict(temperature=1e-300),
    dict(top_p=1e-12), dict(top_p=1), dict(min_p=0), dict(min_p=1.0), dict(repetition_penalty=5e-324),
    dict(repetition_penalty=100), dict(presence_penalty=-2), dict(frequency_penalty=2.0),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=2**31 - 1), dict(max_tokens=2**31 - 1),
    dict(max_tokens=None, min_tokens=2**31 - 1), dict(seed=2**63 - 1), dict(seed=-(2**63)), dict(seed=0),
    dict(stop_token_ids=[0, 2**31 - 1]), dict(stop="x"), dict(stop=("a", "b")), dict(stop=None),
    dict(stop_token_ids=None), dict(stop_token_ids=(3, 4)), dict(stop={"a", "b"}), dict(logprobs=0),
    dict(logprobs=20), dict(stop=["é", "日本"]),
]


@pytest.mark.parametrize("kwargs", ACCEPTED, ids=[str(k)[:40] for k in ACCEPTED])
def test_boundary_values_pass(kwargs):
    p = SamplingParams(**kwargs)
    p.validate()
    assert isinstance(p.stop, list) and isinstance(p.stop_token_ids, list)


def test_greedy_threshold():
    assert GREEDY_TEMPERATURE == 1e-5
    for t in (0, 0.0, 1e-30, 9.99e-6, 5e-324):
        assert SamplingParams(temperature=t).greedy
    for t in (1e-5, 0.1, 100):
        assert not SamplingParams(temperature=t).greedy
    assert SamplingParams(temperature=1.0, top_k=1).greedy


def test_huge_repr_is_cut_in_the_message():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=[2**40] * 10000)
    assert len(str(info.value)) < 400
