"""Variant recognition and request resolution: defaults per variant and every bad-input message."""

import json
import re
import typing

import pytest

from k6serve.models.variants import SUPER_RESOLUTION, VARIANTS, recognise, variant_from_id
from k6serve.request import FIELD_NAMES, FLAG_NAMES, FlagWorded, SamplingParams, parse_size
from k6serve.request_refusals import MissingPrompt
from k6serve.request_resolution import DEFAULT_NEGATIVE_PROMPT, resolve_generate, resolve_upscale, seconds_to_num_frames


@pytest.mark.parametrize(
    "model_id, expected",
    [
        ("kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers", "pro"),
        ("kandinskylab/Kandinsky-6.0-Pro-sft-5s-Diffusers", "pro-sft"),
        ("kandinskylab/Kandinsky-6.0-Pro-pretrain-5s-Diffusers", "pro-pretrain"),
        ("kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers", "pro-distill"),
        ("kandinskylab/Kandinsky-6.0-Lite-5s-Diffusers", "lite"),
        ("kandinskylab/Kandinsky-6.0-Lite-pretrain-5s-Diffusers", "lite-pretrain"),
        ("Kandinsky-6.0-Lite-distill-5s-Diffusers", "lite-distill"),
        ("kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers", "vsr-distilled2steps"),
        ("kandinskylab/Kandinsky-6.0-VSR-5s-Diffusers", "vsr"),
        # The British spelling, or a missing l: it was read as the non-distilled model.
        ("kandinskylab/Kandinsky-6.0-Pro-distil-5s-Diffusers", "pro-distill"),
        ("Kandinsky-6.0-VSR-distil", "vsr-distilled2steps"),
    ],
)
def test_released_ids_are_recognised(model_id, expected):
    assert variant_from_id(model_id).name == expected


def test_hub_ids_in_the_table_round_trip():
    for variant in VARIANTS.values():
        assert variant_from_id(variant.hub_id).name == variant.name


def test_unknown_model_id_lists_known_ids():
    with pytest.raises(ValueError, match="names no known Kandinsky 6 checkpoint.*Pro-distill"):
        recognise("/tmp/x", "some-other-model", None)


def test_renamed_folder_routes_by_model_index(tmp_path):
    folder = tmp_path / "my-model"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps(
        {"_class_name": "Kandinsky6TI2VAPipeline", "scheduler": ["diffusers", "PiflowScheduler"]}))
    (folder / "transformer" / "config.json").write_text(json.dumps({"model_dim": 1792}))
    assert recognise(str(folder), None, folder).name == "lite-distill"
    # --model-id wins over the size guessed from the transformer's width
    assert recognise(str(folder), "Kandinsky-6.0-Pro-distill-5s-Diffusers", folder).name == "pro-distill"


def _generation_folder(folder, *, distilled, model_dim):
    (folder / "transformer").mkdir(parents=True)
    scheduler = "PiflowScheduler" if distilled else "FlowMatchEulerDiscreteScheduler"
    (folder / "model_index.json").write_text(json.dumps(
        {"_class_name": "Kandinsky6TI2VAPipeline", "scheduler": ["diffusers", scheduler]}))
    (folder / "transformer" / "config.json").write_text(json.dumps({"model_dim": model_dim}))
    return folder


@pytest.mark.parametrize("relative", ["projects/kandinsky6/run1", "Kandinsky-6.0-Pro-5s-Diffusers (copy)",
                                      "Kandinsky-6.0-Lite-distill-5s-Diffusers"])
