"""Layers every DeepSeek family shares, written against the backend contract.

`linear.py` (Linear / MergedLinear over the backend's linear method per quant scheme),
`mla.py` (multi-head latent attention: projections around the backend's MLA op),
`moe.py` + `experts.py` (routed + shared experts through the backend's MoE op), `mlp.py`
(SwiGLU), `embedding.py` (vocab embedding, LM head).
"""
