"""The start-up LoRA flags checked before the model loads, which takes minutes for a real checkpoint.

The worker applies `--lora-path` only once every weight is loaded, so a typo in the path, a damaged file or an
adapter trained for another model failed after the whole load. Here the adapter file is read (and a hub id
fetched) first, and, where the DiT's config is on disk already (a local folder, the demo, `--load-format dummy`),
its modules and shapes are matched against the DiT built on the meta device (no memory, well under a second for
Pro). The worker checks everything again; this only moves the refusal earlier.
"""

from __future__ import annotations


from k6serve.config import EngineConfig, ModelConfig
from k6serve.lora.spec import (
    check_lora_alpha,
    check_lora_strength,
    is_finite_number,
    odd_nickname,
    quantized_lora_refusal,
    resolve_merge_mode,
)


def check_start_adapter(config: EngineConfig) -> None:
    """Refuse, before loading, a `--lora-path` adapter the worker would refuse after loading, and a --lora-scale /
    --lora-alpha that would make every request fail on NaN latents (not finite, or past `MAX_LORA_STRENGTH` /
    `MAX_LORA_ALPHA`) or an odd --lora-nickname; a ValueError with the fix."""
    model = config.model
    if not model.lora_path:
        return
    for flag, value in (("--lora-scale", model.lora_scale), ("--lora-alpha", model.lora_alpha)):
        if value is not None and not is_finite_number(value):
            raise ValueError(f"{flag} must be a finite number, got {value}.")
    check_lora_strength(model.lora_scale, "--lora-scale")
    if model.lora_alpha is not None:
        check_lora_alpha(model.lora_alpha, "--lora-alpha")
    if odd_nickname(model.lora_nickname):
        raise ValueError(f"--lora-nickname {odd_nickname(model.lora_nickname)}")
    from k6serve.lora.adapter import read_adapter

    dit_config = _dit_config_before_loading(model)
    adapter = read_adapter(model.lora_path)
    if dit_config is not None:
        import torch

        from k6serve.lora.targets import check_mergeable, resolve_targets
        from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer

        dit = build_dummy_transformer(dit_config, device=torch.device("meta"), dtype=torch.float32)
        targets = resolve_targets(dit, adapter.modules, source=model.lora_path)
        if resolve_merge_mode(model.lora_merge_mode, fsdp=config.parallel.use_fsdp_inference) == "merge":
            check_mergeable(targets, adapter.modules, source=model.lora_path)


def check_request_loras(config: EngineConfig, loras: dict | None) -> None:
    """`k6serve generate --loras`: the one engine holds only the --lora-path adapter, and a request's adapters are
    added dynamically, so anything else fails after the load; refused now with the flags that fix it."""
    model = config.model
    if loras is None or _is_super_resolution(_local_variant(model)[0]):
        return  # the request's own checks refuse --loras for super-resolution, in its words
    if model.quantization != "none":
        if loras:  # ({} is the base model, all a quantized DiT runs)
            raise ValueError("--loras names LoRA adapters, but " + quantized_lora_refusal(
                model.quantization, subject="the DiT", fix="Drop --loras, or --quantization."))
        return
    loaded = [model.lora_nickname] if model.lora_path else []
    unknown = [nickname for nickname in loras if nickname not in loaded]
    if unknown:
        have = (f"only the --lora-path adapter, named {model.lora_nickname!r} (--lora-nickname)" if loaded else
                "no adapter: no --lora-path was given")
        raise ValueError(f"--loras names LoRA adapter(s) {unknown}, but this run loads {have}; pass --lora-path "
                         "FILE --lora-nickname NAME --lora-merge-mode dynamic and name NAME in --loras, or drop "
                         "--loras (--lora-scale sets the --lora-path adapter's strength).")
    if loaded and resolve_merge_mode(model.lora_merge_mode, fsdp=config.parallel.use_fsdp_inference) == "merge":
        raise ValueError(f"--loras adds its adapters dynamically for the request, but --lora-merge-mode "
                         f"{model.lora_merge_mode} merges the --lora-path adapter into the weights; pass "
                         "--lora-merge-mode dynamic, or drop --loras (--lora-scale sets the adapter's strength).")


def _local_variant(model: ModelConfig):
    """(the checkpoint's variant, its local folder) where that needs no download, as the CLI's request check reads
    it; the variant is None when it cannot be told now (the worker then says what is wrong, as without this)."""
    from k6serve.models.checkpoint_files import variant_before_loading

    return variant_before_loading(model.model_path, model.model_id, model.load_format)


def _is_super_resolution(variant) -> bool:
    from k6serve.models.variants import GENERATION

    return variant is not None and variant.family != GENERATION


def _dit_config_before_loading(model: ModelConfig) -> dict | None:
    """The generation DiT's config.json where it needs no download: a local folder, the demo, or the released
    config under --load-format dummy; None otherwise (the worker checks the adapter after loading). A
    super-resolution checkpoint, which takes no LoRA, is refused."""
    from k6serve.models.checkpoint_files import read_json_file

    variant, folder = _local_variant(model)
    if _is_super_resolution(variant):
        raise ValueError(f"--lora-path: LoRA adapters apply to the Kandinsky 6 generation DiT; {variant.name} is a "
                         "super-resolution model, which takes none. Drop --lora-path, or pass a generation "
                         "checkpoint as --model-path.")
    if variant is None:
        return None
    try:
        if model.load_format == "dummy":
            from k6serve.models.kandinsky6.config_before_loading import released_transformer_config

            return released_transformer_config(variant)
        return None if folder is None else read_json_file(folder / "transformer" / "config.json")
    except (OSError, ValueError):
        return None
