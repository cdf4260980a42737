"""An unreadable input_reference image: the 400 says what is wrong and what to send, as the CLI does."""

from __future__ import annotations

import io

import PIL.Image
import pytest
from test_errors import _assert_error

from k6serve import media


def _cut_png() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.effect_noise((64, 48), 60).save(buffer, format="PNG")
    return buffer.getvalue()[:30]  # cut inside the header: PIL calls it "cannot identify image file", as text


@pytest.mark.parametrize(("content", "reason"), [
    (b"not an image at all", "its contents are in no image format k6serve reads; use a PNG, JPEG, WebP, TIFF or GIF "
                             "image (a GIF gives its first frame)"),
    (_cut_png(), "it starts as a PNG file but its data is damaged, cut short or of a kind k6serve cannot decode; "
                 "export or copy it again, as an 8-bit PNG or JPEG if it still fails"),
], ids=["text", "cut_png"])
def test_an_unreadable_upload_says_why_in_words(fake_server, fake_client, tmp_path, content, reason):
    # The message was "... is not a readable image (UnidentifiedImageError); send a PNG, JPEG, WebP or GIF file.":
    # PIL's class name, whichever way the file was broken.
    response = fake_client.post("/v1/videos", data={"prompt": "x"},
                                files={"input_reference": ("first.png", content, "image/png")})
    error = _assert_error(response, 400, param="input_reference", code="invalid_upload")
    assert error["message"] == f"The uploaded input_reference is not a readable image: {reason}."
    assert str(fake_server.artifacts.root) not in error["message"]
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    # The CLI and Python API say the same of the same file, naming it.
    (tmp_path / "first.png").write_bytes(content)
    with pytest.raises(ValueError) as cli_error:
        media.load_conditioning_image(tmp_path / "first.png", 512, 768)
    assert str(cli_error.value) == f"conditioning image '{tmp_path / 'first.png'}' is not a readable image: {reason}"


def test_a_job_failing_on_its_upload_does_not_show_the_servers_upload_path(fake_server, fake_client):
    """A JPEG cut inside its pixel data passes the header check at creation and fails when the worker decodes it.
    The worker's error named the file by the server's own upload path; the job's error says "the uploaded file"."""
    from harness import wait_for

    buffer = io.BytesIO()
    PIL.Image.effect_noise((64, 48), 60).convert("RGB").save(buffer, format="JPEG", quality=95)
    cut = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    created = fake_client.post("/v1/videos", data={"prompt": "load image", "size": "96x64", "num_frames": "5"},
                               files={"input_reference": ("first.jpg", cut, "image/jpeg")})
    assert created.status_code == 200, created.text
    job = wait_for(fake_client, created.json()["id"])
    assert job["status"] == "failed" and job["error"]["code"] == "invalid_request", job
    message = job["error"]["message"]
    assert message.startswith("conditioning image (the uploaded file) is not a readable image: it starts as a JPEG"), (
        message)
    assert str(fake_server.artifacts.root) not in message and "uploads" not in message
