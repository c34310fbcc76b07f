"""The distributed tier (tests/README.md)."""
