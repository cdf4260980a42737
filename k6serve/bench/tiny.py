"""The `--tiny` CPU smoke configuration: every stage at toy size, so CI checks the harness, not speed."""

from __future__ import annotations

from k6serve.testing.tiny_configs import tiny_transformer_config

# The DiT of the parity tests (k6-generation.md §7.1) with every released flag on and distilled heads.
TINY_TRANSFORMER_CONFIG = tiny_transformer_config(distilled=True)
TINY_HEIGHT, TINY_WIDTH, TINY_NUM_FRAMES = 64, 96, 17
TINY_NUM_TEXT_TOKENS = 16