def test_a_folder_is_what_its_files_say_whatever_its_path_is_named(tmp_path, caplog, relative):
    """The name was matched anywhere in the path and won over the files: a distilled checkpoint under
    ".../projects/kandinsky6/" ("pro" in "projects"), or copied into a folder named after Pro, ran CFG and 50 steps
    (5x the work, another sampler) with no word; a Pro one named as Lite was served as Lite."""
    folder = _generation_folder(tmp_path / relative, distilled=True, model_dim=4096)
    with caplog.at_level("WARNING", logger="k6serve.models.variants"):
        variant = recognise(str(folder), None, folder)
    assert (variant.name, variant.num_inference_steps, variant.guidance_scale) == ("pro-distill", 10, 1.0)
    named = variant_from_id(folder.name)  # a word of a parent folder ("projects") is no claim to warn of
    if named is not None and named.name != "pro-distill":
        assert caplog.text.count(f"is named as {named.name}, but its model_index.json and transformer config say "
                                 "pro-distill; serving it as pro-distill") == 1
        recognise(str(folder), None, folder)  # recognised again by the next check: said once per process
        assert caplog.text.count("is named as") == 1
    else:
        assert "is named as" not in caplog.text


@pytest.mark.parametrize(("relative", "model_dim", "distilled", "expected"), [
    # Releases with the same files: the name tells them apart.
    ("Kandinsky-6.0-Pro-sft-5s-Diffusers", 4096, False, "pro-sft"),
    ("Kandinsky-6.0-Lite-pretrain-5s-Diffusers", 1792, False, "lite-pretrain"),
    # A hub cache snapshot is named by its commit; the repo's name is two levels up.
    ("models--kandinskylab--Kandinsky-6.0-Pro-pretrain-5s-Diffusers/snapshots/0123abcd", 4096, False, "pro-pretrain"),
])
def test_the_name_labels_a_folder_whose_files_agree(tmp_path, caplog, relative, model_dim, distilled, expected):
    folder = _generation_folder(tmp_path / relative, distilled=distilled, model_dim=model_dim)
    with caplog.at_level("WARNING", logger="k6serve.models.variants"):
        assert recognise(str(folder), None, folder).name == expected
    assert "is named as" not in caplog.text


def test_a_released_name_routes_a_folder_whose_files_name_no_kandinsky_pipeline(tmp_path):
    folder = tmp_path / "Kandinsky-6.0-Lite-5s-Diffusers"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "MyRenamedPipeline"}))
    assert recognise(str(folder), None, folder).name == "lite"


@pytest.mark.parametrize(
    ("pipeline", "scheduler", "model_id", "message"),
    [
        # A distilled folder run as Pro would get CFG 5 and 50 steps without a word.
        ("Kandinsky6TI2VAPipeline", "PiflowScheduler", "Kandinsky-6.0-Pro-5s-Diffusers",
         "names pro, a non-distilled generation checkpoint, but .* is a distilled generation checkpoint"),
        ("Kandinsky6TI2VAPipeline", "FlowMatchEulerDiscreteScheduler", "Kandinsky-6.0-Lite-distill-5s-Diffusers",
         "names lite-distill, a distilled generation checkpoint, but .* is a non-distilled generation checkpoint"),
        # Otherwise: "lacks component(s) [...]. Re-download the full repository", the wrong fix.
        ("Kandinsky6SRPipeline", "PiflowScheduler", "Kandinsky-6.0-Pro-distill-5s-Diffusers",
         "names pro-distill, a distilled generation checkpoint, but .* is a super-resolution checkpoint"),
    ],
)
def test_model_id_contradicting_the_folder_is_refused(tmp_path, pipeline, scheduler, model_id, message):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline,
                                                           "scheduler": ["diffusers", scheduler]}))
    with pytest.raises(ValueError, match=message + ".*drop --model-id"):
        recognise(str(tmp_path), model_id, tmp_path)


def test_model_id_routes_a_folder_whose_files_name_no_kandinsky_pipeline(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "MyRenamedPipeline"}))
    assert recognise(str(tmp_path), "Kandinsky-6.0-Lite-5s-Diffusers", tmp_path).name == "lite"


