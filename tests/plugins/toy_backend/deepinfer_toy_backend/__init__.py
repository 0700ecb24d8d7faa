"""A third-party DeepInfer backend used by tests/plugins: torch-native ops under a new name."""
