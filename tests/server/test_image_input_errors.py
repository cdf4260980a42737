"""An unreadable input_reference image: the 400 says what is wrong and what to send, as the CLI does."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import PIL.Image
import pytest
from test_errors import _assert_error

from k6serve import media


def _cut_png() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.effect_noise((64, 48), 60).save(buffer, format="PNG")
    return buffer.getvalue()[:30]  # cut inside the header: PIL calls it "cannot identify image file", as text


def _noise(size: tuple[int, int], seed: int = 0) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def _encoded(image: PIL.Image.Image, pil_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=pil_format, **options)
    return buffer.getvalue()


def _cut(data: bytes, fraction: float) -> bytes:
    return data[:int(len(data) * fraction)]


def _overwritten(data: bytes, fraction: float, filler: bytes) -> bytes:
    start = int(len(data) * fraction)
    return data[:start] + filler + data[start + len(filler):]


# Cut or damaged inside the pixel data, past headers that PIL opens (and verify() passes): only a decode finds them.
# Each: (the file, the format the reason names).
_DAMAGED_IN_PIXELS = {
    "jpeg_cut": (_cut(_encoded(_noise((64, 48)), "JPEG", quality=95), 0.5), "JPEG"),
    "progressive_jpeg_cut": (_cut(_encoded(_noise((64, 48)), "JPEG", quality=95, progressive=True), 0.5), "JPEG"),
    "gif_cut": (_cut(_encoded(_noise((64, 48)).convert("P"), "GIF"), 0.75), "GIF"),
    "tiff_cut": (_cut(_encoded(_noise((64, 48)), "TIFF"), 0.5), "TIFF"),
    # libwebp reads a cut WebP's container at open (a 400 already), but 64 bytes of 0xFF in a lossless one's
    # bitstream only when it decodes.
    "webp_damaged": (_overwritten(_encoded(_noise((64, 48)), "WEBP", lossless=True), 0.5, b"\xff" * 64), "WebP"),
}


def _damaged_reason(found: str) -> str:
    return (f"it starts as a {found} file but its data is damaged, cut short or of a kind k6serve cannot decode; "
            "export or copy it again, as an 8-bit PNG or JPEG if it still fails")


@pytest.mark.parametrize(("content", "reason"), [
    (b"not an image at all", "its contents are in no image format k6serve reads; use a PNG, JPEG, WebP, TIFF or GIF "
                             "image (a GIF gives its first frame)"),
    (_cut_png(), _damaged_reason("PNG")),
    *[(content, _damaged_reason(found)) for content, found in _DAMAGED_IN_PIXELS.values()],
], ids=["text", "cut_png", *_DAMAGED_IN_PIXELS])
def test_an_unreadable_upload_says_why_in_words(fake_server, fake_client, tmp_path, content, reason):
    # The message was "... is not a readable image (UnidentifiedImageError); send a PNG, JPEG, WebP or GIF file.":
    # PIL's class name, whichever way the file was broken.
    response = fake_client.post("/v1/videos", data={"prompt": "x"},
                                files={"input_reference": ("first.png", content, "image/png")})
    error = _assert_error(response, 400, param="input_reference", code="invalid_upload")
    assert error["message"] == f"The uploaded input_reference is not a readable image: {reason}."
    assert str(fake_server.artifacts.root) not in error["message"]
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    assert fake_client.get("/v1/videos").json()["data"] == []
    # The CLI and Python API say the same of the same file, naming it.
    (tmp_path / "first.png").write_bytes(content)
    with pytest.raises(ValueError) as cli_error:
        media.load_conditioning_image(tmp_path / "first.png", 512, 768)
    assert str(cli_error.value) == f"conditioning image '{tmp_path / 'first.png'}' is not a readable image: {reason}"


def _nan_tiff() -> bytes:
    pixels = np.full((48, 64), 0.5, dtype=np.float32)
    pixels[3, 5] = np.nan
    return _encoded(PIL.Image.fromarray(pixels), "TIFF")


def test_an_image_whose_levels_the_worker_refuses_is_a_400_at_creation(fake_server, fake_client):
    """A float TIFF with a NaN pixel decodes, but the worker refuses its levels: it was a job that failed when it
    started. Now a 400 at creation in the worker's words, and nothing is kept."""
    created = fake_client.post("/v1/videos", data={"prompt": "load image", "size": "96x64", "num_frames": "5"},
                               files={"input_reference": ("first.tif", _nan_tiff(), "image/tiff")})
    error = _assert_error(created, 400, param="input_reference", code="invalid_upload")
    assert error["message"] == ("The uploaded input_reference is a float image with 1 NaN or infinite pixel values; "
                                "replace them with values from 0.0 (black) to 1.0 (white), or save the image as an "
                                "8-bit PNG")
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    assert fake_client.get("/v1/videos").json()["data"] == []


