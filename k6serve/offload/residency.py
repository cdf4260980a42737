"""Where each component's weights live: the residency plan, as data, from the performance mode and the seed's flags.

Three residencies (the reference's names, serving-reference.md §4.9):
- "resident": on the GPU for the life of the worker (the speed transforms apply to it);
- "component": in page-locked host memory, copied whole to the GPU for its stage (`components.py`; the speed
  transforms apply to it too, built on the host weights before they are offloaded: speed/performance_mode.py);
- "layerwise": in host memory, its repeated blocks streamed one at a time during its stage (`block_stream.py`;
  eager in every mode).

The mode gives the defaults (speed: all resident; balanced: all "component"; memory: the DiT and the text encoders
"layerwise", the rest "component"); `--cpu-offload-components`, then `--layerwise-offload-components`, then
`--component-residency NAME=MODE` (the reference's highest-priority setting, also the way to keep a component resident
under balanced or memory) override them per component, as the seed's recipes do ("--cpu-offload-components transformer
text_encoder vae", "--layerwise-offload-components all", SR's "vae latent_upscaler").

Only the DiT and the text encoders have repeated blocks that streaming pays for. The VAEs, the vocoder and the SR
latent upscaler are asked for "layerwise" by the seed's `all`; they are offloaded whole instead, and the plan says so:
their weights (under 1 GiB each, the upscaler bank's used part 1.5 GB) are small next to their activations, and a
decode runs them per tile, so streaming their layers would copy each again per tile for no lower peak.

Names are the checkpoint's component keys (model_index.json): generation `text_encoder` (Qwen2.5-VL),
`text_encoder_2` (CLIP), `transformer`, `vae`, `audio_vae`, `vocoder`; super-resolution `transformer`, `vae`,
`latent_upscaler`. Also: `dit` (another name of transformer), and the groups `all`, `none`, `text_encoders`,
`audio` (audio_vae + vocoder) and `default` (the reference's layerwise default: the encoders and the VAEs, all but
the DiT).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

RESIDENT, COMPONENT, LAYERWISE = "resident", "component", "layerwise"

# Per family, the checkpoint's component keys, which are also the pipeline's names (`pipeline.components()`).
GENERATION_COMPONENTS = ("text_encoder", "text_encoder_2", "transformer", "vae", "audio_vae", "vocoder")
SUPER_RESOLUTION_COMPONENTS = ("transformer", "vae", "latent_upscaler")
GROUPS = {"text_encoders": ("text_encoder", "text_encoder_2"), "audio": ("audio_vae", "vocoder"),
          # the reference's "default" layerwise set: the encoders and the VAEs (everything but the DiT)
          "default": ("text_encoder", "text_encoder_2", "vae", "audio_vae", "vocoder")}
# Another name for one component: read as that name everywhere (so "dit" and "transformer" are one setting).
ALIASES = {"dit": "transformer"}
SPECIAL = ("all", "none")
OFFLOAD_COMPONENT_NAMES = tuple(dict.fromkeys([*SPECIAL, *GENERATION_COMPONENTS, *SUPER_RESOLUTION_COMPONENTS,
                                                *ALIASES, *GROUPS]))
# The pipeline components whose repeated blocks are streamed ("layerwise"); every other one is offloaded whole.
STREAMABLE = ("transformer", "text_encoder", "text_encoder_2")


def family_components(super_resolution: bool) -> tuple[str, ...]:
    return SUPER_RESOLUTION_COMPONENTS if super_resolution else GENERATION_COMPONENTS


def _split_items(value: object) -> list[str] | None:
    """Items separated by spaces or commas, in one string or a list of strings; None for any other value."""
    if isinstance(value, str):
        return value.replace(",", " ").split()
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return [part for item in value for part in item.replace(",", " ").split()]
    return None


def normalise_component_names(value: object, flag: str) -> tuple[str, ...]:
    """A flag's value as a tuple of known names: a list from the CLI (nargs) or a --config file, or one string with
    names separated by spaces or commas (the API, a --config file). Unknown names are refused with the list."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return ()
    items = _split_items(value)
    if items is None:
        raise ValueError(f"{flag} takes component names (e.g. {flag} text_encoder vae), got {value!r}")
    if not items:
        raise ValueError(f"{flag} was given no component name (got {value!r}); name at least one, or leave the flag "
                         "out.")
    # The names keep the user's spelling (`dit` stays `dit`, so messages and logs echo what was typed); an alias
    # is read as its component where the plan is made (`_expand`), and a name given twice is kept once.
    spellings: dict[str, str] = {}  # component -> the name as given
    for name in (item.strip().lower() for item in items):
        spellings.setdefault(ALIASES.get(name, name), name)
    names = tuple(spellings.values())
    unknown = [name for name in names if name not in OFFLOAD_COMPONENT_NAMES]
    if unknown:
        raise ValueError(f"{flag}: unknown component {', '.join(map(repr, unknown))}. Known: "
                         f"{', '.join(OFFLOAD_COMPONENT_NAMES)}.")
    if "none" in names and len(names) > 1:
        raise ValueError(f"{flag} none cannot be combined with other names ({' '.join(names)}); give one or the other.")
    return names


