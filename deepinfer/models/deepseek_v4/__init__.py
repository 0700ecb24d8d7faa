"""DeepSeek V4 (`model_type` deepseek_v4): hybrid sliding-window / compressed attention,
hyper-connections, hash + sqrtsoftplus routed MoE. See docs/v4.md.

`config.py`, `model.py` (DeepseekV4ForCausalLM), `attention.py`, `hyper_connections.py`, `moe.py`.
"""
