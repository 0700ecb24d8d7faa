"""Speculative decoding: drafters (MTP, n-gram), lossless verification, the confidence scheduler.

docs/speculative.md describes the flags, the guarantees and what is measured.
"""