# `--component-residency NAME=MODE`: the reference's mode names and the short ones of this plan.
RESIDENCY_NAMES = {"resident": RESIDENT, "component_offload": COMPONENT, "component": COMPONENT,
                   "layerwise_offload": LAYERWISE, "layerwise": LAYERWISE}


def normalise_residency_settings(value: object) -> tuple[tuple[str, str], ...]:
    """`--component-residency` as ((name, residency), ...): "vae=resident" items from the CLI or a --config list, one
    string of them, or a mapping {name: residency} from the API or a --config file."""
    flag = "--component-residency"
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return ()
    if isinstance(value, Mapping):
        items = [(str(name), str(mode)) for name, mode in value.items()]
    elif isinstance(value, (list, tuple)) and all(
            isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(part, str) for part in item)
            for item in value):
        items = [(name, mode) for name, mode in value]  # (name, mode) pairs: the API, or a config already built
    else:
        parts = _split_items(value)
        if parts is None:
            raise ValueError(f"{flag} takes NAME=MODE items (e.g. {flag} vae=resident transformer=layerwise_offload), "
                             f"got {value!r}")
        bad = [part for part in parts if part.count("=") != 1]
        if bad:
            raise ValueError(f"{flag}: {bad[0]!r} is not NAME=MODE (e.g. vae=resident).")
        if not parts:
            raise ValueError(f"{flag} was given no NAME=MODE item (got {value!r}); give at least one, or leave the "
                             "flag out.")
        items = [(name, mode) for name, _, mode in (part.partition("=") for part in parts)]  # one "=" each
    settings: dict[str, tuple[str, str]] = {}  # component -> (the name as given, residency)
    for name, mode in items:
        name, mode = name.strip().lower(), mode.strip().lower().replace("-", "_")
        if name not in OFFLOAD_COMPONENT_NAMES or name == "none":
            known = ", ".join(n for n in OFFLOAD_COMPONENT_NAMES if n != "none")
            raise ValueError(f"{flag}: unknown component {name!r}. Known: {known}.")
        if mode not in RESIDENCY_NAMES:
            raise ValueError(f"{flag} {name}={mode}: the residency must be one of {', '.join(RESIDENCY_NAMES)}.")
        component = ALIASES.get(name, name)
        if component in settings and settings[component][1] != RESIDENCY_NAMES[mode]:
            raise ValueError(f"{flag} names {component} twice, with different residencies; give it once.")
        settings.setdefault(component, (name, RESIDENCY_NAMES[mode]))
    return tuple(settings.values())


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    """Per pipeline component, its residency; `notes` says where a request was changed (layerwise -> whole)."""

    residency: Mapping[str, str]
    notes: tuple[str, ...] = ()

    def named(self, kind: str) -> tuple[str, ...]:
        return tuple(name for name, value in self.residency.items() if value == kind)

    @property
    def offloaded(self) -> frozenset[str]:
        return frozenset(name for name, value in self.residency.items() if value != RESIDENT)

    @property
    def offloaded_whole(self) -> frozenset[str]:
        """The components copied whole to the device for their stage (speed mode keeps their transforms)."""
        return frozenset(self.named(COMPONENT))

    @property
    def streamed(self) -> frozenset[str]:
        """The components whose repeated blocks are streamed (they run eager in every mode)."""
        return frozenset(self.named(LAYERWISE))

    @property
    def offloads(self) -> bool:
        return bool(self.offloaded)

    def describe(self) -> str:
        parts = [f"{kind} {', '.join(names)}" for kind in (RESIDENT, COMPONENT, LAYERWISE)
                 if (names := self.named(kind))]
        return "; ".join(parts)


