"""Load-time check that the SR transformer head fits the scheduler (k6-super-resolution.md §3).

A π-Flow (DX) checkpoint needs an `n_grid * C` wide head (640), a flow-matching checkpoint a `C` wide head (64).
The tested non-distilled revision d6ddfabc... pairs a flow-Euler scheduler with a 640-wide head; diffusers only fails
after the whole-clip encode, the LU and a DiT call, with an opaque broadcast error. This check reads configs and
safetensors headers only, so it fails before any weight is loaded or any pixel is encoded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from safetensors import safe_open

from k6serve.models.checkpoint_files import CheckpointError, safetensors_files
from k6serve.models.kandinsky6_sr.config import SRSchedulerConfig, SRTransformerConfig
from k6serve.models.kandinsky6_sr.released_configs import DISTILLED_REPO, KNOWN_BAD_FLOW_REVISION

HEAD_WEIGHT = "out_layer.out_layer.weight"
INPUT_WEIGHT = "visual_embeddings.in_layer.weight"
_CONDITIONED_INSTRUCT_TYPES = ("channel", "hybrid", "hybrid_anchor")


def _mismatch(detail: str) -> ValueError:
    return ValueError(
        f"Kandinsky 6 SR checkpoint mismatch: {detail}. The scheduler and the transformer come from different "
        f"repositories or revisions (the Kandinsky-6.0-VSR-5s-Diffusers revision {KNOWN_BAD_FLOW_REVISION} is "
        "known to declare a flow-Euler scheduler next to a 640-wide head). Do not change the scheduler to get "
        f"past this error; use {DISTILLED_REPO}."
    )


def check_head_fits_scheduler(
    transformer: SRTransformerConfig,
    scheduler: SRSchedulerConfig,
    tensor_shapes: Mapping[str, Sequence[int]],
) -> None:
    """Raise ValueError unless head width, config and scheduler agree; `tensor_shapes` maps weight names to shapes."""
    head_rows = int(tensor_shapes[HEAD_WEIGHT][0])
    if head_rows != transformer.out_visual_dim:
        raise _mismatch(
            f"transformer {HEAD_WEIGHT} has {head_rows} rows but config.json says out_visual_dim "
            f"{transformer.out_visual_dim}"
        )
    channels = transformer.in_visual_dim
    if scheduler.is_piflow:
        if scheduler.n_grid is None:
            raise ValueError("a PiflowScheduler config needs n_grid (scheduler/scheduler_config.json)")
        expected = scheduler.n_grid * channels
        rule = f"PiflowScheduler with n_grid {scheduler.n_grid} needs n_grid * in_visual_dim = {expected}"
    else:
        expected = channels
        rule = f"{scheduler.class_name} needs a plain head of in_visual_dim = {expected}"
    if head_rows != expected:
        raise _mismatch(f"the transformer head is {head_rows} wide but {rule}")
    if transformer.visual_cond or transformer.instruct_type in _CONDITIONED_INSTRUCT_TYPES:
        input_width = int(tensor_shapes[INPUT_WEIGHT][1])
        if input_width != transformer.in_channels:
            raise ValueError(
                f"transformer {INPUT_WEIGHT} takes {input_width} channels, expected 2 * in_visual_dim + 1 = "
                f"{transformer.in_channels}; the weights do not match transformer/config.json."
            )


def read_tensor_shapes(component_dir: Path, names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Shapes of the named tensors from safetensors headers (no tensor data is read)."""
    # The files the load reads (`safetensors_files`: an index's shards, the standard file, or the one file of
    # another name); a tensor no file holds is named, not a KeyError.
    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(component_dir):
        with safe_open(path, framework="pt") as handle:
            for name in set(names) & set(handle.keys()) - shapes.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    missing = [name for name in names if name not in shapes]
    if missing:
        raise CheckpointError(f"{component_dir}'s weights hold no tensor {missing}; copy or download the checkpoint "
                              "again.")
    return {name: shapes[name] for name in names}


def check_sr_checkpoint(model_dir: str | Path) -> tuple[SRTransformerConfig, SRSchedulerConfig]:
    """Read transformer and scheduler configs of an SR checkpoint and check they fit; returns both configs."""
    model_dir = Path(model_dir)
    transformer = SRTransformerConfig.from_json_file(model_dir / "transformer" / "config.json")
    scheduler = SRSchedulerConfig.from_json_file(model_dir / "scheduler" / "scheduler_config.json")
    shapes = read_tensor_shapes(model_dir / "transformer", [HEAD_WEIGHT, INPUT_WEIGHT])
    check_head_fits_scheduler(transformer, scheduler, shapes)
    return transformer, scheduler