def test_model_id_keeps_super_resolution_routing_for_a_renamed_folder(tmp_path):
    """The seed: "For a renamed local checkpoint, pass --model-id Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers to
    retain SR routing"."""
    folder = tmp_path / "my-upscaler"
    folder.mkdir()
    index = folder / "model_index.json"
    index.write_text(json.dumps({"_class_name": "MyRenamedPipeline", "scheduler": ["diffusers", "PiflowScheduler"]}))
    with pytest.raises(ValueError, match="pass --model-id with the original name"):
        recognise(str(folder), None, folder)
    routed = recognise(str(folder), "Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers", folder)
    assert (routed.name, routed.family, routed.num_inference_steps) == ("vsr-distilled2steps", SUPER_RESOLUTION, 2)
    # Files that still name the SR pipeline route the renamed folder by themselves; the flag agrees with them.
    index.write_text(json.dumps({"_class_name": "Kandinsky6SRPipeline", "scheduler": ["diffusers", "PiflowScheduler"]}))
    assert recognise(str(folder), None, folder).name == "vsr-distilled2steps"
    assert recognise(str(folder), "Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers", folder).name == \
        "vsr-distilled2steps"


def test_folder_without_model_index_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no model_index.json"):
        recognise(str(tmp_path), None, tmp_path)


def test_generation_defaults_per_variant():
    pro, _ = resolve_generate(SamplingParams(prompt="a cat"), VARIANTS["pro"])
    assert (pro.height, pro.width, pro.num_frames, pro.fps) == (512, 768, 121, 24.0)
    assert (pro.num_inference_steps, pro.guidance_scale, pro.seed) == (50, 5.0, 42)
    assert pro.negative_prompt == DEFAULT_NEGATIVE_PROMPT
    distill, _ = resolve_generate(SamplingParams(prompt="a cat"), VARIANTS["pro-distill"])
    assert (distill.num_inference_steps, distill.guidance_scale, distill.negative_prompt) == (10, 1.0, None)


def test_an_empty_negative_prompt_takes_the_built_in_one_as_the_reference():
    """diffusers encodes `negative_prompt or default`: a blank form or UI field ("") runs CFG against the built-in
    negative prompt, not against an encoded empty string. Any other text, even blank, is the user's."""
    empty, notes = resolve_generate(SamplingParams(prompt="a cat", negative_prompt=""), VARIANTS["pro"])
    assert empty.negative_prompt == DEFAULT_NEGATIVE_PROMPT and notes == []
    # Spaces are encoded as written, as diffusers' `negative_prompt or default` does, with a note (a blank form field
    # that sends spaces means the built-in one).
    spaces, notes = resolve_generate(SamplingParams(prompt="a cat", negative_prompt=" "), VARIANTS["pro"])
    assert spaces.negative_prompt == " "
    assert notes == ["negative_prompt ' ' has no visible character and is encoded as written; send an empty one, or "
                     "leave it out, for the model's built-in negative prompt."]
    _, notes = resolve_generate(SamplingParams(prompt="a cat", negative_prompt=" blurry "), VARIANTS["pro"])
    assert notes == []


@pytest.mark.parametrize("prompt", ["\ufeff", "\u200b\u200b", " \u200b\n", "\x00", "\u2060", "\u3164", "\u2800 "])
def test_a_prompt_with_no_visible_character_is_refused_as_empty(prompt):
    # A byte-order mark or zero-width space alone ran as a prompt while "   " was refused.
    with pytest.raises(MissingPrompt) as refused:
        resolve_generate(SamplingParams(prompt=prompt), VARIANTS["pro"])
    assert str(refused.value).startswith("prompt is required for Kandinsky 6 generation (e.g. --prompt 'A cat plays "
                                         f"piano'). The prompt given, {ascii(prompt)}, has no visible character: ")
    assert refused.value.detail and str(refused.value).endswith(refused.value.detail)
    with pytest.raises(MissingPrompt) as refused:
        resolve_generate(SamplingParams(prompt="  "), VARIANTS["pro"])
    assert refused.value.detail == ""


