"""The sampling room: logits -> one token per row.

`sampler.py` (penalties -> min-tokens mask -> temperature / top-k / top-p / min-p -> a
counter-based draw), `penalties.py` (repetition / frequency / presence), `rng.py` (keyed
uniforms: a seeded row draws the same token in any batch), `grammar/` (structured output: the
grammar engines, matchers and the host bitmask fill; its docstring is the API reference). Logits
processors go next to `penalties.py`; the sampling parameters themselves are `deepinfer.sampling_params`.
"""
