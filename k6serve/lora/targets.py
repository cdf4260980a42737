"""Where an adapter's module path lands in the model: a Linear, and which of its output rows.

Adapter files name diffusers' modules (`...attn.to_key`). After `--performance-mode speed` fuses the projections
(speed/fused_projections.py), `to_query` / `to_key` / `to_value` are row blocks of one `to_query_key_value` Linear
([q; k; v]) and `to_key` / `to_value` of `to_key_value` ([k; v]), so such a path resolves to the fused Linear and
its rows. The mapping is data (`FUSED_PROJECTIONS`), not an import of the fusing code, so this file depends on no
speed transform.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from k6serve.lora.adapter import LoraModule
from k6serve.lora.dynamic import LoraLinear
from k6serve.lora.sharding import ShardedWeight

# fused Linear name -> the projections it stacks, in row order; each part has out_features / len(parts) rows.
FUSED_PROJECTIONS = {
    "to_query_key_value": ("to_query", "to_key", "to_value"),
    "to_key_value": ("to_key", "to_value"),
}
_SHOWN = 5


@dataclass(frozen=True, eq=False, slots=True)
class LoraTarget:
    """The Linear a module path resolves to, the parent attribute holding it, and the rows its update adds to."""

    path: str  # as in the adapter file
    linear: nn.Linear
    parent: nn.Module
    attribute: str  # parent.<attribute> is `linear`
    rows: slice  # all rows, or the projection's block of a fused Linear

    @property
    def is_fused_slice(self) -> bool:
        return (self.rows.stop - self.rows.start) != self.linear.out_features


def _linear(module: object) -> nn.Linear | None:
    # Seen through a dynamic wrapper, so targets resolve the same while adapters are active.
    module = module.base if isinstance(module, LoraLinear) else module
    return module if isinstance(module, nn.Linear) else None


def _resolve(model: nn.Module, path: str) -> LoraTarget | None:
    parent_path, _, name = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
    except AttributeError:
        return None
    child = _linear(getattr(parent, name, None))
    if child is not None:
        return LoraTarget(path, child, parent, name, slice(0, child.out_features))
    for fused_name, parts in FUSED_PROJECTIONS.items():
        fused = _linear(getattr(parent, fused_name, None))
        if fused is not None and name in parts:
            size = fused.out_features // len(parts)
            start = parts.index(name) * size
            return LoraTarget(path, fused, parent, fused_name, slice(start, start + size))
    return None


def linear_names(model: nn.Module) -> list[str]:
    """Every Linear path an adapter may name (fused projections listed under their diffusers names)."""
    names = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parent_path, _, name = path.rpartition(".")
        prefix = f"{parent_path}." if parent_path else ""
        names.extend(prefix + part for part in FUSED_PROJECTIONS.get(name, (name,)))
    return names


def check_sharding(linear: nn.Linear, path: str) -> None:
    """Refuse a weight sharded in a way LoRA cannot follow (more than one dimension or mesh axis)."""
    try:
        ShardedWeight.of(linear)
    except ValueError as exc:
        raise ValueError(f"LoRA cannot be applied to {path!r}: {exc}") from None


def _flattened_names(model: nn.Module) -> dict[str, str | None]:
    """kohya's flattened module name ("." -> "_") -> the Linear path; None where two paths flatten alike (our names
    hold "_" too, so a flattened name could be ambiguous: such a key is refused, not guessed)."""
    flattened: dict[str, str | None] = {}
    for name in linear_names(model):
        key = name.replace(".", "_")
        flattened[key] = None if key in flattened and flattened[key] != name else name
    return flattened


def resolve_targets(model: nn.Module, modules: dict[str, LoraModule], *, source: str) -> list[LoraTarget]:
    """The target of every module of an adapter, with its shapes checked against the model's Linear."""
    targets, unknown = [], []
    flattened: dict[str, str | None] | None = None
    for path in modules:
        target = _resolve(model, path)
        if target is None and "." not in path:  # a kohya key's flattened path
            flattened = _flattened_names(model) if flattened is None else flattened
            dotted = flattened.get(path)
            if dotted is not None:
                found = _resolve(model, dotted)
                target = None if found is None else LoraTarget(path, found.linear, found.parent, found.attribute,
                                                               found.rows)
        if target is None:
            unknown.append(path)
        else:
            targets.append(target)
    # "LoRA path": the adapter file is what does not fit, so the HTTP answer names lora_path (`names_adapter_file`).
    if unknown:
        valid = linear_names(model)
        hint = " (all of them: an adapter for another model?)" if len(unknown) == len(modules) else ""
        raise ValueError(f"LoRA path {source!r}: {len(unknown)} of its {len(modules)} module(s) are not Linear layers "
                         f"of the {type(model).__name__}{hint}, e.g. {sorted(unknown)[:_SHOWN]}; the model's Linear "
                         f"layers are named like {valid[:_SHOWN]} ({len(valid)} in all)")
    for target in targets:
        check_sharding(target.linear, target.path)
        module = modules[target.path]
        expected = (target.rows.stop - target.rows.start, target.linear.in_features)
        if module.down.shape[1] != expected[1] or module.up.shape[0] != expected[0]:
            raise ValueError(f"LoRA path {source!r}: module {target.path!r} has lora_A {tuple(module.down.shape)} and "
                             f"lora_B {tuple(module.up.shape)}, but the model's layer maps {expected[1]} -> "
                             f"{expected[0]} features (lora_A must be (rank, {expected[1]}), lora_B "
                             f"({expected[0]}, rank)): the adapter was trained for another model or model size")
    return targets