@pytest.mark.parametrize("prompt", ["\u200bcat", "\U0001f408", "\u0301", "\u00a0a"])
def test_a_prompt_with_a_visible_character_is_taken_verbatim(prompt):
    request, _ = resolve_generate(SamplingParams(prompt=prompt), VARIANTS["pro"])
    assert request.prompt == prompt


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_image_path_is_refused_as_empty(path):
    # Path("") is ".": the message was "cannot read conditioning image '.': it is a directory".
    with pytest.raises(ValueError, match=r"^image_path is empty: pass an image file's path, or leave it out to "
                                         r"generate from the prompt alone\.$"):
        resolve_generate(SamplingParams(prompt="a", image_path=path), VARIANTS["pro"])


def test_distilled_rejects_guidance():
    with pytest.raises(ValueError, match="requires guidance_scale exactly 1.0"):
        resolve_generate(SamplingParams(prompt="a", guidance_scale=5.0), VARIANTS["pro-distill"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": ""}, "prompt is required"),
        ({"prompt": "a", "height": 500}, "height must be a positive multiple of 16"),
        ({"prompt": "a", "height": 0}, "height must be a positive multiple of 16"),  # 0 and -16 are multiples of 16
        ({"prompt": "a" * 32_769}, r"^prompt has 32,769 characters; at most 32,768 are taken"),
        ({"prompt": "a", "negative_prompt": "b" * 40_000}, r"^negative_prompt has 40,000 characters"),
        ({"prompt": "a", "width": -16}, "width must be a positive multiple of 16"),
        ({"prompt": "a", "width": 4096}, "width must be at most 2048"),
        # The two valid sizes around a bad one; above the limit the limit is what is said, not 2992 and 3008.
        ({"prompt": "a", "width": 2040}, r"got 2040 \(the nearest are 2032 and 2048\)\.$"),
        ({"prompt": "a", "height": 8}, r"got 8 \(16 is the smallest\)\.$"),
        ({"prompt": "a", "width": -16}, r"got -16 \(16 is the smallest\)\.$"),
        ({"prompt": "a", "width": 3000},
         r"^width must be at most 2048 \(the DiT's 128 RoPE positions x 16 px\), got 3000\.$"),
        ({"prompt": "a", "num_frames": 0}, "num_frames must be >= 1"),
        ({"prompt": "a", "fps": 0.0}, "fps must be between 1 and 240"),
        ({"prompt": "a", "fps": 0.5}, "audio length"),
        ({"prompt": "a", "num_inference_steps": 0}, "num_inference_steps must be between"),
        ({"prompt": "a", "guidance_scale": 0.5}, "guidance_scale must be >= 1.0"),
        ({"prompt": "a", "seed": -2}, "seed must be an integer"),
        ({"prompt": "a", "video_path": "x.mp4"}, "video_path is for the super-resolution model"),
        ({"prompt": "a", "sr_resolution_scale": 2.0}, "applies to the super-resolution model only"),
    ],
)
def test_generation_bad_inputs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_generate(SamplingParams(**kwargs), VARIANTS["pro"])