def test_a_job_failing_on_its_upload_does_not_show_the_servers_upload_path(fake_server, fake_client, monkeypatch):
    """An upload that passes the creation check and fails in the worker (here the creation's level check is turned
    off, so the NaN TIFF gets through): the worker's error named the file by the server's own upload path; the
    job's error says "the uploaded file"."""
    from harness import wait_for

    import k6serve.serve.input_paths as input_paths

    monkeypatch.setattr(input_paths, "check_pixel_levels", lambda image, source: None)
    created = fake_client.post("/v1/videos", data={"prompt": "load image", "size": "96x64", "num_frames": "5"},
                               files={"input_reference": ("first.tif", _nan_tiff(), "image/tiff")})
    assert created.status_code == 200, created.text
    job = wait_for(fake_client, created.json()["id"])
    assert job["status"] == "failed" and job["error"]["code"] == "invalid_request", job
    message = job["error"]["message"]
    assert message.startswith("conditioning image (the uploaded file) is a float image with 1 NaN or infinite pixel "
                              "values"), message
    assert str(fake_server.artifacts.root) not in message and "uploads" not in message


def _with_corrupt_entropy_data() -> bytes:
    """A JPEG with 32 zero bytes amid its entropy-coded data: libjpeg warns ("Corrupt JPEG data") and PIL loads it
    with those blocks garbled, without raising."""
    intact = _encoded(_noise((640, 480), seed=1), "JPEG", quality=90)
    damaged = _overwritten(intact, 0.5, bytes(32))
    with PIL.Image.open(io.BytesIO(damaged)) as image, PIL.Image.open(io.BytesIO(intact)) as original:
        assert np.asarray(image).shape == np.asarray(original).shape  # loads in full
        assert not np.array_equal(np.asarray(image), np.asarray(original))
    return damaged


@pytest.mark.parametrize("content", [
    # 4000x3000 (decoded at 1/8 scale at creation, in full by the worker).
    pytest.param(lambda: _encoded(_noise((4000, 3000)), "JPEG", quality=90), id="large_jpeg"),
    # What the worker uses, creation does not refuse.
    pytest.param(_with_corrupt_entropy_data, id="jpeg_with_corrupt_entropy_data"),
])
def test_a_jpeg_the_worker_decodes_passes_creation(fake_client, content):
    from harness import wait_for

    created = fake_client.post("/v1/videos", data={"prompt": "load image", "size": "96x64", "num_frames": "5"},
                               files={"input_reference": ("photo.jpg", content(), "image/jpeg")})
    assert created.status_code == 200, created.text
    assert wait_for(fake_client, created.json()["id"])["status"] == "completed"


def test_image_decodes_at_creation_share_a_pixel_budget():
    """The server checks uploads in threads: their decodes hold at most the budget's pixels together, an image
    over the budget decodes alone, and one waiting is not passed over by a smaller one that would fit."""
    from harness import wait_until

    from k6serve.serve.input_paths import _PixelBudget

    budget = _PixelBudget(100)
    started: list[str] = []

    def decode(name: str, pixels: int) -> threading.Thread:
        def run() -> None:
            with budget.reserve(pixels):
                started.append(name)
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    with budget.reserve(60):
        larger = decode("over the budget", 1000)  # counts as the whole budget: waits for the 60 to be released
        wait_until(budget._turn.locked)
        smaller = decode("small", 10)  # 70 would fit, but it came second
        time.sleep(0.2)
        assert started == []
    larger.join(10)
    smaller.join(10)
    assert started == ["over the budget", "small"]
