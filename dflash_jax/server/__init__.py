"""The OpenAI- and Anthropic-compatible HTTP server behind `python -m dflash_jax.serve`."""