@pytest.mark.parametrize(
    ("variant", "kwargs", "api", "cli"),
    [
        ("pro", {"height": 500}, "height must be a positive multiple of 16 (VAE 8x times patch 2), got 500 (the nearest are 496 and 512).",
         "--height must be a positive multiple of 16 (VAE 8x times patch 2), got 500 (the nearest are 496 and 512)."),
        ("pro", {"num_frames": 600}, "num_frames 600 gives more than 128 latent frames; use at most 509.",
         "--num-frames 600 gives more than 128 latent frames; use at most 509."),
        ("pro", {"max_sequence_length": 0}, "max_sequence_length must be between 1 and 1024 (prompt tokens the model "
         "reads), got 0", "--max-sequence-length must be between 1 and 1024 (prompt tokens the model reads), got 0"),
        ("pro", {"num_frames": 49, "fps": 1}, "num_frames 49 at fps 1 is 49.0 s of audio, longer than the model's "
         "audio positions allow (47.6 s: 2048 latents, this clip needs 2111); raise fps to at least 1.04, lower "
         "num_frames to at most 45, or make a silent video (sample_audio false).",
         "--num-frames 49 at --fps 1 is 49.0 s of audio, longer than the model's audio positions allow (47.6 s: 2048 "
         "latents, this clip needs 2111); raise --fps to at least 1.04, lower --num-frames to at most 45, or make a "
         "silent video (--no-sample-audio)."),
        ("pro", {"sr_target_resize_mode": "exact"}, "sr_target_resize_mode applies to the super-resolution model "
         "only, not to pro; drop it, or load kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers to upscale a "
         "video.", "--sr-target-resize-mode applies to the super-resolution model only, not to pro; drop it, or load "
         "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers to upscale a video."),
        ("vsr-distilled2steps", {"sr_resolution_scale": 3.0}, "sr_resolution_scale must be 2, 4 or 2.25, got 3.0",
         "--sr-resolution-scale must be 2, 4 or 2.25, got 3.0"),
        ("vsr-distilled2steps", {"sr_target_resolution": "101x100"}, "sr_target_resolution '101x100' has an odd "
         "side; H.264 needs even width and height: use 102x100 or 100x100.", "--sr-target-resolution '101x100' has "
         "an odd side; H.264 needs even width and height: use 102x100 or 100x100."),
        ("vsr-distilled2steps", {"sr_target_resize_mode": "exact"}, "sr_target_resize_mode only says how to reach "
         "sr_target_resolution, and none was given; pass sr_target_resolution (hd, fullhd, 2k or WxH) as well, or "
         "drop sr_target_resize_mode.", "--sr-target-resize-mode only says how to reach --sr-target-resolution, and "
         "none was given; pass --sr-target-resolution (hd, fullhd, 2k or WxH) as well, or drop "
         "--sr-target-resize-mode."),
        ("vsr-distilled2steps", {"image_path": "a.png"}, "image_path is not used by the super-resolution model; pass "
         "video_path only.", "--image-path is not used by the super-resolution model; pass --video-path only."),
        # A boolean field is named by the flag typed: --no-sample-audio, not the --sample-audio it turns off.
        ("vsr-distilled2steps", {"sample_audio": False}, "sample_audio applies to the generation models; "
         "super-resolution keeps the source video's own soundtrack (a source without one gives a silent video). "
         "Drop sample_audio.", "--no-sample-audio applies to the generation models; super-resolution keeps the "
         "source video's own soundtrack (a source without one gives a silent video). Drop --no-sample-audio."),
        ("vsr-distilled2steps", {"seed": 2**63}, f"seed must be an integer in [0, 2**63), or -1 for a seed drawn for "
         f"the request, got {2**63}", f"--seed must be an integer in [0, 2**63), or -1 for a seed drawn for the "
         f"request, got {2**63}"),
    ],
)
def test_refusals_name_the_fields_for_the_api_and_the_flags_for_the_cli(variant, kwargs, api, cli):
    """The Python API and the HTTP server keep the fields' names; `k6serve generate` prints `flag_wording`, the same
    refusal in its flags (a user who typed --sr-resolution-scale was told of sr_resolution_scale)."""
    variant = VARIANTS[variant]
    if variant.family == SUPER_RESOLUTION:
        def resolve():
            return resolve_upscale(SamplingParams(video_path="a.mp4", **kwargs), variant)
    else:
        def resolve():
            return resolve_generate(SamplingParams(prompt="a", **kwargs), variant)
    with pytest.raises(FlagWorded) as refused:
        resolve()
    assert (str(refused.value), refused.value.flag_wording) == (api, cli)


