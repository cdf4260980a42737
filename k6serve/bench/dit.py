"""Stage `dit`: one DiT forward, ours (each attention backend, eager and with the speed transforms) vs
diffusers' `Kandinsky6Transformer3DModel` on the same random bf16 weights and inputs.

Memory: one full-size set of weights. Ours is built directly on the device (`build_dummy_transformer`);
diffusers' model shares those tensors (`reference.diffusers_transformer_like`) and is deleted before our
projections are fused (fusion allocates new, concatenated weights). Order: diffusers eager, diffusers
compiled (optional), ours eager per backend, ours fused + compiled per backend.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from k6serve.bench.flops import kandinsky6_forward_flops
from k6serve.bench.geometry import GenerationGeometry
from k6serve.bench.measure import cosine_similarity, measure
from k6serve.bench.reference import diffusers_transformer_like
from k6serve.bench.report import BenchRow
from k6serve.models.kandinsky6.checkpoint import build_dummy_transformer, load_transformer
from k6serve.models.kandinsky6.config import Kandinsky6TransformerConfig
from k6serve.models.kandinsky6.plan import kandinsky6_plan
from k6serve.ops import flash_attention4, fp8_attention
from k6serve.ops.attention import resolve_attention_backend
from k6serve.ops.rms_norm_rope import kernel_for
from k6serve.request import error_type_name
from k6serve.speed.fp8_linears import (
    FP8_LINEAR_SCOPES,
    apply_fp8_linears,
    set_fast_accumulation,
)
from k6serve.speed.fused_projections import apply_fused_norm_rope, apply_fused_projections
from k6serve.speed.regional_compile import apply_regional_compile, inductor_options, raise_recompile_limit

TIMESTEP = 500.0


@dataclass(frozen=True, kw_only=True, slots=True)
class DitOptions:
    label: str  # variant name shown in the table, e.g. "pro-distill"
    transformer_config: dict
    # A folder holding a DiT's config.json and safetensors (a checkpoint's transformer/): its weights instead of
    # random ones, e.g. to see what --fp8-linears does to the released model. The inputs stay random.
    weights_dir: Path | None = None
    geometry: GenerationGeometry
    device: torch.device
    dtype: torch.dtype
    backends: tuple[str, ...]  # attention backends to time ours with ("fa", "torch_sdpa")
    eager: bool = True  # ours without transforms
    speed: bool = True  # ours with fused projections + regional compile
    reference: bool = True  # diffusers eager
    reference_compiled: bool = False  # diffusers with compile_repeated_blocks(fullgraph=True)
    norm_rope_kernel: bool = False  # then ours fast again with the Triton RMSNorm + RoPE kernel of Q/K
    # then the last fast configuration once more with backend "fa_fp8" (ops/fp8_attention.py: lossy, opt-in)
    fp8_attention: bool = False
    # then the last fast configuration once more per entry with video-token GEMMs in e4m3 (speed/fp8_linears.py:
    # lossy, opt-in), each entry from the bf16 model: a scope ("ffn", "video"), optionally with patterns of linears
    # to keep in bf16 ("ffn:visual_transformer_blocks.[0-9]" keeps blocks 0-9's FFN, as
    # --quantization-ignored-layers does); then the last entry once more with cuBLASLt's fast accumulation when
    # `fp8_fast_accumulation`
    fp8_linears: tuple[str, ...] = ()
    fp8_fast_accumulation: bool = False
    # then the last bf16 fast configuration once more per entry with torch's preferred BLAS library set to it
    # ("cublaslt", "cublas"), in order, before any fp8 row: another GEMM kernel choice, whose energy per FLOP (the
    # forward is power-bound on the H200) may differ. The compiled graphs call aten's GEMMs, which read the setting
    # at each call: nothing recompiles. The library is put back after the rows.
    blas_libraries: tuple[str, ...] = ()
    compile_backend: str = "inductor"
    # torch.compile mode of our blocks; "max-autotune-no-cudagraphs" lets inductor time Triton GEMM templates
    # (which can fuse the FFN's GELU into the GEMM) against cuBLAS. None: torch's default.
    compile_mode: str | None = None
    repeats: int = 3
    warmup: int = 1
    seed: int = 0


def dit_inputs(
    config: Kandinsky6TransformerConfig,
    geometry: GenerationGeometry,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> dict[str, torch.Tensor]:
    """Random inputs of one sample at `geometry` (no text mask, timestep 500), diffusers' keyword names."""
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)

    return {
        "hidden_states": randn(
            1,
            geometry.num_latent_frames,
            geometry.latent_height,
            geometry.latent_width,
            config.visual_in_channels,
        ),
        "encoder_hidden_states": randn(1, geometry.num_text_tokens, config.in_text_dim),
        "pooled_projections": randn(1, config.in_text_dim2),
        "timestep": torch.tensor([TIMESTEP], device=device),
        "audio_hidden_states": randn(1, geometry.num_audio_tokens, config.in_audio_dim),
    }


