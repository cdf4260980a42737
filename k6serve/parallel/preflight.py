"""The parallel layout checked before the model loads, which takes minutes on every rank for a real checkpoint.

The ranks validate the layout against the models they loaded (`parallelize.parallelize_model`), so FSDP on a
replica of one GPU, a degree that does not divide the heads, CFG-parallel for a model without a guidance branch or
`--encoder-parallel fold` over counts that do not divide was refused only after every rank had loaded the whole
checkpoint. Here the same rules run first, on the configs where they need no download (a local folder, the demo, a
released checkpoint's built-in configs). The ranks check again; this only moves the refusal earlier.
"""

from __future__ import annotations

from pathlib import Path

from k6serve.config import EngineConfig
from k6serve.parallel.mesh import ParallelLayout, validate_degrees, validate_layout


def check_layout_before_loading(config: EngineConfig) -> None:
    """Raise the ValueError the ranks would raise after loading, where the model can be told without a download."""
    layout = ParallelLayout.from_config(config.parallel)
    validate_degrees(layout)
    if layout.replica_size == 1 and config.parallel.encoder_parallel != "fold":
        return  # one rank per replica: nothing else to divide
    from k6serve.models.checkpoint_files import CheckpointError, variant_before_loading
    from k6serve.models.variants import GENERATION

    model = config.model
    variant, folder = variant_before_loading(model.model_path, model.model_id, model.load_format)
    if variant is None:
        return  # the ranks recognise it once downloaded, and check then
    folder = None if model.load_format == "dummy" else folder
    generation = variant.family == GENERATION
    try:
        plan = _generation_plan(variant, folder) if generation else _sr_plan(variant, folder)
    except (OSError, KeyError, CheckpointError):
        return  # a component missing from the folder: the ranks' load says which, as without this check
    validate_layout(layout, plan, model_name=variant.name, has_guidance=generation and not variant.distilled)
    if generation and config.parallel.encoder_parallel == "fold":  # auto never refuses: it replicates instead
        from k6serve.parallel.encoder_folding import should_fold

        try:
            encoders = _text_encoder_configs(folder)
        except (OSError, KeyError):
            return
        should_fold("fold", layout, encoders)


def _generation_plan(variant, folder: Path | None):
    from k6serve.models.kandinsky6.config_before_loading import transformer_config_before_loading
    from k6serve.models.kandinsky6.plan import kandinsky6_plan

    return kandinsky6_plan(transformer_config_before_loading(variant, folder))


def _sr_plan(variant, folder: Path | None):
    from k6serve.models.kandinsky6_sr.config_before_loading import released_sr_configs
    from k6serve.models.kandinsky6_sr.config import SRTransformerConfig
    from k6serve.models.kandinsky6_sr.plan import sr_plan

    return sr_plan(SRTransformerConfig.from_json_file(folder / "transformer" / "config.json") if folder
                   else released_sr_configs(variant).transformer)


def _text_encoder_configs(folder: Path | None) -> list[tuple[str, object]]:
    """(class name, transformers config) of both text encoders: the folder's, or the released ones (as the dummy
    load builds them)."""
    import transformers

    if folder is None:
        from k6serve.models.kandinsky6 import encoder_configs

        return [("Qwen2_5_VLForConditionalGeneration", transformers.Qwen2_5_VLConfig(**encoder_configs.QWEN25_VL_7B)),
                ("CLIPTextModel", transformers.CLIPTextConfig(**encoder_configs.CLIP_VIT_L14_TEXT))]
    from k6serve.models.checkpoint_files import read_json_file

    index = read_json_file(folder / "model_index.json")
    # The classes the loader builds (models/kandinsky6/checkpoint.py), not AutoConfig: a config.json with an
    # `auto_map` made AutoConfig ask on the terminal whether to run the folder's own Python code, and run it on "y".
    classes: dict[str, type[transformers.PreTrainedConfig]] = {
        "text_encoder": transformers.Qwen2_5_VLConfig, "text_encoder_2": transformers.CLIPTextConfig}
    return [(index[name][1], config_class.from_pretrained(str(folder / name)))
            for name, config_class in classes.items()]