def test_flag_names_are_the_generate_commands_flags():
    """FLAG_NAMES spells a field's flag as the CLI builds it: a field whose flag were spelled otherwise would be
    named by a flag that does not exist."""
    from k6serve.cli.flags import build_parser
    from k6serve.request import parameter_fields

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    options = {option for action in generate._actions for option in action.option_strings}
    hints = typing.get_type_hints(SamplingParams)
    for field in parameter_fields(surface="cli"):
        assert FLAG_NAMES(field.name) in options, field.name
        if bool in typing.get_args(hints[field.name]):
            assert FLAG_NAMES(field.name, False) in options, field.name
    assert (FIELD_NAMES.set_to("sample_audio", False), FLAG_NAMES.set_to("sample_audio", False)) == (
        "sample_audio false", "--no-sample-audio")


def test_the_largest_and_smallest_values_each_limit_allows_resolve():
    """The limits were tested from the refused side only: an off-by-one that refused the largest valid value
    (2048 pixels, 240 fps, 1,000 steps, a soundtrack of exactly 2,048 latents) or one frame passed the suite."""
    cases = [({"height": 2048, "width": 2048}, {"height": 2048, "width": 2048}),
             ({"fps": 240.0}, {"fps": 240.0}),
             ({"num_inference_steps": 1000}, {"num_inference_steps": 1000}),
             ({"num_frames": 1}, {"num_frames": 1}),
             ({"num_frames": 97, "fps": 2.04}, {"num_frames": 97, "fps": 2.04})]  # 97 / 2.04 s: 2,048 audio latents
    for given, resolved in cases:
        request, _ = resolve_generate(SamplingParams(prompt="a", **given), VARIANTS["pro"])
        assert {name: getattr(request, name) for name in resolved} == resolved, given


def test_frames_follow_the_reference_rounding_with_a_note():
    request, notes = resolve_generate(SamplingParams(prompt="a", num_frames=119), VARIANTS["pro"])
    assert request.num_frames == 117 and "using 117" in notes[0]
    request, _ = resolve_generate(SamplingParams(prompt="a", num_frames=120), VARIANTS["pro"])
    assert request.num_frames == 121  # n // 4 * 4 + 1, exactly as diffusers


def test_seconds_map_onto_the_frame_rule():
    assert seconds_to_num_frames(5, 24) == 121  # 120 frames -> 121
    assert seconds_to_num_frames(1, 24) == 25


