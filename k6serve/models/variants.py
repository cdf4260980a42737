"""Known Kandinsky 6 checkpoints: recognition by id or model_index.json, and per-variant request defaults.

Recognition follows the reference serving system: the id is normalised (lower case, '-', '_', '.' and '/'
removed) and matched against the released names. A folder (local, or a hub id's download) is what its
`model_index.json` and configs say (pipeline class, scheduler class, transformer width), the name only choosing
among releases with the same files; `--model-id` names a renamed folder's release. What a request resolves to on
a variant (its defaults filled, its fields checked) is `k6serve/request_resolution.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from k6serve.testing.demo_location import DEMO_MODEL_PATHS

logger = logging.getLogger(__name__)

GENERATION = "generation"
SUPER_RESOLUTION = "super_resolution"
DEMO_MARKER = "k6serve_demo.json"


DEFAULT_SEED = 42  # every variant's: a request without a seed runs with it


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    name: str  # e.g. "pro-distill"
    family: str  # GENERATION | SUPER_RESOLUTION
    hub_id: str | None
    size: str  # "pro" | "lite" | "sr" | "demo"
    distilled: bool
    num_inference_steps: int
    guidance_scale: float
    height: int = 512
    width: int = 768
    num_frames: int = 121
    fps: float = 24.0
    seed: int = DEFAULT_SEED
    is_demo: bool = False


def _gen(name: str, size: str, distilled: bool) -> Variant:
    title = name[0].upper() + name[1:]  # released ids: Pro-distill, Pro-sft, Lite-pretrain
    return Variant(
        name=name,
        family=GENERATION,
        hub_id=f"kandinskylab/Kandinsky-6.0-{title}-5s-Diffusers",
        size=size,
        distilled=distilled,
        num_inference_steps=10 if distilled else 50,
        guidance_scale=1.0 if distilled else 5.0,
    )


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        _gen("pro", "pro", False),
        _gen("pro-sft", "pro", False),
        _gen("pro-pretrain", "pro", False),
        _gen("pro-distill", "pro", True),
        _gen("lite", "lite", False),
        _gen("lite-pretrain", "lite", False),
        _gen("lite-distill", "lite", True),
        Variant(
            name="vsr-distilled2steps",
            family=SUPER_RESOLUTION,
            hub_id="kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers",
            size="sr",
            distilled=True,
            num_inference_steps=2,
            guidance_scale=1.0,
        ),
        Variant(
            name="vsr",
            family=SUPER_RESOLUTION,
            hub_id="kandinskylab/Kandinsky-6.0-VSR-5s-Diffusers",
            size="sr",
            distilled=False,
            num_inference_steps=2,
            guidance_scale=1.0,
        ),
    )
}

# About how many parameters the released checkpoints' models hold, by `Variant.size`: the generation DiTs' as built
# on the meta device (tests/unit/test_dummy_load.py checks them), the SR model's and the text encoders' (Qwen2.5-VL
# 7B and CLIP, which every generation model loads) as counted once on the meta device from their released configs.
# For a refusal's "about N GiB" (runtime/device_fit.py), not for planning memory.
RELEASED_NUM_PARAMETERS = {"pro": 30.1e9, "lite": 3.2e9, "sr": 6.8e9}
TEXT_ENCODERS_NUM_PARAMETERS = 8.3e9


def normalise_id(model_id: str) -> str:
    return re.sub(r"[-_./\s]", "", model_id.lower())


def variant_from_id(model_id: str) -> Variant | None:
    """Match a hub id or folder name against the released checkpoints; None if it names none of them."""
    norm = normalise_id(Path(model_id).name if "/" not in model_id.strip("/") else model_id)
    if "kandinsky6" not in norm and "kandinsky60" not in norm:
        return None
    # "distil" (the British spelling, or "distill" mistyped) is matched too: `Pro-distil` was read as non-distilled
    # Pro, which --load-format dummy built and ran with CFG and 50 steps without a word.
    if re.search(r"kandinsky6(0)?(vsr|sr|superres)", norm):
        return VARIANTS["vsr-distilled2steps" if "distil" in norm else "vsr"]
    size = "lite" if "lite" in norm else "pro" if "pro" in norm else None
    if size is None:
        return None
    if "distil" in norm:
        return VARIANTS[f"{size}-distill"]
    if "pretrain" in norm:
        return VARIANTS[f"{size}-pretrain"]
    if "sft" in norm and size == "pro":
        return VARIANTS["pro-sft"]
    return VARIANTS[size]


def variant_from_folder(folder: Path) -> Variant:
    """Route a local Diffusers folder by what its files say."""
    from k6serve.models.checkpoint_files import index_class, model_index_nearby, read_json_file  # imports torch

    marker = folder / DEMO_MARKER
    if marker.is_file():
        return demo_variant(read_json_file(marker))
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise ValueError(
            f"{folder} has no model_index.json, so it is not a Diffusers-format Kandinsky 6 checkpoint."
            + (model_index_nearby(folder) or " Pass the folder that holds model_index.json (e.g. a download of "
               "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers).")
        )
    index = read_json_file(index_path)
    pipeline_class = index.get("_class_name", "")
    scheduler_class = index_class(index, "scheduler", index_path)
    if pipeline_class == "Kandinsky6SRPipeline":
        return VARIANTS["vsr-distilled2steps" if scheduler_class == "PiflowScheduler" else "vsr"]
    if pipeline_class != "Kandinsky6TI2VAPipeline":
        raise ValueError(
            f"{index_path} names pipeline {pipeline_class!r}; k6serve serves Kandinsky6TI2VAPipeline "
            "(generation) and Kandinsky6SRPipeline (super-resolution) checkpoints. If this is a renamed "
            "Kandinsky 6 folder, pass --model-id with the original name."
        )
    distilled = scheduler_class == "PiflowScheduler"
    config_path = folder / "transformer" / "config.json"
    model_dim = read_json_file(config_path).get("model_dim") if config_path.is_file() else None
    size = "lite" if model_dim == 1792 else "pro"
    return VARIANTS[f"{size}-distill" if distilled else size]


def demo_variant(marker: dict) -> Variant:
    if marker.get("variant") == "sr":  # `demo-sr`: the distilled VSR's defaults (x2.25, 2 steps per tile)
        return dataclasses.replace(VARIANTS["vsr-distilled2steps"], name="demo-sr", hub_id=None, is_demo=True)
    defaults = marker.get("defaults", {})
    distilled = marker.get("variant", "distill") == "distill"
    return Variant(
        # Messages name the model by this: the built-in distilled demo is `demo`, the name the user typed (it was
        # "demo-distill", which --model-path refuses); a test checkpoint of another kind keeps its suffix.
        name="demo" if distilled else f"demo-{marker.get('variant')}",
        family=GENERATION,
        hub_id=None,
        size="demo",
        distilled=distilled,
        num_inference_steps=10 if distilled else 50,
        guidance_scale=1.0 if distilled else 5.0,
        height=int(defaults.get("height", 64)),
        width=int(defaults.get("width", 96)),
        num_frames=int(defaults.get("num_frames", 17)),
        fps=float(defaults.get("fps", 24)),
        is_demo=True,
    )


def recognise(model_path: str, model_id: str | None, local_folder: Path | None) -> Variant:
    """Pick the variant: --model-id wins; then a folder's own files (a local folder, or a hub id's download), with
    the path's name choosing among the releases the files cannot tell apart (Pro, Pro-sft, Pro-pretrain); then, with
    no folder to read (--load-format dummy) or none that names its pipeline, the path's name alone."""
    if model_id:
        variant = variant_from_id(model_id)
        if variant is None:
            raise ValueError(
                f"--model-id {model_id!r} names no known Kandinsky 6 checkpoint. Known ids: "
                + ", ".join(v.hub_id for v in VARIANTS.values() if v.hub_id)
            )
        if local_folder is not None:
            _check_model_id_fits_folder(model_id, variant, local_folder)
        return variant
    if local_folder is not None and (local_folder / DEMO_MARKER).is_file():
        return variant_from_folder(local_folder)
    if local_folder is None and model_path in DEMO_MODEL_PATHS:
        # Only --load-format dummy leaves the demo's folder unread; it was told to pass --model-id, as an unknown
        # name is, where the fix is to drop the flag.
        raise ValueError(f"--load-format dummy builds a released model at its full size with random weights, and "
                         f"{model_path!r} names none: it is a tiny random-weight checkpoint already. Drop "
                         "--load-format dummy (or, for a released model's size, pass --model-id with its name).")
    named = variant_from_id(model_path)
    if local_folder is None or (named is not None and not (local_folder / "model_index.json").is_file()):
        if named is not None:
            return named
        raise ValueError(
            f"Cannot tell which Kandinsky 6 model {model_path!r} is. Pass --model-id with the released name, "
            "e.g. --model-id Kandinsky-6.0-Pro-distill-5s-Diffusers."
        )
    try:
        found = variant_from_folder(local_folder)
    except ValueError:
        if named is None:
            raise
        return named  # its files name no Kandinsky 6 pipeline: the name routes it, as --model-id would
    if named is None or _kind(named, local_folder) == _kind(found, local_folder):
        return named or found
    # The name is matched anywhere in the path, parent folders included (a hub cache's snapshot folder is named by
    # its commit; its repo's name is two levels up): "/data/projects/kandinsky6/run1" read as Pro, and a distilled
    # checkpoint in a folder named "...-Pro-5s-Diffusers (copy)" ran CFG and 50 steps, 5x the work, with no word.
    # The files say what the checkpoint is; the name only labels it. Said when the folder's own name is a release's
    # (a word of a parent folder, "projects", is no claim), once per process: each check of the request recognises.
    own_name = variant_from_id(local_folder.name)
    if own_name is not None and _kind(own_name, local_folder) != _kind(found, local_folder) \
            and str(local_folder) not in _WARNED_NAMES:
        _WARNED_NAMES.add(str(local_folder))
        logger.warning("%s is named as %s, but its model_index.json and transformer config say %s; serving it as "
                       "%s (pass --model-id to name the checkpoint explicitly).", local_folder.name, own_name.name,
                       found.name, found.name)
    return found


