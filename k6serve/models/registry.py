"""Which family a built DiT belongs to, for the transforms that need its plan: the one place outside the family
folders that names the model classes, so the generic appliers (`speed`, `offload`) never do (`models/plan.py`)."""

from __future__ import annotations

from torch import nn

from k6serve.models.plan import ModelPlan


def transformer_plan(transformer: nn.Module) -> ModelPlan | None:
    """The `ModelPlan` of a k6serve DiT, or None for a model without one."""
    from k6serve.models.kandinsky6.transformer import Kandinsky6Transformer

    if isinstance(transformer, Kandinsky6Transformer):
        from k6serve.models.kandinsky6.plan import kandinsky6_plan

        return kandinsky6_plan(transformer.config)
    from k6serve.models.kandinsky6_sr.transformer import SRTransformer

    if isinstance(transformer, SRTransformer):
        from k6serve.models.kandinsky6_sr.plan import sr_plan

        return sr_plan(transformer.config)
    return None
