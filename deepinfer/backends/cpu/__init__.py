"""The `cpu` backend: torch-native ops, the reference every other backend is checked against."""
