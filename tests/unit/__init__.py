"""The unit tier (tests/README.md)."""
