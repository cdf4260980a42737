"""Component offload ("balanced", "memory", or per component from the plan of `residency.py`): each offloaded
pipeline component lives on the host and visits the device only for the stage that uses it; a resident one stays.

The pipelines wrap each stage in `self.residency.stage(<component names>)`. By default that is `RESIDENT`, which
does nothing (everything stays where it was loaded: "speed"). `apply_offload` replaces it with a
`ComponentOffload`, which attaches the named components' device copies on entry and points them back at the host
on exit (`host_weights.py`), so the device holds the largest single component plus activations. In "memory" mode the
DiT's repeated blocks are streamed block by block instead (`block_stream.py`); its other weights (embeddings,
modulation, output layers) are resident for the DiT stage. A streamer's resident blocks (`--offload-resident-blocks`)
are not part of their component's weights here: they stay on the device across stages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TypedDict

import torch
from torch import nn

from k6serve.config import OFFLOAD_MODES
from k6serve.offload.block_stream import BlockStreamer, apply_block_streaming, repeated_blocks
from k6serve.offload.host_weights import HostWeights, module_tensors
from k6serve.offload.residency import LAYERWISE, ResidencyPlan, resolve_residency

logger = logging.getLogger(__name__)

# Components whose repeated blocks "memory" mode streams besides the DiT's. Qwen2.5-VL-7B is 15.5 GiB in bf16, the
# largest component after the DiT: held whole for the text stage it would set the mode's peak once the DiT streams and
# the VAE decodes in tiles. Its 28 decoder layers run once per prompt on ~1,000 tokens, so the stage is bound by the
# copy either way: streaming costs nothing that moving the whole component would not. Measured on an H200 with
# Pro-distill: the text stage peaks at 3.3 GiB streamed and took 0.30 s (0.35 s moved whole), and the request's peak
# went from 21.7 to 8.3 GiB with the tiled decode (the DiT's stage now sets it). The VAEs are not streamed: their
# weights are small (<1 GiB) next to their activations, and each decode tile would copy them again.
STREAMED_ENCODERS = ("text_encoder", "text_encoder_2")


class Resident:
    """Every component stays where it was loaded; a stage changes nothing."""

    def stage(self, *components: str) -> AbstractContextManager[None]:
        return nullcontext()


RESIDENT = Resident()


class ComponentOffload:
    """Components on `offload_device`, attached to a copy on `compute_device` inside `stage(...)`."""

    def __init__(self, components: Mapping[str, nn.Module], *, compute_device: torch.device,
                 offload_device: torch.device, pin: bool, streamers: Mapping[str, BlockStreamer] | None = None,
                 resident: tuple[str, ...] = (), parts: Mapping[str, Mapping[str, nn.Module]] | None = None) -> None:
        self.compute_device = torch.device(compute_device)
        # Components that stay on the device (`--cpu-offload-components` naming only some): a stage naming them
        # moves nothing for them.
        self.resident = frozenset(resident)
        self.streamers = dict(streamers or {})
        # A component whose stage uses one of its parts at a time (SR's latent-upscaler bank: an x2 and an x4
        # upscaler, 2.2B and 1.45B parameters, of which a request runs one): each part is a copy of its own,
        # "<component>[<part>]", and `stage("latent_upscaler[x2]")` moves that part (and the component's weights
        # outside every part, if any) instead of the whole bank. `stage("<component>")` still moves all of it.
        self.parts: dict[str, tuple[str, ...]] = {}
        self.weights: dict[str, HostWeights] = {}
        for name, module in components.items():
            # Streamed blocks already belong to their streamer's host weights.
            streamer = self.streamers.get(name)
            skip = ({id(tensor) for weights in streamer.weights for tensor in _slot_tensors(weights)} if streamer
                    else set())
            component_parts = dict((parts or {}).get(name, {}))
            for part, submodule in component_parts.items():
                tensors = module_tensors([submodule], skip)
                skip |= {id(tensor) for tensor in tensors}
                self.weights[f"{name}[{part}]"] = HostWeights(tensors, offload_device=offload_device, pin=pin)
            self.parts[name] = tuple(f"{name}[{part}]" for part in component_parts)
            rest = module_tensors([module], skip)
            if rest or not component_parts:
                self.weights[name] = HostWeights(rest, offload_device=offload_device, pin=pin)
        self.active: tuple[str, ...] = ()
        # ("+".join(stage components), bytes) in the order the stages ran, since `reset_peaks` (the worker's, at each
        # request's start); CUDA only. A list: a TI2AV request runs the VAE twice (the image's encode, the decode).
        self.peak_after: list[tuple[str, int]] = []

    @contextmanager
    def stage(self, *components: str) -> Iterator[None]:
        assert not self.active, f"stage {components} entered inside stage {self.active}"
        moved = list(dict.fromkeys(copy for name in components for copy in self._copies(name)))
        self.active = components
        try:
            for name in moved:
                self.weights[name].to_device(self.compute_device)
            yield
        finally:
            for name in moved:
                self.weights[name].to_host()
                if name in self.streamers:
                    self.streamers[name].release()
            if self.compute_device.type == "cuda":
                self.peak_after.append(("+".join(components), torch.cuda.max_memory_allocated(self.compute_device)))
            self.active = ()

    def _copies(self, name: str) -> list[str]:
        """The host copies a stage naming `name` moves: a component's (all its parts too), or one part's plus the
        component's weights outside its parts; none for a resident component."""
        component, _, part = name.partition("[")
        if component in self.resident:
            return []
        rest = [component] if component in self.weights else []
        if not part:
            # `parts` names every offloaded component (an empty tuple for one without parts)
            assert component in self.parts, (
                f"no component named {component!r}; known: {sorted([*self.parts, *self.resident])}")
            return [*self.parts.get(component, ()), *rest]
        assert name in self.weights, f"no part named {name!r}; known: {sorted(self.weights)}"
        return [name, *rest]

    def reset_peaks(self) -> None:
        """Forget the stages' peaks, where the device's peak counter is reset: a stage the next request skips (no
        audio) showed the last one's peak."""
        self.peak_after = []

    def describe_peaks(self) -> str:
        """The peak after each stage of the last request, in order, e.g. "text_encoder+text_encoder_2 3.1,
        transformer 9.8, ... GiB" ('' off CUDA)."""
        if not self.peak_after:
            return ""
        return ", ".join(f"{stage} {peak / 2**30:.1f}" for stage, peak in self.peak_after) + " GiB"


