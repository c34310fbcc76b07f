"""The launcher tier (tests/README.md)."""
