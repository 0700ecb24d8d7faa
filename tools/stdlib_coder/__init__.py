"""stdlib-coder: the embedded default model, a small DeepSeek-V3 (with one MTP module) trained on the
CPython standard library. Data, tokenizer, training, export and evaluation live here; the product only
ships the result (deepinfer/data/stdlib-coder/). docs/models.md is its model card."""