def _slot_tensors(weights: HostWeights) -> list[torch.Tensor]:
    return [slot.tensor for slot in weights.slots]


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadReport:
    """What `apply_offload` did (logged by the worker)."""

    mode: str
    residency: str  # ResidencyPlan.describe(): "resident transformer; component text_encoder, ..."
    host_bytes: dict[str, int]  # per component, the host copy (streamed blocks counted under "<name> blocks")
    pinned: bool
    streamed_blocks: dict[str, int] = field(default_factory=dict)  # component -> blocks streamed ("memory")
    prefetch_blocks: int = 1  # streamed blocks copied ahead ("memory")
    resident_blocks: dict[str, int] = field(default_factory=dict)  # component -> blocks kept on the device
    resident_bytes: dict[str, int] = field(default_factory=dict)  # component -> their size, on the device

    @property
    def num_streamed_blocks(self) -> int:
        return sum(self.streamed_blocks.values())

    def describe(self) -> str:
        sizes = ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in self.host_bytes.items())
        text = (f"{self.mode} ({self.residency}): components offloaded to {'pinned ' if self.pinned else ''}host "
                f"memory ({sizes})")
        if self.streamed_blocks:
            streamed = ", ".join(f"{count} {name} blocks" for name, count in self.streamed_blocks.items())
            text += f", streamed {self.prefetch_blocks} ahead: {streamed}"
        if self.resident_blocks:
            resident = ", ".join(f"{count} {name} blocks {self.resident_bytes[name] / 2**30:.2f} GiB"
                                 for name, count in self.resident_blocks.items())
            text += f"; on the GPU for the worker's life: {resident}"
        return text


