"""A model worker: loads one checkpoint on one device and runs requests on it, one at a time.

The worker owns everything that touches the GPU. It turns `SamplingParams` into a resolved request, runs the
family's pipeline, writes the MP4 atomically and never over an existing file, and returns a `VideoResult` with
stage timings and peak memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

import torch

from k6serve.config import EngineConfig, WarmupSize
from k6serve.lora.spec import (
    LORA_TARGETS,
    ListLoras,
    LoraOperation,
    LoraReply,
    quantized_lora_refusal,
    start_set_lora,
)
from k6serve.models.checkpoint_files import resolve_checkpoint
from k6serve.models.variants import GENERATION, Variant, recognise
from k6serve.offload.residency import RESIDENT, resolve_residency, streams_text_encoder
from k6serve.rank_logging import ONCE
from k6serve.request import (
    GenerateRequest,
    OutputOptions,
    ProgressCallback,
    SamplingParams,
    UpscaleRequest,
    VideoResult,
)
from k6serve.request_resolution import resolve_generate, resolve_upscale
from k6serve.runtime.devices import peak_memory_mb, resolve_device, resolve_dtype
from k6serve.runtime.gc_freeze import CompileGcFreezer, compiled_graph_count
from k6serve.runtime.memory import MemoryOperation, MemoryRankReport, MemoryRelease, apply_memory_operation
from k6serve.runtime.mp4_output import generate_into_mp4, output_file
from k6serve.runtime.warmup_sizes import (
    SR_WARMUP_CLIP,
    SR_WARMUP_SCALE,
    check_sr_warmup_size,
    generation_warmups,
    sr_warmup_source,
)
from k6serve.runtime.worker_preflight import check_residency, refuse_family_flags
from k6serve.speed.performance_mode import apply_performance_mode
from k6serve.speed.vae_tiling import resolve_vae_tiling
from k6serve.speed.warmup import WarmupReport, warmup

if TYPE_CHECKING:  # imported on the first LoRA operation (`_lora_manager`)
    from k6serve.lora.manager import LoraManager

logger = logging.getLogger(__name__)


def _rewrite_part(report: WarmupReport) -> str:
    """The compiled prompt rewrite's share of a warm-up, for its log line ("" when it did not rewrite)."""
    if report.rewrite_seconds is None:
        return ""
    return f" (the prompt rewrite's compile, --compile-prompt-rewrite true: {report.rewrite_seconds:.2f} s)"


