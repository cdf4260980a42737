"""Where an adapter's module path lands in the model: a Linear (an Embedding for lora_embedding_A / _B keys), and
which of its output rows.

Adapter files name diffusers' modules (`...attn.to_key`). After `--performance-mode speed` fuses the projections
(speed/fused_projections.py), `to_query` / `to_key` / `to_value` are row blocks of one `to_query_key_value` Linear
([q; k; v]) and `to_key` / `to_value` of `to_key_value` ([k; v]), so such a path resolves to the fused Linear and
its rows. The mapping is data (`FUSED_PROJECTIONS`), not an import of the fusing code, so this file depends on no
speed transform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor, nn

from k6serve.lora.dynamic import LoraEmbedding, LoraLinear
from k6serve.lora.sharding import ShardedWeight
from k6serve.lora.state_dict import LoraModule

# fused Linear name -> the projections it stacks, in row order; each part has out_features / len(parts) rows.
FUSED_PROJECTIONS = {
    "to_query_key_value": ("to_query", "to_key", "to_value"),
    "to_key_value": ("to_key", "to_value"),
}
_SHOWN = 5


@dataclass(frozen=True, eq=False, slots=True)
class LoraTarget:
    """The layer a module path resolves to, the parent attribute holding it, and the rows its update adds to."""

    path: str  # as in the adapter file
    layer: nn.Linear | nn.Embedding
    parent: nn.Module
    attribute: str  # parent.<attribute> is `layer`
    rows: slice  # all rows, or the projection's block of a fused Linear (rows of the Linear view, `linear_view`)

    @property
    def is_fused_slice(self) -> bool:
        return (self.rows.stop - self.rows.start) != features(self.layer)[0]


def features(layer: nn.Linear | nn.Embedding) -> tuple[int, int]:
    """(out, in) of the layer's Linear view: an Embedding is the Linear whose weight is its table transposed
    (embedding_dim x num_embeddings), as PEFT's lora_embedding_A / _B see it."""
    if isinstance(layer, nn.Embedding):
        return layer.embedding_dim, layer.num_embeddings
    return layer.out_features, layer.in_features


def linear_view(layer: nn.Linear | nn.Embedding, weight: Tensor) -> Tensor:
    """`weight` (the layer's weight or its local storage) as (out, in): an Embedding's table transposed (a view)."""
    return weight.T if isinstance(layer, nn.Embedding) else weight


_Layer = TypeVar("_Layer", bound=nn.Module)


def _unwrapped(module: object, kind: type[_Layer]) -> _Layer | None:
    # Seen through a dynamic wrapper, so targets resolve the same while adapters are active.
    module = module.base if isinstance(module, (LoraLinear, LoraEmbedding)) else module
    return module if isinstance(module, kind) else None


def _resolve(model: nn.Module, path: str, *, embedding: bool = False) -> LoraTarget | None:
    parent_path, _, name = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
    except AttributeError:
        return None
    kind: type[nn.Linear | nn.Embedding] = nn.Embedding if embedding else nn.Linear
    child = _unwrapped(getattr(parent, name, None), kind)
    if child is not None:
        return LoraTarget(path, child, parent, name, slice(0, features(child)[0]))
    if embedding:
        return None
    for fused_name, parts in FUSED_PROJECTIONS.items():
        fused = _unwrapped(getattr(parent, fused_name, None), nn.Linear)
        if fused is not None and name in parts:
            size = fused.out_features // len(parts)
            start = parts.index(name) * size
            return LoraTarget(path, fused, parent, fused_name, slice(start, start + size))
    return None


def _layer_paths(model: nn.Module, kind: type[nn.Module]) -> list[str]:
    """The paths of the model's `kind` layers, a layer inside a dynamic wrapper at the wrapper's path (the one an
    adapter names): as `<path>.base` a kohya adapter's flattened names missed every layer another adapter wrapped."""
    wrapper = LoraEmbedding if kind is nn.Embedding else LoraLinear
    modules = dict(model.named_modules())
    return [path for path, module in modules.items()
            if isinstance(module, wrapper) or isinstance(module, kind) and not (
                path.endswith(".base") and isinstance(modules.get(path[:-len(".base")]), wrapper))]


def linear_names(model: nn.Module) -> list[str]:
    """Every Linear path an adapter may name (fused projections listed under their diffusers names)."""
    names: list[str] = []
    for path in _layer_paths(model, nn.Linear):
        parent_path, _, name = path.rpartition(".")
        prefix = f"{parent_path}." if parent_path else ""
        names.extend(prefix + part for part in FUSED_PROJECTIONS.get(name, (name,)))
    return names


def embedding_names(model: nn.Module) -> list[str]:
    """Every Embedding path an adapter's lora_embedding_A / _B may name."""
    return _layer_paths(model, nn.Embedding)


