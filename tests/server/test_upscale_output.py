"""`expected_upscale_output`: an upscale job's size and seconds at creation, from the SR pipeline's own sizes."""

from __future__ import annotations

import pytest

from k6serve.request import UpscaleRequest
from k6serve.serve.upscale_output import SourceUnusable, expected_upscale_output
from k6serve.testing.clips import make_clip


def _request(scale: float, target: str | None = None, mode: str = "fit", video_path: str = "unused.mp4"):
    return UpscaleRequest(video_path=video_path, scale=scale, tiles_batch_size=1, tile_min_overlap=0.2,
                          target_resolution=target, target_resize_mode=mode, seed=42, requested_steps=None)


def test_sizes_that_cannot_be_made_and_unreadable_sources_raise(tmp_path):
    clip = make_clip(tmp_path / "clip.mp4", width=32, height=32, num_frames=9, fps=24)
    assert expected_upscale_output(_request(2, video_path=str(clip))).size == "64x64"
    # The worker's own refusals (`upscale_sizes`), now raised when the job is created.
    with pytest.raises(ValueError, match="upscaled result, and target resolutions only downscale"):
        expected_upscale_output(_request(4, "hd", "exact", video_path=str(clip)))
    wide = make_clip(tmp_path / "wide.mp4", width=4128, height=16, num_frames=1, fps=24)
    with pytest.raises(ValueError, match=r"would be 16512x64, but H.264 frames are at most 16384"):
        expected_upscale_output(_request(4, video_path=str(wide)))
    # A file the reader refuses: its message, raised at creation (the worker would fail the job with it).
    not_a_video = tmp_path / "broken.mp4"
    not_a_video.write_bytes(b"\0" * 64)
    with pytest.raises(SourceUnusable, match=r"broken\.mp4': it is not a readable video"):
        expected_upscale_output(_request(2, video_path=str(not_a_video)))


def test_an_exact_target_that_stretches_the_picture_is_a_note_from_creation_on(tmp_path):
    """'exact' delivers the target bucket even where its aspect ratio differs from the result's: that was a log line
    of the worker's, which no user saw. It is now a note of the plan, which the job shows from creation on."""
    from k6serve.pipelines.sr_plan import upscale_sizes

    clip = make_clip(tmp_path / "clip.mp4", width=256, height=192, num_frames=9, fps=24)
    stretched = expected_upscale_output(_request(4, "640x360", "exact", video_path=str(clip)))
    assert stretched.size == "640x360"
    assert stretched.notes == ("sr_target_resolution '640x360' with the 'exact' resize mode stretches the 1024x768 "
                               "upscaled result to 640x360, changing its aspect ratio; use sr_target_resize_mode "
                               "'fit' to keep it.",)
    assert upscale_sizes((192, 256), _request(4, "640x480", "exact")).notes == ()  # the same aspect ratio
    assert upscale_sizes((192, 256), _request(4, "640x360", "fit")).notes == ()  # fit scales both sides alike


def test_the_x2_25_pre_upscale_that_changes_the_aspect_ratio_or_the_scale_is_a_note():
    """x2.25 enlarges the source x1.125 with each side rounded to a multiple of 16 (the reference's rule, kept): a
    96x64 source becomes 112x64, a 17% stretch of what comes out (224x128), and a 32x32 one stays 32x32 (x2 in
    all), which nothing said."""
    from k6serve.pipelines.sr_plan import upscale_sizes

    stretched = upscale_sizes((64, 96), _request(2.25))
    assert (stretched.input_size, stretched.delivery_size) == ((64, 112), (128, 224))
    assert stretched.notes == ("the x2.25 scale first enlarges the 96x64 source x1.125 with each side rounded to a "
                               "multiple of 16, to 112x64, changing its aspect ratio (1.5 -> 1.75); use "
                               "sr_resolution_scale 2 or 4 to keep it.",)
    assert upscale_sizes((512, 768), _request(2.25)).notes == ()  # 576x864 exactly: the released clips' size
    assert upscale_sizes((64, 96), _request(2)).notes == ()  # no pre-upscale
    # Within 2% (the target stretch's bound): 100x200 -> 112x224 keeps 2.0, and is x2.24.
    assert upscale_sizes((100, 200), _request(2.25)).notes == ()
    # A square source whose sides x1.125 round back to themselves keeps its aspect ratio and gets x2, not x2.25.
    same = upscale_sizes((32, 32), _request(2.25))
    assert (same.input_size, same.delivery_size) == ((32, 32), (64, 64))
    assert same.notes == ("the x2.25 scale first enlarges the 32x32 source x1.125 with each side rounded to a "
                          "multiple of 16, to 32x32: the upscaled result, 64x64, scales the source x2, not x2.25; "
                          "use sr_resolution_scale 2 or 4 for an exact scale.",)
    # Where the sides' factors differ (each within the 2% that keeps the aspect ratio), both are given: the width's
    # alone read "x2.25 ..., not x2.25" for 114x218, whose height is x2.2.
    assert upscale_sizes((218, 114), _request(2.25)).notes[0].endswith(
        "to 128x240: the upscaled result, 256x480, scales the source x2.25 wide and x2.2 high, not x2.25; use "
        "sr_resolution_scale 2 or 4 for an exact scale.")
    # With a target that stretches too, both are said, the pre-upscale first.
    both = upscale_sizes((64, 96), _request(2.25, "160x120", "exact")).notes
    assert len(both) == 2 and both[0] == stretched.notes[0] and "'exact' resize mode stretches" in both[1]


