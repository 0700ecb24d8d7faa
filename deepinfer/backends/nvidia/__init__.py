"""NVIDIA backend: Triton kernels plus CUDA C++ extensions (csrc/cuda), imported lazily."""
