"""Package layout only; every other setting lives in pyproject.toml.

The CUDA C++ sources stay at the repo root (csrc/cuda) and ship inside the package as
deepinfer/_csrc/cuda, where deepinfer.backends.nvidia.cuda_ext.csrc_dir() finds them in a
wheel install. An editable install (`pip install -e .`) reads them from the checkout instead.
pyproject.toml cannot add a package that lives outside deepinfer/ to the discovered ones,
hence this file. The embedded model's files are package data of deepinfer.data.
"""

from setuptools import find_packages, setup

CSRC_PATTERNS = ["*.cu", "*.cuh", "*.h", "*.hpp", "*.cpp"]

setup(
    packages=[*find_packages(include=["deepinfer*"]), "deepinfer._csrc", "deepinfer._csrc.cuda"],
    package_dir={"deepinfer._csrc": "csrc"},
    # the embedded default model (deepinfer/data/stdlib-coder: weights, tokenizer, configs)
    package_data={"deepinfer._csrc.cuda": CSRC_PATTERNS, "deepinfer.data": ["stdlib-coder/*"]},
)