_WARNED_NAMES: set[str] = set()


def _kind(variant: Variant, folder: Path | None = None) -> tuple:
    """What a checkpoint's files tell (family, distilled, Pro or Lite), to compare a name's guess with them; the
    size only where the folder has a transformer config to read it from (`variant_from_folder` guesses Pro)."""
    if folder is not None and not (folder / "transformer" / "config.json").is_file():
        return variant.family, variant.distilled
    return variant.family, variant.distilled, variant.size


def _check_model_id_fits_folder(model_id: str, variant: Variant, folder: Path) -> None:
    """--model-id routes a renamed folder and wins over the guess from its transformer's width (Pro or Lite), but
    not over what its model_index.json states: a super-resolution pipeline is not a generation one, and a PiFlow
    scheduler marks a distilled checkpoint. A contradiction would fail later as a missing component ("re-download
    the repository") or, distilled against not, run CFG and 50 steps on a 10-step model without a word."""
    try:
        found = variant_from_folder(folder)
    except ValueError:
        return  # the folder's files name no Kandinsky 6 pipeline: --model-id is what routes it
    if (found.family, found.distilled) == (variant.family, variant.distilled):
        return

    def kind(v: Variant) -> str:
        if v.family == SUPER_RESOLUTION:
            return "a super-resolution checkpoint"
        return f"a {'distilled ' if v.distilled else 'non-distilled '}generation checkpoint"

    raise ValueError(
        f"--model-id {model_id!r} names {variant.name}, {kind(variant)}, but {folder} is {kind(found)} by its "
        f"model_index.json (recognised as {found.name}); drop --model-id, or pass the name of the checkpoint "
        "this folder holds."
    )