def test_the_plans_description_says_upscaled_to_the_upscaled_size_and_then_the_targets():
    # With a target it read "upscaled 96x64 to 90x60": the delivered size, a downscale, as the upscale's.
    from k6serve.pipelines.sr_plan import plan_upscale

    plain = plan_upscale((64, 96), _request(2), tile_sizes=[(64, 64)], snap=16).describe()
    assert plain == "upscaled 96x64 to 192x128 with 15 tile(s) (3x5 grid of 64x64 output tiles)"
    targeted = plan_upscale((64, 96), _request(2, "100x60"), tile_sizes=[(64, 64)], snap=16).describe()
    assert targeted == plain + ", then resized to 90x60 (sr_target_resolution)"


def test_the_plans_description_names_the_target_as_the_cli_does():
    # `k6serve generate` printed "note: ... then resized to 90x60 (sr_target_resolution)" to a user of the flag.
    from k6serve.pipelines.sr_plan import plan_upscale
    from k6serve.request import FLAG_NAMES

    targeted = plan_upscale((64, 96), _request(2, "100x60"), tile_sizes=[(64, 64)], snap=16)
    assert targeted.describe(FLAG_NAMES).endswith(", then resized to 90x60 (--sr-target-resolution)")


def test_the_tiling_is_read_without_loading_for_super_resolution_only(tmp_path):
    from k6serve.models.kandinsky6_sr.config_before_loading import sr_tiling_before_loading
    from k6serve.pipelines.sr_tiling import SourceTooSmall

    released = sr_tiling_before_loading("kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers", None, "dummy")
    assert released is not None and released.snap == 16 and (512, 512) in released.tile_sizes
    assert sr_tiling_before_loading("demo", None, None) is None  # a generation model
    assert sr_tiling_before_loading(str(tmp_path / "missing"), None, None) is None  # cannot be told: the worker says
    # x2 runs 256x256 low-resolution tiles of the released 512x512 ones.
    clip = make_clip(tmp_path / "clip.mp4", width=256, height=256, num_frames=9, fps=24)
    assert expected_upscale_output(_request(2, video_path=str(clip)), released).size == "512x512"
    small = make_clip(tmp_path / "small.mp4", width=64, height=64, num_frames=9, fps=24)
    with pytest.raises(SourceTooSmall, match=r"^the source frame is 64x64 .* but x2 tiles need at least"):
        expected_upscale_output(_request(2, video_path=str(small)), released)


@pytest.mark.parametrize(("source", "scale", "fix"), [
    ((2160, 3840), 4, "use sr_resolution_scale 2, or a smaller source."),
    ((2160, 3840), 2.25, "use sr_resolution_scale 2, or a smaller source."),
    ((1440, 2560), 4, "use sr_resolution_scale 2.25 or 2, or a smaller source."),
    ((8000, 8000), 2, "downscale the source first (at x2, to at most 4096x2160"),
])
def test_an_upscale_larger_than_h264s_largest_level_is_refused_with_the_scale_that_fits(source, scale, fix):
    """An 8000x8000 source at x2 was accepted (16000x16000 is under libx264's 16384 a side): 93 GB of frames and a
    stream labelled level 6.2 that exceeds it. Sizes are (H, W) here, as the CLI's --height/--width order."""
    from k6serve.pipelines.sr_plan import upscale_sizes

    with pytest.raises(ValueError, match=r"macroblocks of 16x16 pixels\), more than H.264's largest level allows in "
                                         r"a frame \(139,264, e.g. 8192x4320 or 7680x4320\)") as refused:
        upscale_sizes(source, _request(scale))
    assert str(refused.value).endswith(fix) or fix in str(refused.value)
    # A target does not help (the canvas is computed whole before the downscale): still refused.
    with pytest.raises(ValueError, match="before any sr_target_resolution"):
        upscale_sizes(source, _request(scale, "hd"))


@pytest.mark.parametrize(("source", "scale", "output"), [
    ((2160, 3840), 2, (4320, 7680)),  # 4K to 8K UHD: 129,600 macroblocks
    ((1080, 1920), 4, (4320, 7680)),
    ((2160, 4096), 2, (4320, 8192)),  # the level's own example, 138,240
    ((1080, 1920), 2.25, (2432, 4320)),
])
def test_the_largest_upscales_h264_allows_still_plan(source, scale, output):
    from k6serve.pipelines.sr_plan import upscale_sizes

    assert upscale_sizes(source, _request(scale)).crop_size == output


def test_a_canvas_over_h264s_limits_is_refused_from_the_header_before_a_frame_decodes(tmp_path, monkeypatch):
    """The refusal came after the first frame's decode: a crafted 16000x8000 source cost 200 MB and a second of
    the server's input threads per request, for a job refused anyway."""
    from k6serve.media.video import SRSourceReader
    from k6serve.pipelines.sr_plan import UpscaleTooLarge

    large = make_clip(tmp_path / "large.mp4", width=2064, height=1088, num_frames=1, fps=24)
    with SRSourceReader(large) as reader:
        assert reader.stated_frame_size() == (1088, 2064)

    def decoded(self):
        raise AssertionError("the first frame was decoded")

    monkeypatch.setattr(SRSourceReader, "preview", decoded)
    with pytest.raises(UpscaleTooLarge, match=r"^the x4 upscale of this 2064x1088 source would be 8256x4352 "):
        expected_upscale_output(_request(4, video_path=str(large)))
    with pytest.raises(AssertionError, match="decoded"):  # x2 fits: the header alone does not refuse it
        expected_upscale_output(_request(2, video_path=str(large)))
