"""Helpers for building test data: reference GGUF quantizers."""