def check_sharding(layer: nn.Linear | nn.Embedding, path: str) -> None:
    """Refuse a weight sharded in a way LoRA cannot follow (more than one dimension or mesh axis)."""
    try:
        ShardedWeight.of(layer)
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
    """The target of every module of an adapter, with its shapes checked against the model's layer."""
    targets, unknown = [], []
    flattened: dict[str, str | None] | None = None
    for path, module in modules.items():
        target = _resolve(model, path, embedding=module.embedding)
        if target is None and "." not in path and not module.embedding:  # a kohya key's flattened path
            flattened = _flattened_names(model) if flattened is None else flattened
            dotted = flattened.get(path)
            if dotted is not None:
                found = _resolve(model, dotted)
                target = None if found is None else LoraTarget(path, found.layer, found.parent, found.attribute,
                                                               found.rows)
        if target is None:
            unknown.append(path)
        else:
            targets.append(target)
    if unknown:
        raise _unknown_modules(model, modules, unknown, source)
    for target in targets:
        check_sharding(target.layer, target.path)
        module = modules[target.path]
        expected = (target.rows.stop - target.rows.start, features(target.layer)[1])
        if module.down.shape[1] != expected[1] or module.up.shape[0] != expected[0]:
            # "LoRA path": the adapter file is what does not fit, so the HTTP answer names lora_path
            # (`names_adapter_file`).
            factors = (f"lora_embedding_A {tuple(module.down.shape)} and lora_embedding_B {tuple(module.up.shape)}, "
                       f"but the model's embedding maps {expected[1]} ids -> {expected[0]} features "
                       f"(lora_embedding_A must be (rank, {expected[1]}), lora_embedding_B ({expected[0]}, rank))"
                       if module.embedding else
                       f"lora_A {tuple(module.down.shape)} and lora_B {tuple(module.up.shape)}, but the model's layer "
                       f"maps {expected[1]} -> {expected[0]} features (lora_A must be (rank, {expected[1]}), lora_B "
                       f"({expected[0]}, rank))")
            raise ValueError(f"LoRA path {source!r}: module {target.path!r} has {factors}: the adapter was trained "
                             "for another model or model size")
    return targets


def _unknown_modules(model: nn.Module, modules: dict[str, LoraModule], unknown: list[str],
                     source: str) -> ValueError:
    """The error for module paths the model has no layer for. diffusers' `load_lora_adapter` loads such a file,
    warns about the keys it could not place, and applies the rest; we refuse it whole. An adapter applied in part
    changes the output without anything failing (a typo'd or renamed module, an adapter for another model or
    version), and a file can be trimmed to the modules wanted where that is the intent."""
    # "LoRA path": the adapter file is what does not fit, so the HTTP answer names lora_path (`names_adapter_file`).
    hint = " (all of them: an adapter for another model?)" if len(unknown) == len(modules) else ""
    embeddings = sorted(path for path in unknown if modules[path].embedding)
    linears = sorted(path for path in unknown if not modules[path].embedding)
    parts = []
    if linears:
        valid = linear_names(model)
        parts.append(f"{len(linears)} of its {len(modules)} module(s) are not Linear layers of the "
                     f"{type(model).__name__}{hint}, e.g. {linears[:_SHOWN]}; the model's Linear layers are named "
                     f"like {valid[:_SHOWN]} ({len(valid)} in all)")
    if embeddings:
        valid = embedding_names(model)
        parts.append(f"{len(embeddings)} of its {len(modules)} module(s) have lora_embedding_A / _B keys but are not "
                     f"Embedding layers of the {type(model).__name__}{hint if not linears else ''}, e.g. "
                     f"{embeddings[:_SHOWN]}; the model's Embedding layers are {valid or 'none'} (the "
                     "visual_token_type_embeddings exist only where the config's visual_token_type_num_embeddings "
                     "is above 0)")
    return ValueError(f"LoRA path {source!r}: {'; '.join(parts)}. The whole adapter is refused rather than applied "
                      "without them (diffusers' load_lora_adapter would skip them with a warning): check that the "
                      "adapter is for this model, or remove those modules' keys from the file to apply the rest.")


MERGE_MODE_FIX = "use merge_mode 'dynamic' (--lora-merge-mode dynamic), which adds the bias at run time."


def check_mergeable(targets: list[LoraTarget], modules: dict[str, LoraModule], *, source: str,
                    fix: str = MERGE_MODE_FIX) -> None:
    """Refuse to merge a lora_B bias into a layer without a bias (PEFT's merge, so diffusers' fuse_lora, refuses it
    too); dynamic mode adds it at run time. `fix` ends the message: what to do instead."""
    no_bias = [target.path for target in targets
               if modules[target.path].bias is not None and getattr(target.layer, "bias", None) is None]
    if no_bias:
        # Not "LoRA path" (the HTTP answer would name lora_path): merge_mode is what the fix changes.
        raise ValueError(f"LoRA adapter {source!r}: {len(no_bias)} module(s) have a lora_B.bias (PEFT's lora_bias), "
                         f"but the model's layer has no bias to merge it into, e.g. {no_bias[:_SHOWN]} (diffusers' "
                         f"fuse_lora refuses these too); {fix}")