class ModelWorker:
    """Loads the checkpoint named by the config and serves requests for it."""

    def __init__(self, config: EngineConfig, *, transform: Callable[[ModelWorker], None] | None = None) -> None:
        """Load the checkpoint; `transform(worker)` (e.g. the multi-GPU layout) runs before the speed
        transforms, which must see the final module tree."""
        self.config = config
        self.device = resolve_device(config.runtime.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        model = config.model
        folder = None
        if model.load_format != "dummy":
            folder = resolve_checkpoint(model.model_path, model.revision, model.model_id)
        self.variant: Variant = recognise(model.model_path, model.model_id, folder)
        self.folder = folder
        refuse_family_flags(config, self.variant, self.device, folder)
        from k6serve.parallel.mesh import ParallelLayout
        from k6serve.parallel.tile_decode import sr_decode_mode

        # The SR decode across a replica's GPUs; a refused choice is refused before the weights load.
        self.sr_decode = sr_decode_mode(config.runtime,
                                        replica_size=ParallelLayout.from_config(config.parallel).replica_size,
                                        super_resolution=self.variant.family != GENERATION)
        # Resolved before the weights load, so an SR checkpoint with --vae-tiling on is refused at once.
        self.vae_tiling = resolve_vae_tiling(config.runtime.vae_tiling, config.runtime.performance_mode,
                                             self.device, self.variant.family)
        # Per component: resident, offloaded whole or streamed (offload/residency.py); refused names of the other
        # family's components are refused here, before the weights load.
        self.residency_plan = resolve_residency(
            config.runtime.performance_mode, super_resolution=self.variant.family != GENERATION,
            cpu_offload=config.runtime.cpu_offload_components,
            layerwise=config.runtime.layerwise_offload_components, settings=config.runtime.component_residency)
        check_residency(config, self.variant, self.residency_plan, self.device)
        start = time.perf_counter()
        self.pipeline = self._build_pipeline(folder)
        # What requests are checked against when resolved (`resolve_generate`), and what the ranks report to the
        # engine: a generation checkpoint may list no audio_vae / vocoder; on the CPU nothing is offloaded.
        generation = self.variant.family == GENERATION
        self.has_audio = not generation or self.pipeline.models.has_audio
        self.streams_text_encoder = generation and streams_text_encoder(self.residency_plan, self.device.type)
        if transform is not None:
            transform(self)
        self._place_resident_components()
        self.performance_report = apply_performance_mode(
            self.pipeline.models, config.runtime.performance_mode, self.device,
            compile_vae_decoder=config.runtime.compile_vae,
            # Offloaded whole, a component keeps speed mode's transforms; streamed, it runs eager (the offload
            # below moves what these transforms built: the fused projections, the folded VAE kernels).
            offloaded_whole=self.residency_plan.offloaded_whole if self.offloads else frozenset(),
            streamed=self.residency_plan.streamed if self.offloads else frozenset(),
            quantization=model.quantization, quantization_ignored_layers=model.quantization_ignored_layers)
        if self.performance_report.num_quantized_linears:
            logger.info("--quantization %s: %d of the DiT's video-token linears run in e4m3 (lossy)",
                        model.quantization, self.performance_report.num_quantized_linears, extra=ONCE)
        self._apply_vae_tiling()
        self.offload_report = self._apply_offload()
        self.lora_manager: LoraManager | None = None  # created on the first LoRA operation (`_lora_manager`)
        self.memory_release = MemoryRelease(self.device)  # sleep / wake between requests (runtime/memory.py)
        set_lora = start_set_lora(model)  # None without --lora-path
        if set_lora is not None:
            # After the speed transforms and offloading: the manager must see the fused projections and the host
            # storage that requests will use.
            self.apply_lora_operation(set_lora)
        if self.variant.family == GENERATION:
            self.pipeline.trim_text_padding = config.runtime.performance_mode == "speed"
            if config.runtime.compile_prompt_rewrite:
                from k6serve.pipelines.expand_prompt import StaticRewriteCache, apply_rewrite_compile_config

                apply_rewrite_compile_config(self.pipeline.models.text_encoder, self.device)
                self.pipeline.rewrite_cache = StaticRewriteCache(self.pipeline.models.text_encoder.config)
        if config.parallel.ulysses_degree > 1 and self.performance_report.num_compiled_blocks:
            # Measured on two H200s: compiled kernels are generated per shape, so a sharded run rounds
            # differently from one GPU (docs/parallelism.md); eager kernels keep Ulysses bit-exact.
            logger.warning("Ulysses with --performance-mode speed compiles the DiT per shape: outputs match one GPU "
                           "within rounding, not bit for bit. Use --performance-mode balanced for bit-exact output "
                           "(eager kernels; it also keeps the weights on the host between stages).", extra=ONCE)
        self.load_time_s = time.perf_counter() - start
        if self.variant.is_demo:
            # The one announcement, for the CLI, the API and the server alike (the CLI printed its own too).
            noise = ("the upscaled video is noise (the source's audio is kept)" if self.variant.family != GENERATION
                     else "the video and audio are noise")
            logger.warning("Serving the built-in tiny demo checkpoint: its weights are random, so %s. Pass a real "
                           "Kandinsky 6 checkpoint as the model path for real output.", noise, extra=ONCE)
        self.warmed_up = False
        self.gc_freezer = CompileGcFreezer()
        # `--warmup-mode server`: each shape warmed at start with what it cost, and their total (also logged).
        self.server_warmups: tuple[WarmupReport, ...] = ()
        self.server_warmup_s: float | None = None
        self._other_lengths_warmed = False  # see `_other_lengths`
        self._rewrite_warmed = False  # see `_rewrite`
        if config.runtime.warmup_mode == "server":
            self.server_warmups = self._server_warmup()
            self.server_warmup_s = sum(report.seconds for report in self.server_warmups)

    @property
    def precision(self) -> str:
        """The dtype the DiT's and the VAE's weights are loaded in, by torch's name ("bfloat16", "float32"); the
        modules a model keeps in fp32 stay so."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def offloads(self) -> bool:
        """Some component offloaded (balanced / memory, or the per component flags) on a GPU: those weights live in
        host memory (on the CPU there is nowhere to offload to)."""
        return self.residency_plan.offloads and self.device.type == "cuda"

    def _place_resident_components(self) -> None:
        """With some components offloaded the resident ones must be on the device before the speed transforms
        (which must see them there), for the worker's life: the generation loader put them there already (a no-op
        here); the SR loader put every weight on the host."""
        if not self.offloads:
            return
        components = self.pipeline.components()
        for name in self.residency_plan.named(RESIDENT):
            if name in components:
                components[name].to(self.device)

    def _apply_vae_tiling(self) -> None:
        """Spatial tiles for the HunyuanVideo decode when `self.vae_tiling` (speed/vae_tiling.py); logged, since
        the frames then differ from the untiled decode."""
        if not self.vae_tiling:
            return
        vae = self.pipeline.models.vae
        vae.enable_tiling()
        logger.info("--vae-tiling %s: the video VAE decodes (and encodes) in spatial tiles of %dx%d px, stride "
                    "%dx%d, overlaps blended, as diffusers' enable_tiling does (lower peak memory, slower decode; "
                    "frames differ from the untiled decode)", self.config.runtime.vae_tiling,
                    vae.tile_sample_min_height, vae.tile_sample_min_width, vae.tile_sample_stride_height,
                    vae.tile_sample_stride_width, extra=ONCE)

    def _apply_offload(self):
        """After every other transform, which must see the final module tree (the weights were loaded on the host)."""
        if not self.offloads:
            return None
        from k6serve.models.registry import transformer_plan
        from k6serve.offload import apply_offload

        runtime = self.config.runtime
        report = apply_offload(self.pipeline, runtime.performance_mode, residency=self.residency_plan,
                               compute_device=self.device, plan=transformer_plan(self.pipeline.models.transformer),
                               prefetch_blocks=runtime.offload_prefetch_blocks,
                               resident_blocks=runtime.offload_resident_blocks)
        logger.info("%s", report.describe(), extra=ONCE)
        for note in self.residency_plan.notes:
            logger.info("%s", note, extra=ONCE)
        return report

    def _lora_manager(self):
        """The DiT's `LoraManager`, created on first use; refuses models and layouts without LoRA support."""
        if self.lora_manager is not None:
            return self.lora_manager
        if self.variant.family != GENERATION:
            raise ValueError(f"LoRA adapters apply to the Kandinsky 6 generation DiT; {self.variant.name} is a "
                             "super-resolution model, which takes none.")
        if self.config.model.quantization != "none":
            raise ValueError(quantized_lora_refusal(self.config.model.quantization))
        from k6serve.lora.manager import LoraManager

        # Tensor-parallel shards take their block of each update; FSDP shards take dynamic updates only (manager.py).
        self.lora_manager = LoraManager(self.pipeline.models.transformer,
                                        fsdp=self.config.parallel.use_fsdp_inference)
        return self.lora_manager

    def apply_lora_operation(self, operation: LoraOperation) -> LoraReply:
        """Run one LoRA operation (between requests, on every rank); returns a JSON-able reply.

        SetLora / MergeLora / UnmergeLora -> {"status": "ok", "message", "loras"}; ListLoras -> {"loras"}. Bad input
        raises ValueError with the message for the user. A SetLora `merge_mode` of "auto" means the server's
        `--lora-merge-mode` (whose own auto is merge)."""
        if isinstance(operation, ListLoras):
            return {"loras": self.lora_manager.state() if self.lora_manager is not None else []}
        if operation.target not in LORA_TARGETS:
            raise ValueError(f"LoRA target must be one of {', '.join(LORA_TARGETS)} (Kandinsky 6 has one DiT), got "
                             f"{operation.target!r}")
        from k6serve.lora.manager import run_lora_operation

        manager = self._lora_manager()
        changes = manager.num_changes
        try:
            message = run_lora_operation(manager, operation, self.config)
        finally:
            if manager.num_changes != changes:
                # A merge or unmerge rewrote the device weights: a host copy kept by a memory resume is stale. A
                # refused operation changed nothing and keeps it (tens of GiB not to copy again at the next release).
                self.memory_release.drop_kept()
        return {"status": "ok", "message": message, "loras": manager.state()}

    def apply_memory_operation(self, operation: MemoryOperation) -> list[MemoryRankReport]:
        """Release or resume this worker's device memory, between requests; one report (this worker is one rank)."""
        return [apply_memory_operation(self, operation)]

    def _request_chooses_adapters(self, request: GenerateRequest | UpscaleRequest) -> TypeGuard[GenerateRequest]:
        """Whether the request's own `loras` need the LoRA manager: any `loras`, but an empty one (the base model)
        on a quantized DiT, which holds no adapters to switch off."""
        loras = getattr(request, "loras", None)
        return loras is not None and bool(loras or self.config.model.quantization == "none")

    def _request_loras(self, request: GenerateRequest | UpscaleRequest):
        """The request's own LoRA adapters for its run (`LoraManager.for_request`), or nothing to change."""
        if not self._request_chooses_adapters(request):
            return contextlib.nullcontext()
        return self._lora_manager().for_request(request.loras)

    @contextlib.contextmanager
    def _naming_lora_strengths(self, request: GenerateRequest | UpscaleRequest):
        """Non-finite latents raised again naming the LoRA adapters the DiT ran with, the engine's included (the
        pipeline knows only the request's own): a huge strength is their likely cause."""
        from k6serve.pipelines.text_to_video import NonFiniteLatents, non_finite_latents

        try:
            yield
        except NonFiniteLatents:
            active = self.lora_manager.active if self.lora_manager is not None else []
            if not active or not isinstance(request, GenerateRequest):  # (an SR worker has no LoRA manager)
                raise
            raise non_finite_latents(request, [(entry.nickname, entry.strength, entry.alpha) for entry in active]
                                     ) from None

    def variant_warmup_params(self) -> SamplingParams:
        """A request of the variant's default shape (server warm-up without --warmup-resolutions; SR makes its own
        clip instead, `_warmup_super_resolution`)."""
        return SamplingParams(prompt="warm-up")

    def _warmup(self, params: SamplingParams, on_step: ProgressCallback | None = None) -> float | None:
        """`--warmup-mode request`: run a short request of this shape once (compilation, autotuning); returns its
        cost in seconds. There is no shorter version of an SR request to run first (its DiT takes 2 calls per
        tile), so an SR model's first request is its own warm-up: None, no warm-up ran (its job got a note of a
        0.00 s warm-up, and the stage histogram a 0 s one). `on_step` is the request's: called at the
        warm-up's steps as (0, the request's steps), so a cancel of the request stops its warm-up too (a minute of
        compiling on a GPU), and its progress stays at 0 meanwhile."""
        from k6serve.runtime.engine import RequestCancelled

        self.warmed_up = True
        if self.variant.family != GENERATION:
            return None
        request, _ = self._resolve_generate(params)
        cancel_point = None if on_step is None else (lambda step, total: on_step(0, request.num_inference_steps))
        start = time.perf_counter()
        try:
            report = warmup(self.pipeline, request, "request", other_lengths=self._other_lengths(),
                            rewrite=self._rewrite(), on_step=cancel_point)
        except RequestCancelled:
            self.warmed_up = False  # the next request warms up
            # Cancels come at the pipeline's steps, before the rewrite's pass: the next warm-up compiles it. (Every
            # rank of a replica cancels at the same step, as on_step is called on all of them together.)
            self._rewrite_warmed = False
            raise
        except Exception as exc:
            from k6serve.parallel.mesh import ParallelLayout

            if ParallelLayout.from_config(self.config.parallel).replica_size > 1:
                # The replica's other ranks may still be inside the warm-up's collectives: running the request here
                # would pair this rank's collectives with theirs. The request fails, saying it was the warm-up.
                raise RuntimeError(f"the warm-up (--warmup-mode request) before this request failed "
                                   f"({type(exc).__name__}: {exc})") from exc
            # As the reference's server does: the warm-up only saves the first request's compile time, so its failure
            # is logged and the request runs (it was failed with an error that did not say it was the warm-up).
            seconds = time.perf_counter() - start
            logger.warning("warm-up (request) failed after %.2f s (%s: %s); running the request without it", seconds,
                           type(exc).__name__, exc)
            return seconds
        self.gc_freezer.freeze_if_compiled()  # the warm-up compiled the graphs: keep the collector off them
        logger.info("warm-up (%s) took %.2f s%s", self.config.runtime.warmup_mode, report.seconds,
                    _rewrite_part(report))
        return report.seconds

    def _other_lengths(self) -> bool:
        """Whether this generation warm-up also runs `speed.warmup.warm_other_lengths`: once per worker, when the
        DiT's blocks are compiled (after that pass their text, audio and image inputs are dynamic for every shape
        compiled later). Decided from the configuration, the same on every rank of a replica."""
        if self._other_lengths_warmed or not self.performance_report.num_compiled_blocks:
            return False
        self._other_lengths_warmed = True
        return True

    def _rewrite(self) -> bool:
        """Whether this warm-up also compiles the prompt rewrite (`speed.warmup.warm_rewrite`): once per worker, with
        --compile-prompt-rewrite true, whether or not its request rewrites (later ones may). Decided from the
        configuration, the same on every rank of a replica."""
        # The super-resolution model refused the flag before its load.
        if self._rewrite_warmed or not self.config.runtime.compile_prompt_rewrite:
            return False
        self._rewrite_warmed = True
        return True

    def _server_warmup(self) -> tuple[WarmupReport, ...]:
        """`--warmup-mode server`: warm each --warmup-resolutions size in order, or the variant's default shape when
        none is listed. Every rank of a replica builds its worker from the same config, so all ranks warm the same
        sizes in the same order and run each one's collectives together, as they run a request."""
        self.warmed_up = True
        sizes = self.config.runtime.warmup_resolutions
        if self.variant.family != GENERATION:
            reports = [self._warmup_super_resolution(size) for size in sizes or (None,)]
        elif not sizes:
            reports = [self._warmup_generation(None, self._resolve_warmup(self.variant_warmup_params())[0])]
        else:
            requests = generation_warmups(sizes, self.variant, self._resolve_warmup)
            # The compiled rewrite's cache only grows: warmed at the listed size whose image gives the rewrite the most
            # tokens (its gray image), the cache is long enough for every listed size's rewrite (a 1280x720 image's
            # needs 4,096 positions, a 768x512 one's 2,048), so none compiles on a request.
            largest = 0
            if self.config.runtime.compile_prompt_rewrite and not self._rewrite_warmed and len(requests) > 1:
                # Ties (sizes rounded alike) go to the larger area, then the first listed.
                keys = [(self.pipeline.rewrite_image_tokens(request.height, request.width),
                         request.height * request.width) for request in requests]
                largest = keys.index(max(keys))
            reports = [self._warmup_generation(size, request, rewrite=index == largest)
                       for index, (size, request) in enumerate(zip(sizes, requests))]
        self.gc_freezer.freeze_if_compiled()  # the warm-up compiled the graphs: keep the collector off them
        if len(reports) > 1:
            logger.info("warm-up (server) of %d shapes took %.2f s: %s", len(reports),
                        sum(report.seconds for report in reports),
                        ", ".join(f"{report.size} {report.seconds:.2f} s" for report in reports))
        return tuple(reports)

    @contextlib.contextmanager
    def _naming_size(self, size: WarmupSize | None):
        """A listed size's warm-up failing is said with the size: refused (ValueError), or failed (out of memory)."""
        try:
            yield
        except ValueError as error:
            if size is None or str(error).startswith("--warmup-resolutions"):
                raise
            raise ValueError(f"--warmup-resolutions {size}: {error}") from error
        except Exception:
            if size is not None:
                logger.error("--warmup-resolutions %s: the warm-up of this shape failed", size)
            raise

    def _warmup_generation(self, size: WarmupSize | None, request: GenerateRequest, *,
                           rewrite: bool = True) -> WarmupReport:
        """One short request (`WARMUP_STEPS` steps) of `size`'s resolved request; with `rewrite` (and
        --compile-prompt-rewrite true, once per worker) also the rewrite's compile."""
        if size is not None and size.num_frames not in (None, request.num_frames):
            logger.info("--warmup-resolutions %s: %d frames is not of the form 4k+1; warming %d, as a request of "
                        "it runs", size, size.num_frames, request.num_frames)
        with self._naming_size(size):
            report = warmup(self.pipeline, request, "server", other_lengths=self._other_lengths(),
                            rewrite=rewrite and self._rewrite())
        logger.info("warm-up (server, %s) took %.2f s%s", report.size, report.seconds, _rewrite_part(report))
        return report

    def _warmup_super_resolution(self, size: WarmupSize | None) -> WarmupReport:
        """SR server warm-up: one x2 upscale of a synthetic clip of `size` (default `SR_WARMUP_CLIP`'s shape),
        written to a temporary MP4 through the same streamed decode and encoder as a request, so the DiT, the
        compiled K-VAE blocks and the attention kernels are ready before the first request of
        that shape (the cold VSR x2 request took 156-237 s on an H200, the warm one 38.7 s). A source of another
        aspect ratio (another tile) or frame count still compiles on its first request."""
        import tempfile

        from k6serve.models.kandinsky6_sr.config_before_loading import SRTiling
        from k6serve.testing.clips import make_clip

        default_width, default_height, default_num_frames, fps = SR_WARMUP_CLIP
        (width, height, num_frames), notes = sr_warmup_source(
            size or WarmupSize(default_width, default_height, default_num_frames), default_num_frames)
        if size is not None:
            for note in notes:
                logger.info("--warmup-resolutions %s: %s", size, note)
            # Against the loaded tiles, before the clip is written: a source smaller than one tile is refused.
            models = self.pipeline.models
            check_sr_warmup_size(size, self.variant, SRTiling(tile_sizes=tuple(models.transformer.config.tile_sizes),
                                                              snap=models.vae.spatial_compression_ratio))
        start = time.perf_counter()
        with self._naming_size(size), tempfile.TemporaryDirectory(prefix="k6serve-warmup-") as folder:
            clip = make_clip(Path(folder) / "source.mp4", width=width, height=height, num_frames=num_frames, fps=fps)
            request, _ = self.resolve(SamplingParams(video_path=str(clip), sr_resolution_scale=SR_WARMUP_SCALE))
            generate_into_mp4(self.pipeline, request, Path(folder) / "upscaled.mp4", None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        report = WarmupReport(mode="server", seconds=time.perf_counter() - start, shape=(num_frames, height, width))
        logger.info("warm-up (server, super-resolution of %s) took %.2f s", report.size, report.seconds)
        return report

    @property
    def weights_device(self) -> torch.device:
        """Where the loader puts the weights: the host when they are offloaded, so they never need to fit on the
        GPU at once (`--load-format dummy` builds them there too), else the device."""
        return torch.device("cpu") if self.offloads else self.device

    def _build_pipeline(self, folder: Path | None):
        from k6serve.ops.attention import resolve_attention_backend

        backend = resolve_attention_backend(
            None if self.config.runtime.attention_backend == "auto" else self.config.runtime.attention_backend,
            self.device, self.dtype,
        )
        self.attention_backend = backend
        if self.variant.family == GENERATION:
            from k6serve.models.kandinsky6.checkpoint import load_generation_models
            from k6serve.pipelines.text_to_video import TextToVideoPipeline

            # The resident components load straight onto the device (the SR models, 14 GB in all, are moved
            # after their load by `_place_resident_components`).
            resident = {name: self.device for name in self.residency_plan.named(RESIDENT)} if self.offloads else None
            models = load_generation_models(folder, self.variant, device=self.device, dtype=self.dtype,
                                            load_format=self.config.model.load_format,
                                            weights_device=self.weights_device, component_devices=resident)
            models.transformer.set_attention_backend(backend)
            return TextToVideoPipeline(models, keep_float_frames=False)
        from k6serve.pipelines.super_resolution import build_super_resolution_pipeline

        return build_super_resolution_pipeline(folder, self.variant, device=self.device, dtype=self.dtype,
                                               load_format=self.config.model.load_format, attention_backend=backend,
                                               weights_device=self.weights_device)

    def _resolve_warmup(self, params: SamplingParams) -> tuple[GenerateRequest, list[str]]:
        """`resolve` for a server warm-up's request, without the engine's Cache-DiT step mask: the request is resolved
        at the variant's default steps and then run at `WARMUP_STEPS` (`warmup_request`), and --cache-dit-config bins
        covering another step count stopped the start-up after the load. The mask only picks which steps may reuse
        the cache; the same blocks run."""
        engine = self.config.runtime.cache_dit_config
        if engine is not None and engine.uses_step_mask and params.cache_dit_params is None:
            params = dataclasses.replace(params, cache_dit_params={"scm_preset": "none"})  # replaces the whole mask
        return self._resolve_generate(params)

    def resolve(self, params: SamplingParams) -> tuple[GenerateRequest | UpscaleRequest, list[str]]:
        if self.variant.family == GENERATION:
            return self._resolve_generate(params)
        return resolve_upscale(params, self.variant)

    def _resolve_generate(self, params: SamplingParams) -> tuple[GenerateRequest, list[str]]:
        """`resolve` for a generation model (its callers have checked the family)."""
        return resolve_generate(params, self.variant, engine_cache_dit=self.config.runtime.cache_dit_config,
                                cache_dit_unavailable=self.config.parallel.cache_dit_unavailable,
                                has_audio=self.has_audio, streams_text_encoder=self.streams_text_encoder)

    def run(self, params: SamplingParams, output: OutputOptions,
            on_step: ProgressCallback | None = None) -> VideoResult:
        if self.memory_release.released:
            raise RuntimeError("this worker's memory is released: resume it before running a request")
        request, notes = self.resolve(params)
        for note in notes:
            # DEBUG: the notes travel with the result (the CLI prints them as "note:", the server's job shows them
            # as `warnings`); logged at WARNING too, the CLI showed each twice.
            logger.debug(note)
        if self._request_chooses_adapters(request):
            self._lora_manager().check_request(request.loras)  # before a warm-up: a refused request runs nothing
        warmup_s = None
        if self.config.runtime.warmup_mode == "request" and not self.warmed_up:
            warmup_s = self._warmup(params, on_step)
        start = time.perf_counter()
        # Before the pipeline, not after: the previous request's objects are gone by now, so only long-lived
        # ones (weights, compiled graphs) are frozen, never a finished request's arrays. Part of "total".
        gc_freeze_s = self.gc_freezer.freeze_if_compiled()
        graphs_before = compiled_graph_count()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        reset_peaks = getattr(getattr(self.pipeline, "residency", None), "reset_peaks", None)
        if reset_peaks is not None:  # the offloaded stages' peaks, counted from the same reset
            reset_peaks()
        # Both pipelines take a video sink (the generation pipeline is built without float frames for it), so a
        # saved MP4 is always encoded while the VAE decodes.
        with self._request_loras(request), self._naming_lora_strengths(request):
            if self.lora_manager is not None:
                self.lora_manager.prepare(self.device)  # dynamic adapters cast before the compiled blocks' first call
            if output.save_output:
                target, number_if_taken = output_file(request, output)
                result, written = generate_into_mp4(self.pipeline, request, target, on_step,
                                                    number_if_taken=number_if_taken)
                path = str(written)
            else:
                result = self.pipeline(request, on_step=on_step)
                path = None
        timings = dict(result.timings)
        if gc_freeze_s is not None:
            timings["gc_freeze"] = gc_freeze_s
        # Graphs dynamo compiled during this request: the cold one's compilation, and in a warm request a
        # recompilation that would otherwise only show as one slow step.
        timings["graphs_compiled"] = float(compiled_graph_count() - graphs_before)
        frames = result.video.frames_THWC
        audio = result.audio.waveform if result.audio is not None else None
        sample_rate = result.audio.sample_rate if result.audio is not None else 44100
        fps = result.fps
        timings["total"] = time.perf_counter() - start
        if warmup_s is not None:
            timings["warmup"] = warmup_s
        return VideoResult(
            output_file_path=path,
            frames=frames if output.return_frames else None,
            audio=audio if output.return_frames else None,
            audio_sample_rate=sample_rate,
            fps=float(fps),
            seed=request.seed,
            timings=timings,
            peak_memory_mb=peak_memory_mb(self.device),
            num_frames=int(frames.shape[0]),
            height=int(frames.shape[1]),
            width=int(frames.shape[2]),
            has_audio=audio is not None,
            notes=notes + result.notes,
            sample_aspect_ratio=getattr(result, "sample_aspect_ratio", None),  # SR only
            expanded_prompt=getattr(result, "expanded_prompt", None),  # generation with expand_prompts only
            prompt=request.prompt if isinstance(request, GenerateRequest) else None,
        )