class _Compared:
    """Our rows' cosine similarity to diffusers' video and audio velocities."""

    def __init__(self) -> None:
        self.video: torch.Tensor | None = None
        self.audio: torch.Tensor | None = None
        self.seconds: float | None = None

    def fill(self, row: BenchRow, output: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        row.reference_seconds = self.seconds
        if self.video is None:
            return
        video, audio = output
        row.cosine_video = cosine_similarity(video, self.video)
        if audio is not None and self.audio is not None:
            row.cosine_audio = cosine_similarity(audio, self.audio)


def _row(options: DitOptions, name: str, tflop: float) -> BenchRow:
    return BenchRow(
        stage="dit", name=name, config=f"{options.label} {options.geometry.label}", tflop=tflop
    )


def _timed(row: BenchRow, call, options: DitOptions):
    result = measure(call, device=options.device, repeats=options.repeats, warmup=options.warmup)
    return row.record(result)


def _time_reference(
    reference, inputs, options: DitOptions, rows: list[BenchRow], tflop: float, compared: _Compared
) -> None:
    def call():
        with torch.inference_mode():
            return reference(**inputs, return_dict=False)

    video, audio = _timed(rows[0], call, options)
    compared.video, compared.audio, compared.seconds = video, audio, rows[0].seconds
    rows[0].reference_seconds = rows[0].seconds
    if options.reference_compiled:
        rows.append(_row(options, "diffusers compiled", tflop))
        reference.compile_repeated_blocks(fullgraph=True, backend=options.compile_backend)
        rows[-1].breakdown_s["first_call"] = _first_call(call, options.device)
        compared.fill(rows[-1], _timed(rows[-1], call, options))
        torch._dynamo.reset()  # its graphs hold guards on the reference model's modules


def _run_reference(
    ours, inputs, options: DitOptions, tflop: float, compared: _Compared
) -> list[BenchRow]:
    """diffusers' rows; the reference model shares `ours`' weights and is dropped before returning."""
    rows = [_row(options, "diffusers eager", tflop)]
    reference: nn.Module | None
    try:
        reference = diffusers_transformer_like(ours, options.device)
        _time_reference(reference, inputs, options, rows, tflop, compared)
    except Exception as error:  # noqa: BLE001 (recorded in the row; our variants still run)
        rows[-1].error = f"{error_type_name(error)}: {error}"
    reference = None
    gc.collect()
    return rows


def _first_call(call, device: torch.device) -> float:
    """Seconds of one untimed-so-far call (compilation happens here)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _run_ours(
    ours, inputs, options: DitOptions, tflop: float, compared: _Compared, tag: str, compiled: bool
) -> list[BenchRow]:
    rows = []

    def call():
        with torch.inference_mode():
            return ours(**inputs)

    for backend in options.backends:
        row = _row(options, f"ours {backend} {tag}", tflop)
        rows.append(row)
        try:
            resolved = resolve_attention_backend(backend, options.device)
            ours.set_attention_backend(resolved)
            head_dim = ours.config.video_head_dim
            if resolved == "fa" and flash_attention4.wanted(head_dim):  # also 128 with $K6SERVE_FA4=1 or _TILES
                row.note = f"FlashAttention-4 ({head_dim}-wide video heads: ops/flash_attention4.py)"
            if resolved == "fa_fp8":
                row.note = (
                    f"FA3 e4m3 for attentions with >= {fp8_attention.MIN_KEYS} keys (per-head scales; "
                    "ops/fp8_attention.py)"
                )
            if compiled:
                row.breakdown_s["first_call"] = _first_call(call, options.device)
            compared.fill(row, _timed(row, call, options))
        except Exception as error:  # noqa: BLE001 (recorded in the row; the next backend still runs)
            row.error = f"{error_type_name(error)}: {error}"
    return rows


def parse_fp8_entry(entry: str) -> tuple[str, tuple[str, ...]]:
    """`--fp8-linears` entry "SCOPE" or "SCOPE:PATTERN[,PATTERN...]" -> (scope, patterns kept in bf16)."""
    scope, colon, patterns = entry.partition(":")
    if scope not in FP8_LINEAR_SCOPES:
        raise ValueError(f"an --fp8-linears entry is SCOPE or SCOPE:PATTERN[,PATTERN...] with SCOPE one of "
                         f"{', '.join(FP8_LINEAR_SCOPES)}, got {entry!r}")
    ignored = tuple(pattern for pattern in patterns.split(",") if pattern)
    if colon and not ignored:
        raise ValueError(f"--fp8-linears {entry!r}: give patterns after the colon, or drop it")
    return scope, ignored


def _linear_children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear]


def _last_fast_tag(options: DitOptions) -> str:
    """The tag of the last bf16 fast configuration, which the fp8 and BLAS-library rows time once more."""
    return "fused+compiled+norm_rope" if options.norm_rope_kernel else "fused+compiled"


def _run_blas_libraries(ours, inputs, options: DitOptions, tflop: float, compared: _Compared) -> list[BenchRow]:
    """The last bf16 fast configuration once more per `options.blas_libraries` entry (see DitOptions)."""
    rows: list[BenchRow] = []
    base = _last_fast_tag(options)
    before = torch.backends.cuda.preferred_blas_library()
    try:
        for library in options.blas_libraries:
            torch.backends.cuda.preferred_blas_library(library)
            library_rows = _run_ours(ours, inputs, options, tflop, compared, f"{base}+{library}", compiled=True)
            for row in library_rows:
                row.note = "; ".join(filter(None, (f"torch.backends.cuda.preferred_blas_library({library!r})",
                                                   row.note)))
            rows += library_rows
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    return rows


def _run_fp8_linears(ours, inputs, options: DitOptions, tflop: float, compared: _Compared) -> list[BenchRow]:
    """The fp8 rows, each entry converted from the bf16 model: the linears an entry swaps out stay on the device
    until the next entry puts them back (so an entry's peak memory counts them, but the last's does not). Dynamo's
    guards on the swapped modules recompile the blocks for each row (their first call is timed as `first_call`)."""
    # Every entry adds graph variants of the one block class: past dynamo's limit the blocks would run eager, timed.
    raise_recompile_limit(64)
    rows: list[BenchRow] = []
    base = _last_fast_tag(options)
    entries = list(options.fp8_linears)
    runs = [(entry, False) for entry in entries]
    if entries and options.fp8_fast_accumulation:
        runs.append((entries[-1], True))
    swapped: list[tuple[nn.Module, str, nn.Linear]] = []
    converted = 0
    for index, (entry, fast) in enumerate(runs):
        if fast:
            set_fast_accumulation(ours, True)
        else:
            for parent, name, linear in swapped:  # back to the bf16 model
                setattr(parent, name, linear)
            before = _linear_children(ours)
            scope, ignored = parse_fp8_entry(entry)
            converted = apply_fp8_linears(ours, scope, ignored_layers=ignored)
            last = index == len(entries) - 1
            swapped = [] if last else [(parent, name, linear) for parent, name, linear in before
                                       if getattr(parent, name) is not linear]
            del before
            gc.collect()
            if options.device.type == "cuda":
                torch.cuda.empty_cache()
        tag = f"{base}+fp8 {entry}" + (" fast-accum" if fast else "")
        scope_rows = _run_ours(ours, inputs, options, tflop, compared, tag, compiled=True)
        kept = "; peak counts the bf16 linears kept for the next entry" if swapped else ""
        for row in scope_rows:
            row.note = "; ".join(filter(None, (
                f"{converted} video-token linears in e4m3, row-wise scales (speed/fp8_linears.py; lossy){kept}",
                row.note)))
        rows += scope_rows
    return rows


def run_dit(options: DitOptions) -> list[BenchRow]:
    """All DiT rows for one variant: diffusers first (shared weights), then ours eager, then ours fast."""
    config = Kandinsky6TransformerConfig.from_json_dict(options.transformer_config)
    geometry = options.geometry
    tflop = 1e-12 * kandinsky6_forward_flops(
        config,
        num_video_tokens=geometry.num_video_tokens,
        num_audio_tokens=geometry.num_audio_tokens,
        num_text_tokens=geometry.num_text_tokens,
    )
    if options.weights_dir is not None:
        ours = load_transformer(options.weights_dir, device=options.device, dtype=options.dtype)
    else:
        ours = build_dummy_transformer(
            options.transformer_config, device=options.device, dtype=options.dtype, seed=options.seed
        )
    inputs = dit_inputs(
        config, geometry, device=options.device, dtype=options.dtype, seed=options.seed + 1
    )
    compared = _Compared()
    rows: list[BenchRow] = []
    if options.reference:
        rows += _run_reference(ours, inputs, options, tflop, compared)
    if options.eager:
        rows += _run_ours(ours, inputs, options, tflop, compared, "eager", compiled=False)
    if options.speed:
        num_fused = apply_fused_projections(ours)
        num_compiled = apply_regional_compile(
            ours, kandinsky6_plan(config), backend=options.compile_backend, mode=options.compile_mode
        )
        fast_rows = _run_ours(
            ours, inputs, options, tflop, compared, "fused+compiled", compiled=True
        )
        compiler = options.compile_backend + (f", {options.compile_mode}" if options.compile_mode else "")
        if inductor_options(options.compile_backend, options.compile_mode) is not None:
            compiler += ", deterministic"  # as speed mode compiles them (the environment leaves it to torch)
        for row in fast_rows:
            row.note = "; ".join(
                filter(None, (f"{num_fused} fused attentions, {num_compiled} compiled blocks ({compiler})", row.note))
            )
        rows += fast_rows
        if options.norm_rope_kernel:
            # The flag is read inside the compiled blocks: dynamo's guards on it recompile them for these rows.
            num_kernel = apply_fused_norm_rope(ours)
            kernel_rows = _run_ours(
                ours, inputs, options, tflop, compared, "fused+compiled+norm_rope", compiled=True
            )
            kernel_note = (
                f"Triton RMSNorm + RoPE ({kernel_for(config.video_head_dim)} kernel) on {num_kernel} attentions "
                "where it applies (CUDA, bf16)"
            )
            for row in kernel_rows:
                row.note = "; ".join(filter(None, (kernel_note, row.note)))
            rows += kernel_rows
        rows += _run_blas_libraries(ours, inputs, options, tflop, compared)
        if options.fp8_attention:
            # The backend is read inside the compiled blocks: dynamo recompiles them for this row.
            tag = _last_fast_tag(options)
            fp8_options = dataclasses.replace(options, backends=("fa_fp8",))
            rows += _run_ours(ours, inputs, fp8_options, tflop, compared, tag, compiled=True)
        rows += _run_fp8_linears(ours, inputs, options, tflop, compared)
    del ours, inputs, compared
    gc.collect()
    if options.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
