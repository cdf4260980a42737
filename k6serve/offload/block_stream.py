"""DiT block streaming ("memory" mode): each repeated block's weights live on the host and visit the device only
for the block's forward, the next block's copy running ahead on a side CUDA stream.

Forward hooks on every block of the plan's `blocks` lists: before block i runs, its device copy is attached (copied
now on the compute stream if no prefetch was made, else the compute stream waits on the prefetch's event), and the
copy of the block expected next is started on the side stream; after block i's forward its tensors point back at
the host and its device copy is dropped. "Next" starts as the plan order (the last block wraps to the first, for the
next DiT call) and is corrected from the order the blocks actually ran in, so a model that calls its lists in
another order costs one unprefetched copy, not a wrong result.

The host queues kernels far ahead of the GPU, and a dropped copy's memory is only reusable once the GPU is past the
block, so the host waits (an event per block) until the block before the previous one has finished before it starts
another prefetch: at most three blocks' weights are on the device at a time (the one finishing, the one running, the
one being copied), without slowing a GPU-bound step.

The caching allocator serves a stream from its own pool: a prefetched chunk is allocated on the side stream, so it
is marked with `record_stream` for the compute stream, or its memory could be handed to the next prefetch while the
compute stream still reads it. Off CUDA there are no streams or events: copies are synchronous (what CPU tests run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k6serve.models.plan import ModelPlan
from k6serve.offload.host_weights import HostWeights, module_tensors


@dataclass(eq=False, slots=True)
class _Prefetch:
    chunks: list[torch.Tensor]
    ready: torch.cuda.Event | None  # recorded on the side stream after the copies (CUDA only)


def plan_blocks(transformer: nn.Module, plan: ModelPlan) -> list[nn.Module]:
    """The repeated blocks of `transformer`, in the plan's order."""
    return [block for path in plan.blocks for block in transformer.get_submodule(path)]


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The entries of every outermost `nn.ModuleList` of `module` that holds two or more modules of one class with
    weights, in module order: a transformers text encoder's decoder layers and its vision tower's blocks.

    Found by shape rather than by attribute path because the paths move between transformers releases (CLIP's
    layers are `text_model.encoder.layers` in 4.x and `encoder.layers` in 5.x; Qwen2.5-VL's language model moved
    under `model.language_model`); the blocks are what a text encoder repeats, whatever it calls them. Lists inside
    a found block are part of that block."""
    found: list[nn.Module] = []
    inside: list[str] = []
    for name, child in module.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if (isinstance(child, nn.ModuleList) and len(child) >= 2 and len({type(entry) for entry in child}) == 1
                and all(any(True for _ in entry.parameters()) for entry in child)):
            found.extend(child)
            inside.append(f"{name}.")
    return found


class BlockStreamer:
    """Streams `blocks` between `offload_device` and `compute_device` around each block's forward."""

    def __init__(self, blocks: list[nn.Module], *, compute_device: torch.device, offload_device: torch.device,
                 pin: bool) -> None:
        self.compute_device = torch.device(compute_device)
        self.blocks = blocks
        self.weights = [HostWeights(module_tensors([block]), offload_device=offload_device, pin=pin)
                        for block in blocks]
        self.next_of = [(index + 1) % len(blocks) for index in range(len(blocks))]
        self.prefetched: dict[int, _Prefetch] = {}
        self.previous: int | None = None
        self.finished: list[torch.cuda.Event] = []  # recorded after each block's forward (CUDA only)
        use_streams = self.compute_device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.compute_device) if use_streams else None
        self.handles = []
        for index, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre_hook(index)))
            self.handles.append(block.register_forward_hook(self._post_hook(index)))

    @property
    def num_bytes(self) -> int:
        return sum(weights.num_bytes for weights in self.weights)

    def _pre_hook(self, index: int):
        def hook(module, args):
            self.before(index)

        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            self.after(index)

        return hook

    def before(self, index: int) -> None:
        """Attach block `index`'s device copy and start copying the block expected after it."""
        if self.previous is not None:
            self.next_of[self.previous] = index
        self.previous = index
        prefetch = self.prefetched.pop(index, None)
        if prefetch is None:
            self.weights[index].attach(self.weights[index].copy_to(self.compute_device))
        else:
            if prefetch.ready is not None:
                compute_stream = torch.cuda.current_stream(self.compute_device)
                compute_stream.wait_event(prefetch.ready)
                for chunk in prefetch.chunks:
                    chunk.record_stream(compute_stream)
            self.weights[index].attach(prefetch.chunks)
        while len(self.finished) > 1:
            self.finished.pop(0).synchronize()
        following = self.next_of[index]
        if following != index and following not in self.prefetched and not self.weights[following].on_device:
            self.prefetched[following] = self._prefetch(following)

    def _prefetch(self, index: int) -> _Prefetch:
        if self.copy_stream is None:
            return _Prefetch(chunks=self.weights[index].copy_to(self.compute_device), ready=None)
        # The side stream must not start before the compute stream reaches this point: the hook runs on the host
        # ahead of the GPU, and this keeps the copies of a block from racing ahead of the previous DiT call.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.compute_device))
        with torch.cuda.stream(self.copy_stream):
            chunks = self.weights[index].copy_to(self.compute_device)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        return _Prefetch(chunks=chunks, ready=ready)

    def after(self, index: int) -> None:
        """Block `index` ran: point it back at the host, dropping its device copy."""
        self.weights[index].to_host()
        if self.copy_stream is not None:
            finished = torch.cuda.Event()
            finished.record(torch.cuda.current_stream(self.compute_device))
            self.finished.append(finished)

    def release(self) -> None:
        """Drop every device copy (a prefetch made for a call that will not come); end of the DiT stage."""
        for index in list(self.prefetched):
            prefetch = self.prefetched.pop(index)
            if prefetch.ready is not None:
                # Freed memory goes back to the side stream's pool; the compute stream must not outrun the copy.
                torch.cuda.current_stream(self.compute_device).wait_event(prefetch.ready)
        for weights in self.weights:
            weights.to_host()
        self.previous = None
        self.finished = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def apply_block_streaming(transformer: nn.Module, plan: ModelPlan, *, compute_device: torch.device,
                          offload_device: torch.device, pin: bool) -> BlockStreamer:
    """Install block streaming on the plan's blocks of `transformer` (their weights move to `offload_device`)."""
    return BlockStreamer(plan_blocks(transformer, plan), compute_device=compute_device,
                         offload_device=offload_device, pin=pin)
