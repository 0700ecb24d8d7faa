"""Quantized linear kernels of the nvidia backend (Triton): fp8 W8A8 block-scaled GEMM (+ its activation quant),
int4 weight-only GEMM (+ its dequantize pass for prefill-sized M), and the tile helpers they share with the MoE
grouped GEMMs (tiles.py).

docs/quantization.md describes the schemes; linear_methods.py wires them into the backend's linear methods.
"""
