"""`k6serve generate`'s request, engine flags and output checked before the model loads (minutes for a real
checkpoint), each refusal in the flags' words."""

from __future__ import annotations

import sys
from typing import Any

from k6serve.config import EngineConfig, flag_name
from k6serve.engine_arguments import build_engine_config
from k6serve.models.variants import GENERATION
from k6serve.output_checks import check_output, unsaved_output_keys
from k6serve.request import FlagWorded, SamplingParams, note_for_cli
from k6serve.request_arguments import split_kwargs


def engine_variant_before_loading(engine_options: dict[str, Any]):
    """The variant the worker will recognise, where that needs no download, else None
    (`checkpoint_files.variant_before_loading`)."""
    from k6serve.models.checkpoint_files import variant_before_loading

    return variant_before_loading(engine_options["model_path"], engine_options.get("model_id"),
                                  engine_options.get("load_format"))[0]


def checked_engine_config(engine_options: dict[str, Any], variant) -> EngineConfig:
    """The engine options built and checked alone, without a request: a prompt file's run checks them once, before
    its lines, and `check_request_before_loading` with each request."""
    config = build_engine_config(**engine_options)
    if variant is not None and variant.family == GENERATION:
        from k6serve.caching.preflight import check_cache_dit_config_before_loading

        check_cache_dit_config_before_loading(config)  # named as --cache-dit-config, not as the request's params
    return config


def check_request_before_loading(engine_options: dict[str, Any], params: SamplingParams) -> None:
    """Resolve the one request against the model's variant, and open its input file, before the model loads
    (minutes for a real checkpoint): a --seed, --height or --num-inference-steps out of range, a flag of the other
    model family, an --sr-target-resolution with an odd side, Cache-DiT settings that leave no DiT block to cache,
    or a missing or unreadable --image-path / --video-path fails now with its fix, as it would after the load; so
    does a --video-path smaller than one super-resolution tile, or an upscale to a size that cannot be made, planned
    as the server plans a job at its creation. The worker resolves the request again; this only moves the refusal
    earlier."""
    variant = engine_variant_before_loading(engine_options)
    if variant is None:
        return
    config = checked_engine_config(engine_options, variant)
    try:
        _check_request(engine_options, params, variant, config)
    except FlagWorded as exc:
        # Chained, so --log-level debug still shows the rule that refused the request (request_resolution.py).
        raise ValueError(exc.flag_wording) from exc


def _check_request(engine_options: dict[str, Any], params: SamplingParams, variant, config: EngineConfig) -> None:
    """`check_request_before_loading`'s checks, in the request's own words (`FlagWorded` carries the flags')."""
    from k6serve.request_resolution import resolve_generate, resolve_upscale

    if variant.family == GENERATION:
        import torch

        from k6serve.models.kandinsky6.config_before_loading import (
            dit_blocks_before_loading,
            has_audio_before_loading,
        )
        from k6serve.offload.residency import streams_text_encoder

        # streams_text_encoder: --expand-prompts under a streamed text encoder was refused only once the model had
        # loaded (minutes on a GPU). --device cuda without a GPU is the worker's refusal to make (resolve_device).
        on_cuda = config.runtime.device in ("auto", "cuda") and torch.cuda.is_available()
        request, _ = resolve_generate(params, variant, engine_cache_dit=config.runtime.cache_dit_config,
                                      cache_dit_unavailable=config.parallel.cache_dit_unavailable,
                                      num_dit_blocks=dit_blocks_before_loading(config.model),
                                      streams_text_encoder=streams_text_encoder(
                                          config.runtime.residency_plan(super_resolution=False),
                                          "cuda" if on_cuda else "cpu"),
                                      has_audio=has_audio_before_loading(config.model))
        if request.image_path is not None:
            from k6serve.media.image import load_conditioning_image

            # log=False: the pipeline's own load of the image logs its colour conversion; this is only the check.
            load_conditioning_image(request.image_path, request.height, request.width, log=False)
    else:
        refuse_text_for_upscaling(params)
        upscale, _ = resolve_upscale(params, variant)
        from k6serve.media.container import open_input
        from k6serve.models.kandinsky6_sr.config_before_loading import sr_tiling_before_loading
        from k6serve.serve.upscale_output import expected_upscale_output

        open_input(upscale.video_path).close()
        expected_upscale_output(upscale, sr_tiling_before_loading(
            engine_options["model_path"], engine_options.get("model_id"), engine_options.get("load_format")))


def refuse_text_for_upscaling(params: SamplingParams) -> None:
    """--prompt / --negative-prompt with the super-resolution model: refused on the command line, as every other
    flag of the generation models is. The shared resolver only notes the prompt as ignored, for HTTP clients
    (OpenAI's SDK, ComfyUI) that send one with every video request; a flag typed for this run that does nothing
    is more likely a wrong --model-path."""
    given = [flag for flag, value in (("--prompt", params.prompt), ("--negative-prompt", params.negative_prompt))
             if value]
    if given:
        raise ValueError(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the generation "
                         "models; the super-resolution model upscales --video-path and takes no text: drop "
                         f"{' and '.join(given)}, or pass a generation checkpoint as --model-path.")


def checked_output_options(request_options: dict[str, Any], *, quiet: bool = False,
                           unsaved_by: str = "--no-save-output") -> dict[str, Any]:
    """Check the output before the model loads and say what will happen to it: a given name changed on its way to
    the file, or output flags that --no-save-output ignores. Returns the request with the name as it will be
    written and without the ignored flags, so the API does not warn about them again. `quiet`: the same flags
    checked again for another prompt of a --prompt-file-path (said once, for the first). `unsaved_by`: what turned
    saving off, as the user wrote it (`unsaved_by` in config_file.py)."""
    _, output = split_kwargs(request_options)
    try:
        output, warnings = check_output(output)
    except FlagWorded as exc:
        raise ValueError(exc.flag_wording) from exc  # --output-file-name, not the API's output_file_name
    for warning in warnings if not quiet else ():
        print(f"warning: {note_for_cli(warning)}", file=sys.stderr)
    if output.save_output:
        if output.output_file_name is None:
            return request_options
        return {**request_options, "output_file_name": output.output_file_name}
    if quiet:
        return {key: value for key, value in request_options.items()
                if key not in unsaved_output_keys(request_options)} | {"return_frames": False}
    drop = unsaved_by if unsaved_by.startswith("--") else "it from the file (or pass --save-output)"
    print(f"note: {unsaved_by}: the video is generated and then discarded; only the timings are printed. "
          f"Drop {drop} to write the MP4.", file=sys.stderr)
    ignored = unsaved_output_keys(request_options)
    if ignored:
        flags = " and ".join(flag_name(key) for key in ignored)
        print(f"warning: {flags} {'is' if len(ignored) == 1 else 'are'} ignored: {unsaved_by} writes no file.",
              file=sys.stderr)
    # The API returns the frames of a request without a file; the CLI would only hold them (GBs for an upscale).
    return {key: value for key, value in request_options.items() if key not in ignored} | {"return_frames": False}


def is_upscaler_before_loading(engine_options: dict[str, Any]) -> bool:
    variant = engine_variant_before_loading(engine_options)
    return variant is not None and variant.family != GENERATION