def test_sr_defaults_and_errors():
    request, notes = resolve_upscale(SamplingParams(video_path="in.mp4", num_inference_steps=4),
                                     VARIANTS["vsr-distilled2steps"])
    assert (request.scale, request.tiles_batch_size, request.tile_min_overlap, request.seed) == (2.25, 1, 0.2, 42)
    assert request.target_resize_mode == "fit" and "always runs 2 DiT calls" in notes[0]
    for kwargs, message in [
        ({}, "needs exactly one source video"),
        ({"video_path": "a.mp4", "sr_resolution_scale": 3.0}, "must be 2, 4 or 2.25"),
        ({"video_path": "a.mp4", "sr_tile_min_overlap": 1.0}, r"must be in \[0, 1\)"),
        ({"video_path": "a.mp4", "sr_tiles_batch_size": 0}, "integer from 1 to 64"),
        ({"video_path": "a.mp4", "sr_target_resolution": "4k"}, "hd, fullhd, 2k or 'WxH'"),
        # Full-width digits: `size` refuses them; this was read as 640x96.
        ({"video_path": "a.mp4", "sr_target_resolution": "\uff16\uff14\uff10x96"}, "hd, fullhd, 2k or 'WxH'"),
        ({"video_path": "a.mp4", "sr_target_resize_mode": "stretch"}, "'fit' or 'exact'"),
        ({"video_path": "a.mp4", "height": 512}, "taken from the source video"),
        # ignored by the SR model, but an HTTP job stores it
        ({"video_path": "a.mp4", "prompt": "x" * 40_000}, r"^prompt has 40,000 characters; at most 32,768"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_upscale(SamplingParams(**kwargs), VARIANTS["vsr-distilled2steps"])


def test_an_empty_sr_source_path_is_told_as_empty():
    # `--video-path "$CLIP"` with CLIP unset (or upscale("")) was told "pass --video-path /path/to/input.mp4", the
    # refusal of a request without one; "  " was looked for as a file named two spaces.
    for path in ("", "  "):
        with pytest.raises(FlagWorded) as refused:
            resolve_upscale(SamplingParams(video_path=path), VARIANTS["vsr-distilled2steps"])
        assert str(refused.value) == "video_path is empty: pass the source video file's path (e.g. input.mp4)."
        assert refused.value.flag_wording.startswith("--video-path is empty: ")


def test_sr_refuses_a_length_or_frame_rate_with_the_way_to_get_it():
    # Each was told to "use sr_resolution_scale and sr_target_resolution to choose the output size", which sets
    # neither a clip's length nor its frame rate; over HTTP `seconds` read the same.
    from k6serve.serve.errors import ApiError
    from k6serve.serve.video_create_body import VideoCreateBody, to_sampling_params

    sr = VARIANTS["vsr-distilled2steps"]
    cut = (r"the upscale takes up to 121 frames from the source's start \(5 s at 24 fps\), at the rate the 24 fps "
           r"rule sets, floored to 1 \+ 8k\. For another part or a shorter clip, cut the source first \(FFmpeg: "
           r"ffmpeg -ss START -i IN -t SECONDS OUT\), and drop ")
    convert = (r"the output keeps the source's frame rate rounded to a whole number, and a source of 25\.5 fps or "
               r"more is subsampled to 24 fps\. For another rate, convert the source first \(FFmpeg: ffmpeg -i IN "
               r"-vf fps=N -c:a copy OUT\), and drop ")
    for field, value, flag, fix in (("num_frames", 9, "--num-frames", cut), ("fps", 30, "--fps", convert)):
        with pytest.raises(FlagWorded) as refused:
            resolve_upscale(SamplingParams(video_path="a.mp4", **{field: value}), sr)
        taken = "{} is taken from the source video in super-resolution; "
        assert re.fullmatch(taken.format(field) + fix + field + r"\.", str(refused.value))
        assert re.fullmatch(taken.format(flag) + fix + flag + r"\.", refused.value.flag_wording)
    with pytest.raises(FlagWorded, match="use sr_resolution_scale and sr_target_resolution to choose the output size"):
        resolve_upscale(SamplingParams(video_path="a.mp4", height=64), sr)
    with pytest.raises(ApiError) as refused:
        to_sampling_params(VideoCreateBody(video_path="a.mp4", seconds="4"), sr, served_names=("demo-sr",))
    assert re.fullmatch(r"seconds is taken from the source video in super-resolution; " + cut + r"seconds\.",
                        refused.value.message)


def test_openai_size_is_width_first():
    assert parse_size("768x512") == (512, 768)
    with pytest.raises(ValueError, match="width first"):
        parse_size("768*512")


def test_unknown_sampling_parameter_lists_valid_ones():
    with pytest.raises(ValueError, match="Unknown sampling parameter.*'prompt'"):
        SamplingParams.from_kwargs({"promt": "typo"})


def test_a_soundtrack_longer_than_the_audio_positions_is_refused_with_the_request():
    # 509 frames at 10 fps is 50.9 s of audio, 2193 latents: the DiT's audio RoPE table holds 2048, and the worker
    # refused it only after the text encoders ran ("reduce the input size"). Refused here, with what fits.
    with pytest.raises(ValueError, match=r"num_frames 509 at fps 10 is 50\.9 s of audio.*2048 latents, this clip "
                                         r"needs 2193.*fps to at least 10\.71, lower num_frames to at most 473, "
                                         r"or make a silent video"):
        resolve_generate(SamplingParams(prompt="a", num_frames=509, fps=10), VARIANTS["pro"])
    # At the bounds it names, and at 1 fps with a short clip, the request resolves.
    for num_frames, fps in ((509, 10.71), (473, 10), (45, 1), (509, 24)):
        request, _ = resolve_generate(SamplingParams(prompt="a", num_frames=num_frames, fps=fps), VARIANTS["pro"])
        assert (request.num_frames, request.fps) == (num_frames, fps)
    with pytest.raises(ValueError, match="lower num_frames to at most 45"):
        resolve_generate(SamplingParams(prompt="a", num_frames=49, fps=1), VARIANTS["pro"])
    # Just past the bound, the two lengths get the decimals that tell them apart (both read "47.6 s" before).
    with pytest.raises(ValueError, match=r"at fps 10\.7 is 47\.57 s of audio, longer than the model's audio "
                                         r"positions allow \(47\.55 s: 2048 latents, this clip needs 2049\)"):
        resolve_generate(SamplingParams(prompt="a", num_frames=509, fps=10.7), VARIANTS["pro"])


def test_the_audio_bound_is_the_pipelines_length_and_the_models_rope_table():
    from k6serve import request_resolution
    from k6serve.models.common.rope import MAX_SEQUENCE_POSITIONS
    from k6serve.pipelines.prepare_latents import audio_latent_length
    from k6serve.testing.tiny_checkpoints import ensure_demo_checkpoint

    assert request_resolution.AUDIO_MAX_POSITIONS == MAX_SEQUENCE_POSITIONS
    audio_vae = json.loads((ensure_demo_checkpoint() / "audio_vae" / "config.json").read_text())
    assert audio_vae["sample_rate"] == request_resolution.AUDIO_SAMPLE_RATE
    assert 2 * audio_vae["hop_length"] == request_resolution.AUDIO_LATENT_HOP_LENGTH  # MMAudioVAE.latent_hop_length
    # The largest clip the check lets through is exactly the pipeline's longest audio that fits the table.
    request, _ = resolve_generate(SamplingParams(prompt="a", num_frames=473, fps=10), VARIANTS["pro"])
    length = audio_latent_length(request.num_latent_frames, request.fps, request_resolution.AUDIO_SAMPLE_RATE,
                                 request_resolution.AUDIO_LATENT_HOP_LENGTH)
    assert length <= MAX_SEQUENCE_POSITIONS < audio_latent_length(128, 10, request_resolution.AUDIO_SAMPLE_RATE,
                                                                  request_resolution.AUDIO_LATENT_HOP_LENGTH)


@pytest.mark.parametrize(("option", "message"), [
    ({"fps": 10**400}, r"^fps must be between 1 and 240 .*got 1000"),
    ({"fps": -10**400}, r"^fps must be between 1 and 240 .*got -1000"),
    ({"guidance_scale": 10**400}, r"requires guidance_scale exactly 1\.0 \(got an integer too large for a float\)"),
    ({"guidance_scale": -10**400}, r"requires guidance_scale exactly 1\.0 \(got an integer too large for a float\)"),
    ({"loras": {"style": 10**400}}, r"^loras\['style'\] must be a finite number"),
])
def test_an_integer_past_floats_range_is_a_value_error(option, message):
    """Python and JSON integers have no size limit; float() and math.isfinite raised OverflowError on 10**400, which
    reached the user as an internal error (a 500 over HTTP) instead of the option's own refusal."""
    with pytest.raises(ValueError, match=message):
        resolve_generate(SamplingParams(prompt="x", **option), VARIANTS["lite-distill"])


def test_the_demo_under_load_format_dummy_is_told_to_drop_the_flag():
    """It was "Cannot tell which Kandinsky 6 model 'demo' is. Pass --model-id", as for an unknown name."""
    for name in ("demo", "demo-sr"):
        with pytest.raises(ValueError, match=rf"^--load-format dummy builds a released model .* and '{name}' names "
                                             r"none: it is a tiny random-weight checkpoint already\. Drop "
                                             r"--load-format dummy"):
            recognise(name, None, None)
    assert recognise("demo", "Kandinsky-6.0-Lite-distill-5s-Diffusers", None).name == "lite-distill"
