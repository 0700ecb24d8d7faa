"""DeepSeek model math, written against the backend contract (deepinfer.backend)."""
