"""DiT block streaming ("memory" mode): each repeated block's weights live on the host and visit the device only
for the block's forward, the copies of the next `prefetch_blocks` blocks running ahead on a side CUDA stream; the
`resident_blocks` kept on the device for the life of the worker are never copied.

Forward hooks on every block of the plan's `blocks` lists: before block i runs, its device copy is attached (copied
now on the compute stream if no prefetch was made, else the compute stream waits on the prefetch's event), and the
copies of the `prefetch_blocks` streamed blocks expected after it are started on the side stream (resident blocks
are passed over, so the depth counts copies); after block i's forward its tensors point back at the host and its
device copy is dropped. "Next" starts as the plan order (the last block wraps to the first, for the next DiT call)
and is corrected from the order the blocks actually ran in, so a model that calls its lists in another order (or a
step cache that skips blocks) costs unprefetched copies, not a wrong result; a prefetch the corrected order no longer
expects within the depth is dropped, so mispredictions cannot pile up copies.

The host queues kernels far ahead of the GPU, and a dropped copy's memory is only reusable once the GPU is past the
block, so before starting another prefetch the host waits (an event recorded after each streamed block) until every
streamed block but the last one to run has finished: at most `prefetch_blocks + 2` streamed blocks' weights are on
the device at a time (the one finishing, the one running, the ones being copied), plus the resident ones, without
slowing a GPU-bound step. Depth does not raise the copy bandwidth: it lets a block whose copy outlasts the blocks
before it (the DiT's large fused blocks after its small text blocks) start copying earlier, as long as copies keep up
overall; resident blocks cut the bytes copied per DiT call.

Resident blocks are spread evenly over the list ("strided"): the depth bounds how far copies may run ahead, so a
run of resident blocks at the start ("leading") would leave the copy engine idle for most of it, while one between
streamed blocks gives the next copy its compute time. The reference server offers both and measured strided ~0.5%
faster end to end, too little for a flag of our own. Their weights are packed on the compute device when the
streamer is installed, with no host copy: no host memory spent on them, a too-large count fails at start rather than
in a request, and a LoRA merge (in place on the weight's storage) has one copy to change.

The caching allocator serves a stream from its own pool: a prefetched chunk is allocated on the side stream, so it
is marked with `record_stream` for the compute stream, or its memory could be handed to the next prefetch while the
compute stream still reads it. Off CUDA there are no streams or events: copies are synchronous (what CPU tests run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

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
    # A plan's `blocks` are paths of nn.ModuleLists (models/plan.py); get_submodule is typed as any module.
    return [block for path in plan.blocks for block in cast(nn.ModuleList, transformer.get_submodule(path))]


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


def strided_indices(num_blocks: int, num_resident: int) -> frozenset[int]:
    """`num_resident` of the indices `0..num_blocks-1` spread evenly (all of them when `num_resident >= num_blocks`),
    the gaps even around the wrap from the last block to the first too."""
    num_resident = min(num_resident, num_blocks)
    return frozenset(index * num_blocks // num_resident for index in range(num_resident))


class BlockStreamer:
    """Streams `blocks` between `offload_device` and `compute_device` around each block's forward, `prefetch_blocks`
    ahead; `resident_blocks` of them (strided) stay on `compute_device`."""

    def __init__(self, blocks: list[nn.Module], *, compute_device: torch.device, offload_device: torch.device,
                 pin: bool, prefetch_blocks: int = 1, resident_blocks: int = 0) -> None:
        assert prefetch_blocks >= 1 and resident_blocks >= 0, (prefetch_blocks, resident_blocks)
        self.compute_device = torch.device(compute_device)
        self.blocks = blocks
        self.prefetch_blocks = prefetch_blocks
        self.resident = strided_indices(len(blocks), resident_blocks)
        # A resident block's chunks are packed on the compute device itself: `HostWeights` with the device as home.
        self.weights = [HostWeights(module_tensors([block]), pin=pin and index not in self.resident,
                                    offload_device=self.compute_device if index in self.resident else offload_device)
                        for index, block in enumerate(blocks)]
        self.next_of = [(index + 1) % len(blocks) for index in range(len(blocks))]
        self.prefetched: dict[int, _Prefetch] = {}
        self.previous: int | None = None
        self.finished: list[torch.cuda.Event] = []  # recorded after each streamed block's forward (CUDA only)
        use_streams = self.compute_device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.compute_device) if use_streams else None
        self.handles = []
        for index, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre_hook(index)))
            self.handles.append(block.register_forward_hook(self._post_hook(index)))

    @property
    def streamed_bytes(self) -> int:
        """The host copy of the streamed blocks."""
        return sum(weights.num_bytes for index, weights in enumerate(self.weights) if index not in self.resident)

    @property
    def resident_bytes(self) -> int:
        """The resident blocks, on the compute device for the life of the streamer."""
        return sum(self.weights[index].num_bytes for index in self.resident)

    def _pre_hook(self, index: int):
        def hook(module, args):
            self.before(index)

        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            self.after(index)

        return hook

    def before(self, index: int) -> None:
        """Attach block `index`'s device copy and start copying the streamed blocks expected after it."""
        if self.previous is not None:
            self.next_of[self.previous] = index
        self.previous = index
        # Waited for, and stale prefetches dropped, before this block's copy too: an unprefetched block is copied
        # now, and that copy counts against the bound as much as a prefetch.
        while len(self.finished) > 1:
            self.finished.pop(0).synchronize()
        expected = self._expected_after(index)
        for stale in [other for other in self.prefetched if other != index and other not in expected]:
            self._drop_prefetch(stale)
        if index not in self.resident:
            self._attach(index)
        for following in expected:
            if following not in self.prefetched:
                self.prefetched[following] = self._prefetch(following)

    def _attach(self, index: int) -> None:
        prefetch = self.prefetched.pop(index, None)
        if prefetch is None:
            self.weights[index].attach(self.weights[index].copy_to(self.compute_device))
            return
        if prefetch.ready is not None:
            compute_stream = torch.cuda.current_stream(self.compute_device)
            compute_stream.wait_event(prefetch.ready)
            for chunk in prefetch.chunks:
                chunk.record_stream(compute_stream)
        self.weights[index].attach(prefetch.chunks)

    def _expected_after(self, index: int) -> list[int]:
        """The next `prefetch_blocks` streamed blocks after `index` along `next_of`, in order (fewer when the chain
        comes back to `index` or closes a loop first)."""
        expected: list[int] = []
        seen = {index}
        following = self.next_of[index]
        while len(expected) < self.prefetch_blocks and following not in seen:
            seen.add(following)
            if following not in self.resident:
                expected.append(following)
            following = self.next_of[following]
        return expected

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

    def _drop_prefetch(self, index: int) -> None:
        prefetch = self.prefetched.pop(index)
        if prefetch.ready is not None:
            # Freed memory goes back to the side stream's pool; the compute stream must not outrun the copy.
            torch.cuda.current_stream(self.compute_device).wait_event(prefetch.ready)

    def after(self, index: int) -> None:
        """Block `index` ran: a streamed block points back at the host, dropping its device copy."""
        if index in self.resident:
            return
        self.weights[index].to_host()
        if self.copy_stream is not None:
            finished = torch.cuda.Event()
            finished.record(torch.cuda.current_stream(self.compute_device))
            self.finished.append(finished)

    def release(self) -> None:
        """Drop every streamed device copy (a prefetch made for a call that will not come); end of the DiT stage.
        The resident blocks stay."""
        for index in list(self.prefetched):
            self._drop_prefetch(index)
        for index, weights in enumerate(self.weights):
            if index not in self.resident:
                weights.to_host()
        self.previous = None
        self.finished = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def apply_block_streaming(transformer: nn.Module, plan: ModelPlan, *, compute_device: torch.device,
                          offload_device: torch.device, pin: bool, prefetch_blocks: int = 1,
                          resident_blocks: int = 0) -> BlockStreamer:
    """Install block streaming on the plan's blocks of `transformer` (the streamed ones' weights move to
    `offload_device`, the resident ones' to `compute_device`)."""
    return BlockStreamer(plan_blocks(transformer, plan), compute_device=compute_device,
                         offload_device=offload_device, pin=pin, prefetch_blocks=prefetch_blocks,
                         resident_blocks=resident_blocks)