def _specificity(name: str) -> int:
    """The order `--component-residency` applies its items in: all, then groups, then single components."""
    return 0 if name == "all" else 1 if name in GROUPS else 2


def _expand(names: Iterable[str], keys: tuple[str, ...], flag: str, family_name: str) -> set[str]:
    """User names -> this family's component names; a name of no component here is refused."""
    components: set[str] = set()
    for name in names:
        name = ALIASES.get(name, name)
        if name == "all":
            components |= set(keys)
        elif name in keys:
            components.add(name)
        elif name in GROUPS and any(member in keys for member in GROUPS[name]):
            components |= {member for member in GROUPS[name] if member in keys}
        elif name != "none":
            groups = "".join(f", {g}" for g, members in GROUPS.items() if any(m in keys for m in members))
            raise ValueError(f"{flag} {name}: {family_name} has no such component. Its components: "
                             f"{', '.join(keys)} (also: all, none, dit{groups}).")
    return components


def resolve_residency(mode: str, *, super_resolution: bool, present: Iterable[str] | None = None,
                      cpu_offload: tuple[str, ...] = (), layerwise: tuple[str, ...] = (),
                      settings: tuple[tuple[str, str], ...] = ()) -> ResidencyPlan:
    """The plan for a pipeline whose components are `present` (default: all of the family's; a checkpoint may lack
    the optional audio ones).

    Priority, lowest first: the mode's defaults, `cpu_offload` ("component"; `none` keeps resident what the mode
    would offload whole), `layerwise` (`none`: what the mode would stream is offloaded whole instead), `settings`
    (`--component-residency NAME=MODE`: all, then groups, then single components). A component named by both flags
    is refused (unless through `all`): each flag should say one thing per component."""
    keys = family_components(super_resolution)
    family_name = "the super-resolution model" if super_resolution else "the generation model"
    present = list(keys) if present is None else [name for name in keys if name in set(present)]
    if mode == "speed":
        residency = {name: RESIDENT for name in present}
    elif mode == "balanced":
        residency = {name: COMPONENT for name in present}
    else:  # memory
        residency = {name: LAYERWISE if name in STREAMABLE else COMPONENT for name in present}
    whole = _expand(cpu_offload, keys, "--cpu-offload-components", family_name)
    streamed = _expand(layerwise, keys, "--layerwise-offload-components", family_name)
    both = sorted(whole & streamed) if "all" not in cpu_offload and "all" not in layerwise else []
    if both:
        raise ValueError(f"{', '.join(both)} named by both --cpu-offload-components and --layerwise-offload-components;"
                         " name each component in one of them.")
    if cpu_offload == ("none",):
        residency = {name: RESIDENT if value == COMPONENT else value for name, value in residency.items()}
    if layerwise == ("none",):
        residency = {name: COMPONENT if value == LAYERWISE else value for name, value in residency.items()}
    for name in whole & set(present):
        residency[name] = COMPONENT
    for name in streamed & set(present):
        residency[name] = LAYERWISE
    # --component-residency has the last word: all first, then groups, then single components, whatever the order
    # given, so that "vae=resident all=component" keeps the VAE resident.
    for name, value in sorted(settings, key=lambda item: _specificity(item[0])):
        for component in _expand((name,), keys, "--component-residency", family_name) & set(present):
            residency[component] = value
    whole_instead = [name for name in present if residency[name] == LAYERWISE and name not in STREAMABLE]
    notes = []
    for name in whole_instead:
        residency[name] = COMPONENT
    if whole_instead:
        notes.append(f"layerwise offload: {', '.join(whole_instead)} offloaded whole for their stage "
                     "(no repeated blocks worth streaming: their weights are small next to their activations)")
    return ResidencyPlan(residency=residency, notes=tuple(notes))


def streams_text_encoder(plan: ResidencyPlan, device_type: str) -> bool:
    """Whether a generation engine with `plan` streams the text encoder's layers from host memory: the worker's
    answer (its own plan), which `resolve_generate` refuses expand_prompts under, and the one the checks before the
    load give from the config's plan (`k6serve generate`, the bench), so that refusal comes before minutes of
    loading. Only on CUDA: on the CPU nothing is offloaded."""
    return device_type == "cuda" and plan.residency.get("text_encoder") == LAYERWISE