class _Streaming(TypedDict):
    """The keywords every `BlockStreamer` of one offload shares."""

    compute_device: torch.device
    offload_device: torch.device
    pin: bool
    prefetch_blocks: int


def apply_offload(pipeline, mode: str, *, residency: ResidencyPlan | None = None,
                  compute_device: torch.device | str, offload_device: torch.device | str = "cpu",
                  pin: bool | None = None, plan=None, prefetch_blocks: int = 1, resident_blocks: int = 0
                  ) -> OffloadReport:
    """Offload `pipeline.components()` as `residency` says (default: `mode`'s plan, residency.py): "component" ones
    visit the device for their stage, "layerwise" ones stream their repeated blocks (the DiT's blocks of `plan`,
    `prefetch_blocks` ahead, `resident_blocks` of them kept on the device; the text encoders' layers), "resident"
    ones stay where they are. Installs the stage residency on `pipeline`. `pin` defaults to pinned host memory when
    `compute_device` is CUDA."""
    components = pipeline.components()
    if residency is None:
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"offloading is for --performance-mode {' or '.join(OFFLOAD_MODES)}, got {mode!r}")
        residency = resolve_residency(mode, super_resolution="latent_upscaler" in components, present=components)
    compute_device, offload_device = torch.device(compute_device), torch.device(offload_device)
    pin = compute_device.type == "cuda" and offload_device.type == "cpu" if pin is None else pin
    streamed = set(residency.named(LAYERWISE)) & set(components)
    streamers: dict[str, BlockStreamer] = {}
    if ("transformer" not in streamed and resident_blocks != 0) or (not streamed and prefetch_blocks != 1):
        raise ValueError("resident_blocks is for streaming the DiT's blocks, prefetch_blocks for streaming any; "
                         f"this residency streams {', '.join(sorted(streamed)) or 'none'} ({residency.describe()})")
    streaming = _Streaming(compute_device=compute_device, offload_device=offload_device, pin=pin,
                           prefetch_blocks=prefetch_blocks)
    if "transformer" in streamed:
        if plan is None:
            raise ValueError("streaming the DiT needs the blocks its plan lists; this model has none")
        streamers["transformer"] = apply_block_streaming(components["transformer"], plan, **streaming,
                                                         resident_blocks=resident_blocks)
    # Resident blocks go to the DiT alone: its blocks run at every step, so each resident one saves a copy per
    # step, where a text encoder's layers run once per prompt; and Qwen2.5-VL's streamed list holds its vision
    # tower, which text prompts never run (16 resident blocks of each list took 6.2 GiB more on an H200 for Lite
    # and saved no time; docs/benchmarks.md, twelfth session).
    for name in STREAMED_ENCODERS:
        blocks = repeated_blocks(components[name]) if name in streamed else []
        if blocks:
            streamers[name] = BlockStreamer(blocks, **streaming)
    offloaded = {name: module for name, module in components.items() if name in residency.offloaded}
    # A pipeline whose components have parts (SR's upscaler bank) lists them: {component: {part: submodule}}.
    component_parts: Mapping[str, Mapping[str, nn.Module]] = getattr(pipeline, "component_parts", dict)()
    stages = ComponentOffload(offloaded, compute_device=compute_device, offload_device=offload_device, pin=pin,
                              streamers=streamers,
                              resident=tuple(name for name in components if name not in offloaded),
                              parts={name: parts for name, parts in component_parts.items() if name in offloaded})
    pipeline.residency = stages
    host_bytes = {name: weights.num_bytes for name, weights in stages.weights.items()}
    for name, streamer in streamers.items():
        host_bytes[f"{name} blocks"] = streamer.streamed_bytes
    return OffloadReport(
        mode=mode, residency=residency.describe(), host_bytes=host_bytes, pinned=pin,
        streamed_blocks={name: len(s.blocks) - len(s.resident) for name, s in streamers.items()},
        prefetch_blocks=prefetch_blocks,
        resident_blocks={name: len(s.resident) for name, s in streamers.items() if s.resident},
        resident_bytes={name: s.resident_bytes for name, s in streamers.items() if s.resident})
