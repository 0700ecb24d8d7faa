"""DeepSeek V2 / V2-Lite / V3 / R1 / V3.1 (`model_type` deepseek_v2 and deepseek_v3).

`config.py` parses config.json (routing, q compression, rope scaling); `model.py` is the
causal LM (DeepseekV2ForCausalLM serves both model types).
"""
