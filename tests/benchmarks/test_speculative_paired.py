"""benchmarks/speculative.py's paired ratio: each repeat's total tok/s over off's in the same repeat, the median."""

from __future__ import annotations

import math

from benchmarks.speculative import paired_ratio


def test_paired_ratio_is_the_median_of_same_repeat_ratios():
    # best-of would divide 10 by 4 (2.5x); the repeats' own ratios are 2.0, 1.5 and 2.5
    assert paired_ratio([2.0, 3.0, 10.0], [1.0, 2.0, 4.0]) == 2.0
    assert paired_ratio([2.0, 3.0], [1.0, 2.0]) == 1.75  # an even count: the middle two's mean
    assert paired_ratio([2.0, 3.0], [0.0, 2.0]) == 1.5  # a repeat whose off emitted nothing is left out
    assert math.isnan(paired_ratio([], []))
