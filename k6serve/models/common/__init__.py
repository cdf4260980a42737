"""Modules that are identical in the Kandinsky 6 generation DiT and the Kandinsky 6 SR DiT.

Only code whose math and parameter names match in both diffusers transformers lives here (diffusers
marks the SR copies `# Copied from ...transformer_kandinsky6`). The attention projection module is
not shared: the two DiTs apply the QK RMSNorm in different dtypes.
"""
