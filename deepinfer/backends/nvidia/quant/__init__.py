"""Quantized linear kernels of the nvidia backend (Triton): fp8 W8A8 block-scaled GEMM, int4 weight-only GEMM.

docs/quantization.md describes the schemes; linear_methods.py wires them into the backend's linear methods.
"""
