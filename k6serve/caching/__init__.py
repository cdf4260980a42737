"""Cache-DiT step caching for the generation DiT, applied from outside the model (style.md rule 3).

A lossy, opt-in acceleration: on some denoising steps the middle fused blocks are skipped and their residual from
the last computed step (or a TaylorSeer forecast of it) is added instead. Semantics follow vipshop/cache-dit 1.5.3
(DBCache with Fn/Bn compute blocks, warmup, residual-diff threshold, cached-step limits, TaylorSeer, step
computation masks), the library the reference server uses (serving-reference.md §4.12), so its `cache_dit_params`
mean the same here.

`params.py` holds the torch-free request parameters and the step masks; `block_cache.py` the per-request state
and the block runner that the model's fused-block stack delegates to while a request has caching on; `preflight.py`
checks the settings against the DiT's block count before the model loads.
"""
