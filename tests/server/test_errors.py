"""Everything a client can get wrong: status code, OpenAI error body, nothing written, and the server still
completes other jobs afterwards."""

from __future__ import annotations

import io
import os
import re
import socket
import time
import urllib.parse
from pathlib import Path

import pytest
from harness import start_server, wait_for, wait_until
from PIL import Image

from k6serve.serve import uploads
from k6serve.serve.http_protocol import UNPARSABLE_REQUEST_MESSAGE

SMALL = {"size": "32x32", "num_frames": 5}


def _png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (24, 16), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _assert_error(response, status: int, *, param: str | None = "any", code: str | None = None,
                  contains: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param != "any":
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if contains is not None:
        assert contains in error["message"], error
    return error


def _still_serves(client) -> None:
    job = client.post("/v1/videos", json={"prompt": "still alive", **SMALL})
    assert job.status_code == 200, job.text
    assert wait_for(client, job.json()["id"])["status"] == "completed"


@pytest.mark.parametrize(
    ("body", "param", "contains"),
    [
        ({"prompt": "x", "seed": "abc"}, "seed", "integer"),
        ({"prompt": "x", "seed": -2}, "seed", "[0, 2**63), or -1 for a seed drawn"),
        ({"prompt": "x", "seed": 1.5}, "seed", "integer"),
        # A decimal number holds every integer only below 2**53: 9007199254740993.0 ran with ...992, and 1e19 got
        # pydantic's "unable to parse input string".
        ({"prompt": "x", "seed": 9007199254740993.0}, "seed", "without a decimal point or an exponent"),
        ({"prompt": "x", "seed": 1e19}, "seed", "got 1e+19"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "between 1 and 1000"),
        ({"prompt": "x", "guidance_scale": 2.0}, "guidance_scale", "exactly 1.0"),
        ({"prompt": "x", "width": 33}, "width", "multiple of 16"),
        ({"prompt": "x", "height": 4096}, "height", "at most 2048"),
        ({"prompt": "x", "fps": 0}, "fps", "between 1 and 240"),
        ({"prompt": "x", "fps": 1e-9}, "fps", "audio length"),
        ({"prompt": "x", "num_frames": [1, 2]}, "num_frames", "integer"),
        ({"prompt": 5}, "prompt", "string"),
        ({"prompt": "   "}, "prompt", "required"),
        ({}, "prompt", "required"),
        ({"prompt": "x", "size": "big"}, "size", "WIDTHxHEIGHT"),
        ({"prompt": "x", "size": "64x32", "width": 32}, "size", "disagrees"),
        ({"prompt": "x", "seconds": "-1"}, "seconds", "(0, 600]"),
        # a megabyte prompt was stored whole with the job (the store grew 100 MiB in 5 s of create and cancel)
        ({"prompt": "x" * 40_000}, "prompt", "at most 32,768 are taken"),
        # both ends of the range: 0, just over 600, and one that overflowed to infinity frames (a 500 without it)
        ({"prompt": "x", "seconds": "0"}, "seconds", "seconds must be in (0, 600], got '0'"),
        ({"prompt": "x", "seconds": "600.5"}, "seconds", "(0, 600]"),
        ({"prompt": "x", "seconds": "1e308"}, "seconds", "(0, 600]"),
        ({"prompt": "x", "seconds": "four"}, "seconds", "number"),
        ({"prompt": "x", "seconds": 2, "num_frames": 5}, "seconds", "send one of them"),
        ({"prompt": "x", "video_path": "/etc/hosts"}, "video_path", "allowed input folders"),
        ({"prompt": "x", "unknown_knob": 1}, "unknown_knob", "Valid fields"),
        ({"prompt": "x", "input_reference": "abc"}, "input_reference", "multipart"),
    ],
)
def test_invalid_json_values_are_400_with_the_allowed_values(fake_client, body, param, contains):
    _assert_error(fake_client.post("/v1/videos", json=body), 400, param=param, contains=contains)
    _still_serves(fake_client)


def test_an_sglang_field_is_a_400_saying_what_to_send_instead(fake_server, fake_client):
    """SGLang's request fields (k6serve/reference_names.py) keep the unknown-field 400, with the fix in its message,
    in JSON and in a form."""
    fix = "Kandinsky 6 uses plain classifier-free guidance without rescale: guidance_scale sets its strength"
    for sent in ({"json": {"prompt": "x", "guidance_rescale": 0.7}},
                 {"data": {"prompt": "x", "guidance_rescale": "0.7"},
                  "files": {"input_reference": ("a.png", _png_bytes(), "image/png")}}):
        error = _assert_error(fake_client.post("/v1/videos", **sent), 400, param="guidance_rescale",
                              code="invalid_parameter", contains="Unknown field 'guidance_rescale' (SGLang's field; ")
        assert fix in error["message"] and "Valid fields: " in error["message"]
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    _still_serves(fake_client)


@pytest.mark.parametrize("field", ["output_path", "output_file_name", "save_output", "return_file_paths_only"])
def test_an_offline_output_option_in_a_job_says_where_the_video_goes(fake_server, fake_client, field):
    """The CLI's and the API's output options are not a job's: a 400 that says so and where the MP4 is (output_path
    read "Unknown field 'output_path'." and nothing more)."""
    error = _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", field: "x"}), 400, param=field,
                          code="invalid_parameter", contains=f"Unknown field {field!r} (an option of `k6serve "
                          "generate` and the Python API, not of a job: the server writes every job's MP4 under its own "
                          "--output-path and serves it at GET /v1/videos/{id}/content). Valid fields: ")
    assert "did you mean" not in error["message"]
    _still_serves(fake_client)


@pytest.mark.parametrize("send", [
    lambda client: client.post("/v1/videos", json={"seed": 1}),
    lambda client: client.post("/v1/videos", json={"prompt": "  "}),
    lambda client: client.post("/v1/videos", data={"seed": "1"}, files={"input_reference": ("a.png", _png_bytes())}),
    lambda client: client.post("/v1/videos", data={"prompt": ""}),
])
def test_a_missing_prompt_names_the_body_field_not_the_cli_flag(fake_server, fake_client, send):
    error = _assert_error(send(fake_client), 400, param="prompt", code="invalid_parameter")
    assert "prompt field" in error["message"] and "--prompt" not in error["message"]
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    # The CLI and the Python API share the check and keep the flag in their wording.
    from k6serve.request_resolution import resolve_generate
    from k6serve.request import SamplingParams

    with pytest.raises(ValueError, match="--prompt 'A cat plays piano'"):
        resolve_generate(SamplingParams(), fake_server.engine.variant)


@pytest.mark.parametrize(("body", "named"), [(b"null", "null"), (b"[1, 2]", "an array"), (b'"x"', "a string"),
                                           (b"4", "a number"), (b"true", "a boolean")])
@pytest.mark.parametrize("path", ["/v1/videos", "/v1/set_lora", "/resume_memory_occupation"])
def test_a_body_that_is_no_object_is_named_in_json_words(fake_client, path, body, named):
    # The refusal said "got NoneType" / "got list" / "got str": Python's names for what the client wrote as JSON.
    response = fake_client.post(path, content=body, headers={"Content-Type": "application/json"})
    error = _assert_error(response, 400, code="invalid_request")
    assert error["message"] == f"The request body must be a JSON object ({{...}}), got {named}."


def test_malformed_bodies_are_400_and_the_server_keeps_serving(fake_server, fake_client):
    _assert_error(fake_client.post("/v1/videos", content=b"{not json"), 400, code="invalid_json")
    _assert_error(fake_client.post("/v1/videos", content=b"[1, 2]", headers={"Content-Type": "application/json"}),
                  400, contains="JSON object")
    _assert_error(fake_client.post("/v1/videos", content=b"NaN", headers={"Content-Type": "application/json"}),
                  400)
    _assert_error(fake_client.post("/v1/videos", content=b'{"prompt": "x", "fps": NaN}'), 400, param="fps")
    _assert_error(fake_client.post("/v1/videos", content=b""), 400, code="invalid_json")
    # Deep nesting made the decoder raise RecursionError, a 500 before.
    deep = b'{"prompt": "x", "cache_dit_params": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}"
    _assert_error(fake_client.post("/v1/videos", content=deep), 400, code="invalid_json", contains="nested")
    form_deep = {"prompt": "x", "cache_dit_params": '{"a": ' * 5000 + "1" + "}" * 5000}
    _assert_error(fake_client.post("/v1/videos", data=form_deep), 400, param="cache_dit_params",
                  contains="nested too deeply")
    # 40 levels decode on every Python (3.12 decoded the 5,000 above too, and went on to a confusing "unknown
    # key" error): the depth rule, not the decoder's recursion, refuses them.
    forty = '{"a": ' * 40 + "1" + "}" * 40
    _assert_error(fake_client.post("/v1/videos", content=b'{"prompt": "x", "cache_dit_params": ' + forty.encode()
                                   + b"}"), 400, code="invalid_json", contains="nested")
    _assert_error(fake_client.post("/v1/videos", data={"prompt": "x", "cache_dit_params": forty}), 400,
                  param="cache_dit_params", contains="nested too deeply")
    _assert_error(fake_client.post("/v1/videos", content=b"null", headers={"Content-Type": "application/json"}),
                  400, contains="JSON object")
    # A form's JSON text is held to the body's rule: a key sent twice is refused, not silently the last one.
    _assert_error(fake_client.post("/v1/videos", data={"prompt": "x", "cache_dit_params":
                                                       '{"max_warmup_steps": 1, "max_warmup_steps": 4}'}),
                  400, param="cache_dit_params", code="invalid_parameter", contains="'max_warmup_steps' more than once")
    _assert_error(fake_client.post("/v1/videos", content=b"\xff\xfe", headers={"Content-Type": "application/json"}),
                  400, code="invalid_json")
    _assert_error(fake_client.post("/v1/videos", content=b"prompt=x", headers={"Content-Type": "text/plain"}), 415,
                  code="unsupported_content_type")
    form = {"Content-Type": "multipart/form-data; boundary=XyZ"}
    # Each malformed body is answered by its own refusal (they share the code)
    _assert_error(fake_client.post("/v1/videos", content=b"garbage without boundary", headers=form), 400,
                  code="invalid_multipart", contains="The body must start with the boundary given in Content-Type "
                                                      "('--XyZ')")
    truncated = b'--XyZ\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhello'
    _assert_error(fake_client.post("/v1/videos", content=truncated, headers=form), 400, code="invalid_multipart",
                  contains="ended before the closing boundary")
    _assert_error(fake_client.post("/v1/videos", content=b"", headers={"Content-Type": "multipart/form-data"}), 400,
                  code="invalid_multipart", contains="needs a boundary parameter")
    no_name = b"--XyZ\r\nContent-Disposition: form-data\r\n\r\nhello\r\n--XyZ--\r\n"
    _assert_error(fake_client.post("/v1/videos", content=no_name, headers=form), 400, code="invalid_multipart",
                  contains="has no Content-Disposition name")
    _assert_error(fake_client.post("/v1/videos", data={"prompt": "x"}, files={"other": ("a.png", b"123")}), 400,
                  param="other", code="invalid_multipart")
    duplicate = (b'--XyZ\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na\r\n'
                 b'--XyZ\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nb\r\n--XyZ--\r\n')
    _assert_error(fake_client.post("/v1/videos", content=duplicate, headers=form), 400, param="prompt")
    bad_utf8 = b'--XyZ\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n\xff\xfe\r\n--XyZ--\r\n'
    _assert_error(fake_client.post("/v1/videos", content=bad_utf8, headers=form), 400, param="prompt")
    _assert_error(fake_client.post("/v1/videos", data={"prompt": "x", "seed": "abc"}), 400, param="seed")
    _assert_error(fake_client.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", b"")}),
                  400, code="invalid_upload")
    _assert_error(fake_client.post("/v1/videos", headers={"Idempotency-Key": "has space"}, json={"prompt": "x"}),
                  400, code="invalid_idempotency_key")
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    _still_serves(fake_client)


def test_multipart_strings_are_coerced_and_the_upload_is_used(fake_server, fake_client):
    response = fake_client.post(
        "/v1/videos",
        data={"prompt": "  keep my spaces ", "seed": "7", "size": "48x32", "num_frames": "5", "fps": "12.5"},
        files={"input_reference": ("first.png", _png_bytes(), "image/png")},
    )
    assert response.status_code == 200, response.text
    job = wait_for(fake_client, response.json()["id"])
    assert job["status"] == "completed" and job["size"] == "48x32"
    request = fake_server.worker.requests[-1]
    assert request.prompt == "  keep my spaces " and request.seed == 7 and request.fps == 12.5
    assert request.image_path.startswith(str(fake_server.artifacts.upload_dir))
    assert request.image_path.endswith(".png")
    # the uploaded reference image is kept with the completed job (a remix runs with it), deleted with it
    assert [path.name for path in fake_server.artifacts.upload_dir.iterdir()] == [Path(request.image_path).name]
    assert fake_client.delete(f"/v1/videos/{job['id']}").status_code == 200
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []


@pytest.mark.parametrize("client_name", ["первый кадр.png", "最初.PNG", "café.png"])
def test_an_upload_named_in_any_script_is_read_and_its_name_kept(fake_server, fake_client, client_name):
    # Clients send a part's file name as raw UTF-8: Cyrillic or CJK names were a 500 (UnicodeEncodeError in the
    # header's parse), and "café.png" came through as "caf\ufffd.png".
    response = fake_client.post("/v1/videos", data={"prompt": "x", **SMALL, "num_frames": "5"},
                                files={"input_reference": (client_name, _png_bytes(), "image/png")})
    assert response.status_code == 200, response.text
    assert wait_for(fake_client, response.json()["id"])["status"] == "completed"
    assert fake_server.worker.requests[-1].image_path.endswith(".png")
    boundary = b"xYz"
    body = (b"--xYz\r\nContent-Disposition: form-data; name=\"video_reference\"; filename=\""
            + client_name.encode() + b"\"\r\nContent-Type: video/mp4\r\n\r\nabc\r\n--xYz--\r\n")
    reader = uploads.MultipartReader(boundary=boundary, file_fields={"video_reference"}, max_file_bytes=100,
                                     file_path=lambda field, name: fake_server.artifacts.upload_dir / "probe.bin")
    reader.parser.write(body)
    (upload,) = reader.form.files.values()
    assert upload.client_file_name == client_name and upload.content_type == "video/mp4"
    reader.cleanup()
    # Unquoted, a name ending in "à" (its UTF-8 ends in 0xA0, latin-1's no-break space) keeps its last letter.
    reader = uploads.MultipartReader(boundary=boundary, file_fields={"video_reference"}, max_file_bytes=100,
                                     file_path=lambda field, name: fake_server.artifacts.upload_dir / "probe.bin")
    reader.parser.write(b"--xYz\r\nContent-Disposition: form-data; name=video_reference; filename="
                        + "voilà".encode() + b"\r\n\r\nabc\r\n--xYz--\r\n")
    assert [upload.client_file_name for upload in reader.form.files.values()] == ["voilà"]
    reader.cleanup()


def test_a_file_field_sent_as_text_says_how_to_send_the_file(fake_server, fake_client):
    # curl -F input_reference=first.png (no @) sends the name as text: not an "unknown field" whose list of valid
    # fields leaves input_reference out.
    for field_name in ("input_reference", "video_reference"):
        error = _assert_error(fake_client.post("/v1/videos", data={"prompt": "x", field_name: "first.png"}), 400,
                              param=field_name, code="invalid_parameter", contains=f"-F {field_name}=@")
        assert "Unknown field" not in error["message"]
        urlencoded = fake_client.post("/v1/videos", content=f"prompt=x&{field_name}=first.png".encode(),
                                      headers={"Content-Type": "application/x-www-form-urlencoded"})
        _assert_error(urlencoded, 400, param=field_name, contains="file upload")
    # With a real upload beside it, the upload is not kept.
    both = fake_client.post("/v1/videos", data={"prompt": "x", "video_reference": "clip.mp4"},
                            files={"input_reference": ("first.png", _png_bytes(), "image/png")})
    _assert_error(both, 400, param="video_reference")
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    _still_serves(fake_client)


def test_a_files_bytes_sent_without_a_filename_say_how_to_send_the_file(fake_server, fake_client):
    # A part without a filename is a text field to multipart (curl -F 'input_reference=<first.png', or a client given
    # no file name): a PNG's bytes there were refused as "Form field 'input_reference' is not valid UTF-8.".
    response = fake_client.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": (None, _png_bytes())})
    error = _assert_error(response, 400, param="input_reference", code="invalid_parameter",
                          contains="-F input_reference=@path/to/file")
    assert "UTF-8" not in error["message"] and "without a filename" in error["message"]
    # Another field's bytes that are no text keep their own refusal.
    _assert_error(fake_client.post("/v1/videos", files={"prompt": (None, b"\xff\xfe")}), 400, param="prompt",
                  code="invalid_multipart", contains="not valid UTF-8")
    assert fake_client.get("/v1/videos").json()["data"] == []
    _still_serves(fake_client)


def test_path_traversal_and_symlink_escapes_are_refused(fake_server, fake_client, tmp_path):
    inputs = tmp_path / "inputs"
    (inputs / "ok.png").write_bytes(_png_bytes())
    outside = tmp_path / "secret.png"
    outside.write_bytes(_png_bytes())
    os.symlink(outside, inputs / "link.png")
    os.symlink(tmp_path, inputs / "dirlink")
    attempts = [
        str(inputs / ".." / "secret.png"),
        "../secret.png",
        str(inputs / "link.png"),
        str(inputs / "dirlink" / "secret.png"),
        "/etc/passwd",
        str(fake_server.artifacts.upload_dir / ".." / f"{'x' * 10}.mp4"),
    ]
    for path in attempts:
        _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "image_path": path, **SMALL}), 400,
                      param="image_path", code="path_not_allowed")
    _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "image_path": str(inputs / "none.png")}), 400,
                  param="image_path", code="invalid_path")
    _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "image_path": str(inputs)}), 400,
                  param="image_path", code="invalid_path")
    _assert_error(fake_client.post("/v1/videos", data={"prompt": "x", "image_path": "/etc/passwd"}), 400,
                  param="image_path", code="path_not_allowed")
    job = fake_client.post("/v1/videos", json={"prompt": "x", "image_path": str(inputs / "ok.png"), **SMALL})
    assert job.status_code == 200, job.text
    assert wait_for(fake_client, job.json()["id"])["status"] == "completed"
    assert fake_server.worker.requests[-1].image_path == str((inputs / "ok.png").resolve())


def test_a_json_path_into_the_upload_folder_is_refused_even_when_allowed(fake_server, fake_client):
    """Another job's upload, named in JSON, was accepted and then failed ("it does not exist") once that job ended
    and its uploads were deleted. The harness allows the upload folder explicitly: refused all the same."""
    assert fake_server.artifacts.upload_dir in fake_server.settings.allowed_input_dirs
    held = fake_server.artifacts.upload_dir / "video_0123_input_reference.png"
    held.write_bytes(_png_bytes())
    for path in (str(held), str(fake_server.artifacts.upload_dir / "missing.png")):
        error = _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "image_path": path, **SMALL}),
                              400, param="image_path", code="path_not_allowed")
        assert error["message"] == (
            f"image_path {path!r} is in the server's upload folder, whose files belong to the jobs that uploaded "
            "them and are deleted with those jobs; upload the file with this request (multipart input_reference) "
            "or put it in an allowed input folder.")
    held.unlink()
    # A path the upload-folder check cannot resolve keeps the input check's 400 (a NUL byte was a 500).
    _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "image_path": "a\u0000b.png", **SMALL}), 400,
                  param="image_path", code="invalid_path", contains="must be a file path")
    assert fake_client.get("/v1/videos").json()["data"] == []
    _still_serves(fake_client)


def test_a_number_past_pythons_digit_limit_is_a_400_not_a_500(fake_client):
    """json.loads raises a plain ValueError for an integer of over 4,300 digits: it was a 500 with a traceback."""
    body = '{"prompt": "x", "seed": ' + "9" * 5000 + "}"
    error = _assert_error(fake_client.post("/v1/videos", content=body, headers={"Content-Type": "application/json"}),
                          400, code="invalid_json")
    # Python's advice (sys.set_int_max_str_digits(), a call inside the server) is not the client's
    assert error["message"] == ("Invalid JSON body: a number in it is too long (5,000 digits); no field takes more "
                                "than a few dozen digits.")
    # a form's object field is decoded apart: the same limit was a 500 there
    form = {"prompt": "x", "loras": '{"a": ' + "1" * 5000 + "}"}
    error = _assert_error(fake_client.post("/v1/videos", data=form), 400, param="loras", code="invalid_parameter")
    assert error["message"] == ("loras holds a number that is too long (5,000 digits); no setting takes more than "
                                "a few dozen digits.")
    _still_serves(fake_client)


def test_idempotent_retries(fake_server, fake_client):
    body = {"prompt": "idempotent", **SMALL}
    first = fake_client.post("/v1/videos", json=body, headers={"Idempotency-Key": "key-1"})
    again = fake_client.post("/v1/videos", json=body, headers={"Idempotency-Key": "key-1"})
    assert first.status_code == again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    conflict = fake_client.post("/v1/videos", json={**body, "seed": 1}, headers={"Idempotency-Key": "key-1"})
    _assert_error(conflict, 409, param="Idempotency-Key", code="idempotency_conflict", contains=first.json()["id"])
    files = {"input_reference": ("a.png", _png_bytes(), "image/png")}
    upload = fake_client.post("/v1/videos", data={"prompt": "up", **SMALL, "num_frames": "5"}, files=files,
                              headers={"Idempotency-Key": "key-2"})
    replay = fake_client.post("/v1/videos", data={"prompt": "up", **SMALL, "num_frames": "5"}, files=files,
                              headers={"Idempotency-Key": "key-2"})
    assert replay.json()["id"] == upload.json()["id"]
    other_file = {"input_reference": ("a.png", _png_bytes() + b"\0", "image/png")}
    _assert_error(fake_client.post("/v1/videos", data={"prompt": "up", **SMALL, "num_frames": "5"},
                                   files=other_file, headers={"Idempotency-Key": "key-2"}), 409)
    wait_for(fake_client, first.json()["id"])
    wait_for(fake_client, upload.json()["id"])
    assert fake_server.worker.started.count("idempotent") == 1 and fake_server.worker.started.count("up") == 1
    listed = fake_client.get("/v1/videos").json()["data"]
    assert len(listed) == 2
    # the replay's and the conflict's files are gone; the stored job keeps its own (its reference image)
    kept = fake_server.worker.requests[-1].image_path
    assert [str(path) for path in fake_server.artifacts.upload_dir.iterdir()] == [kept]


def test_a_request_id_is_the_job_id_and_a_retry_returns_that_job(fake_server, fake_client):
    body = {"prompt": "chosen id", **SMALL, "request_id": "order-42.v1_a"}
    first = fake_client.post("/v1/videos", json=body)
    assert first.status_code == 200 and first.json()["id"] == "order-42.v1_a"
    assert "Idempotent-Replayed" not in first.headers
    again = fake_client.post("/v1/videos", json=body)
    assert again.json()["id"] == "order-42.v1_a" and again.headers["Idempotent-Replayed"] == "true"
    conflict = fake_client.post("/v1/videos", json={**body, "seed": 1})
    _assert_error(conflict, 409, param="request_id", code="request_id_conflict", contains="different request body")
    assert wait_for(fake_client, "order-42.v1_a")["status"] == "completed"
    assert fake_client.get("/v1/videos/order-42.v1_a/content").content[4:8] == b"ftyp"
    assert [j["id"] for j in fake_client.get("/v1/videos").json()["data"]] == ["order-42.v1_a"]
    assert fake_server.worker.started.count("chosen id") == 1
    # A form takes it too; a retry with the same file replays, and only the stored job keeps its upload.
    form = {"prompt": "form id", **SMALL, "num_frames": "5", "request_id": "form-1"}
    files = {"input_reference": ("a.png", _png_bytes(), "image/png")}
    upload = fake_client.post("/v1/videos", data=form, files=files)
    replay = fake_client.post("/v1/videos", data=form, files=files)
    assert upload.json()["id"] == replay.json()["id"] == "form-1" and replay.headers["Idempotent-Replayed"] == "true"
    other_file = {"input_reference": ("a.png", _png_bytes() + b"\0", "image/png")}
    _assert_error(fake_client.post("/v1/videos", data=form, files=other_file), 409, param="request_id")
    assert wait_for(fake_client, "form-1")["status"] == "completed"
    # the replay's and the conflict's files are gone; the stored job keeps its own (its reference image)
    assert [str(path) for path in fake_server.artifacts.upload_dir.iterdir()] == [
        fake_server.worker.requests[-1].image_path]
    # DELETE takes it; the id then stays reserved (it marks a place in the paging order) rather than reused.
    assert fake_client.delete("/v1/videos/order-42.v1_a").json() == {"id": "order-42.v1_a", "object": "video.deleted",
                                                                     "deleted": True}
    _assert_error(fake_client.get("/v1/videos/order-42.v1_a"), 404, code="video_not_found")
    reused = fake_client.post("/v1/videos", json=body)
    _assert_error(reused, 409, param="request_id", code="request_id_conflict", contains="deleted")
    assert fake_server.worker.started.count("chosen id") == 1


def test_a_request_id_never_names_a_file_the_client_could_have_chosen(fake_server, fake_client):
    """The runner clears a job's file before it starts (a re-run's leftover): with the file named after a client's
    request_id, `request_id: "demo"` deleted an `outputs/demo.mp4` that `k6serve generate` had written there, and
    "Clip" / "clip" shared one file on a case-insensitive disk. A client's id is digested into the file name."""
    from k6serve.serve.artifacts import output_file_name

    mine = fake_server.artifacts.root / "demo.mp4"
    mine.write_bytes(b"the user's own video")
    for request_id in ("demo", "Clip", "clip"):
        job = fake_client.post("/v1/videos", json={"prompt": request_id, **SMALL, "request_id": request_id}).json()
        assert wait_for(fake_client, job["id"])["status"] == "completed"
        assert fake_client.get(f"/v1/videos/{request_id}/content").content[4:8] == b"ftyp"
    assert mine.read_bytes() == b"the user's own video"
    names = {output_file_name(request_id) for request_id in ("demo", "Clip", "clip")}
    assert len(names) == 3 and all(name.startswith("request_") and name.endswith(".mp4") for name in names)
    assert names <= {path.name for path in fake_server.artifacts.root.iterdir()}
    assert output_file_name("video_" + "0" * 32) == "video_" + "0" * 32 + ".mp4"  # the server's own ids as before


def test_a_request_id_is_free_again_once_its_deleted_place_is_forgotten(fake_server, fake_client):
    from k6serve.serve.jobs import DELETED_CURSOR_RETENTION_S

    body = {"prompt": "again", **SMALL, "request_id": "reusable"}
    wait_for(fake_client, fake_client.post("/v1/videos", json=body).json()["id"])
    fake_server.store.delete("reusable", now=time.time() - DELETED_CURSOR_RETENTION_S - 1)
    recreated = fake_client.post("/v1/videos", json=body)
    assert recreated.status_code == 200 and "Idempotent-Replayed" not in recreated.headers
    assert wait_for(fake_client, "reusable")["status"] == "completed"
    assert fake_server.worker.started.count("again") == 2


def test_seconds_as_text_or_number_is_one_request_for_idempotency(fake_server, fake_client):
    """OpenAI sends seconds as text ("0.2"); a retry of the same request as a number, or as a form field, is a replay,
    not a 409 conflict."""
    body = {"prompt": "duration", "size": "32x32"}
    first = fake_client.post("/v1/videos", json={**body, "seconds": "0.2"}, headers={"Idempotency-Key": "dur-1"})
    assert first.status_code == 200, first.text
    for retry in ({"json": {**body, "seconds": 0.2}}, {"data": {**body, "seconds": "0.2"}}):
        again = fake_client.post("/v1/videos", **retry, headers={"Idempotency-Key": "dur-1"})
        assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true", again.text
    _assert_error(fake_client.post("/v1/videos", json={**body, "seconds": 0.4}, headers={"Idempotency-Key": "dur-1"}),
                  409, code="idempotency_conflict")
    wait_for(fake_client, first.json()["id"])


def test_a_request_id_with_an_idempotency_key(fake_server, fake_client):
    body = {"prompt": "both", **SMALL, "request_id": "r1"}
    first = fake_client.post("/v1/videos", json=body, headers={"Idempotency-Key": "k1"})
    assert first.json()["id"] == "r1"
    # The key is checked first: the same key with another request_id is another body.
    _assert_error(fake_client.post("/v1/videos", json={**body, "request_id": "r2"}, headers={"Idempotency-Key": "k1"}),
                  409, param="Idempotency-Key", code="idempotency_conflict")
    # A new key (or none) with the same body and request_id replays the job.
    for headers in ({"Idempotency-Key": "k2"}, {}):
        replay = fake_client.post("/v1/videos", json=body, headers=headers)
        assert replay.json()["id"] == "r1" and replay.headers["Idempotent-Replayed"] == "true"
    wait_for(fake_client, "r1")
    assert fake_server.worker.started.count("both") == 1
    assert [j["id"] for j in fake_client.get("/v1/videos").json()["data"]] == ["r1"]


@pytest.mark.parametrize("request_id", ["", ":", "a:b", "a/b", "../x", ".hidden", "-x", "a" * 129, "caf\u00e9", 5,
                                        True])
def test_a_malformed_request_id_is_400(fake_client, request_id):
    response = fake_client.post("/v1/videos", json={"prompt": "x", "request_id": request_id})
    _assert_error(response, 400, param="request_id", code="invalid_parameter")
    assert fake_client.get("/v1/videos").json()["data"] == []


def test_a_request_id_replay_is_answered_while_the_queue_is_full(tmp_path):
    server = start_server(tmp_path, max_queued_jobs=1)
    try:
        with server.client() as client:
            running = client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
            wait_for(client, running["id"], ("in_progress",))
            gone = {"prompt": "gone", **SMALL, "request_id": "gone-1"}
            assert client.post("/v1/videos", json=gone).json()["status"] == "queued"
            # Cancelled and removed at once (it was queued): its id stays reserved.
            assert client.delete("/v1/videos/gone-1").json()["deleted"] is True
            body = {"prompt": "queued", **SMALL, "request_id": "queued-1"}
            assert client.post("/v1/videos", json=body).json()["status"] == "queued"
            one_more = client.post("/v1/videos", json={"prompt": "one more", **SMALL})
            _assert_error(one_more, 429, code="queue_full")
            replay = client.post("/v1/videos", json=body)
            assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
            # A deleted job's id is a 409 whatever the queue: a 429 would only send the client back for its 409.
            _assert_error(client.post("/v1/videos", json=gone), 409, param="request_id", code="request_id_conflict",
                          contains="deleted")
            server.worker.release.set()
            assert wait_for(client, "queued-1")["status"] == "completed"
    finally:
        server.stop()


def test_full_queue_answers_429_with_retry_after(tmp_path):
    server = start_server(tmp_path, max_queued_jobs=2)
    try:
        with server.client() as client:
            running = client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()
            wait_for(client, running["id"], ("in_progress",))
            queued = [client.post("/v1/videos", json={"prompt": f"q{i}", **SMALL}).json() for i in range(2)]
            refused = client.post("/v1/videos", json={"prompt": "one too many", **SMALL})
            _assert_error(refused, 429, code="queue_full")
            assert int(refused.headers["Retry-After"]) >= 1
            upload = client.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", b"12")})
            _assert_error(upload, 429)
            assert list(server.artifacts.upload_dir.iterdir()) == []
            assert 'k6serve_requests_rejected_total{reason="queue_full"} 2' in client.get("/metrics").text
            server.worker.release.set()
            for job in [running, *queued]:
                assert wait_for(client, job["id"])["status"] == "completed"
            _still_serves(client)
    finally:
        server.stop()


def test_oversized_uploads_are_413_and_nothing_is_written(tmp_path):
    server = start_server(tmp_path, max_upload_mb=0.05)  # 51.2 KiB
    upload_dir = server.artifacts.upload_dir
    big = os.urandom(200_000)
    try:
        with server.client() as client:
            # Declared Content-Length over the limit: refused before parsing (the body is read away, not kept).
            response = client.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", big)})
            _assert_error(response, 413, code="payload_too_large", contains="--max-upload-mb")
            # No Content-Length (chunked): refused while counting the streamed bytes.
            boundary = b"B0undary"
            head = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx\r\n--' + boundary
                    + b'\r\nContent-Disposition: form-data; name="video_reference"; filename="v.mp4"\r\n'
                    b"Content-Type: video/mp4\r\n\r\n")

            def chunks():
                yield head
                for start in range(0, len(big), 8192):
                    yield big[start:start + 8192]
                yield b"\r\n--" + boundary + b"--\r\n"

            response = client.post("/v1/videos", content=chunks(),
                                   headers={"Content-Type": f"multipart/form-data; boundary={boundary.decode()}"})
            assert "content-length" not in response.request.headers
            _assert_error(response, 413, code="payload_too_large")
            response = client.post("/v1/videos", content=b'{"prompt": "' + b"x" * (2 * 2**20) + b'"}',
                                   headers={"Content-Type": "application/json"})
            _assert_error(response, 413, code="payload_too_large",
                          contains="limited to 1 MiB; upload files with multipart/form-data instead.")
            assert list(upload_dir.iterdir()) == []
            assert list(server.artifacts.root.glob(".*.part")) == []
            assert client.get("/v1/videos").json()["data"] == []
        with server.client() as client:
            small = client.post("/v1/videos", data={"prompt": "x", **SMALL, "num_frames": "5"},
                                files={"input_reference": ("a.png", _png_bytes(), "image/png")})
            assert small.status_code == 200, small.text
            assert wait_for(client, small.json()["id"])["status"] == "completed"
    finally:
        server.stop()


def test_a_form_of_countless_empty_fields_is_413_not_parsed_whole(fake_server, fake_client):
    # Part headers count as form text. Uncounted, two million empty fields (111 MiB, no text) were parsed whole on the
    # event loop, 25 s in which no other request was answered, before the first one was refused as unknown.
    body = b"".join(b'--Q\r\nContent-Disposition: form-data; name="f%d"\r\n\r\n\r\n' % i for i in range(100_000))
    response = fake_client.post("/v1/videos", content=body + b"--Q--\r\n",
                                headers={"Content-Type": "multipart/form-data; boundary=Q"})
    _assert_error(response, 413, code="payload_too_large", contains="part headers")
    _still_serves(fake_client)


def _raw_response(base_url: str, request: bytes, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Send `request` on a fresh connection and read until the server closes it: (everything read, closed). A
    server still waiting for the body makes the read time out (closed False)."""
    host, port = base_url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            return received, False
    return received, True


@pytest.mark.parametrize(("path", "content_type", "declared"), [
    ("/v1/videos", "multipart/form-data; boundary=Q", 10 * 2**20),  # over --max-upload-mb
    ("/v1/videos", "application/json", 2 * 2**20),  # over the 1 MiB JSON limit
    ("/v1/videos", "application/x-www-form-urlencoded", 2 * 2**20),
    ("/v1/set_lora", "application/json", 2 * 2**20),
])
def test_a_declared_length_over_the_limit_is_413_at_once_without_reading_the_body(tmp_path, path, content_type,
                                                                                    declared):
    # The server read (and discarded) up to 64 MiB of the declared body before answering: a client that declared
    # more than it sent waited for a 413 that never came. Now the drain stops after an idle second.
    server = start_server(tmp_path, max_upload_mb=0.05)
    try:
        body = (b'--Q\r\nContent-Disposition: form-data; name="video_reference"; filename="v.mp4"\r\n\r\n' + b"a" * 100
                if content_type.startswith("multipart") else b'{"prompt": "x"}')
        head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {declared}\r\n\r\n").encode()
        started = time.monotonic()
        received, closed = _raw_response(server.base_url, head + body, timeout=10.0)
        assert closed, f"no answer within 10 s; got {received!r}"
        assert time.monotonic() - started < 6  # the one idle second, with room for a busy CI machine
        status_line, _, rest = received.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 413"), received
        assert b"connection: close" in rest.lower() and b'"payload_too_large"' in rest
        assert list(server.artifacts.upload_dir.iterdir()) == []
        assert list(server.artifacts.root.glob(".*.part")) == []
        with server.client() as client:
            assert client.get("/v1/videos").json()["data"] == []
            _still_serves(client)
    finally:
        server.stop()


def test_an_oversize_body_sent_whole_gets_its_413_and_one_that_waits_for_continue_gets_it_unsent(tmp_path,
                                                                                                 monkeypatch):
    """A client that sends its whole body at once (httpx, requests) reads the 413's JSON: the refused body is
    drained before the connection closes, since closing over unread data resets it and can lose the answer. A
    client that waits for `100 Continue` is answered before it sends anything."""
    server = start_server(tmp_path, max_upload_mb=0.05)
    try:
        with server.client() as client:
            big = b'{"prompt": "' + b"x" * (3 * 2**20) + b'"}'
            response = client.post("/v1/videos", content=big, headers={"Content-Type": "application/json"})
            _assert_error(response, 413, code="payload_too_large")
            _still_serves(client)
        head = (b"POST /v1/videos HTTP/1.1\r\nHost: localhost\r\nContent-Type: multipart/form-data; boundary=Q\r\n"
                b"Content-Length: 10485760\r\nExpect: 100-continue\r\n\r\n")
        # An idle drain made 30 s long, so "answered at once" is told from it with room to spare (the 1 s default
        # left 0.1 s of margin, too little on a busy machine).
        monkeypatch.setattr(uploads, "DRAIN_IDLE_S", 30.0)
        started = time.monotonic()
        received, closed = _raw_response(server.base_url, head, timeout=15.0)
        assert closed and time.monotonic() - started < 10, received  # no idle wait: nothing was sent
        assert received.startswith(b"HTTP/1.1 413") and b"100 Continue" not in received
    finally:
        server.stop()


@pytest.mark.parametrize("headers", [
    b"Content-Length: abc\r\n",  # not a number
    b"Content-Length: -1\r\n",  # negative
    b"Content-Length: 2\r\nContent-Length: 3\r\n",  # two that disagree
    b"Bad Header Without Colon\r\n",
], ids=["not-a-number", "negative", "two-lengths", "no-colon"])
def test_unparsable_request_is_the_api_json_error_and_the_server_keeps_serving(fake_server, fake_client, headers):
    """h11 refuses these before the app sees them; uvicorn's own answer is text/plain, ours is the API's JSON."""
    received, closed = _raw_response(fake_server.base_url, b"POST /v1/videos HTTP/1.1\r\nHost: localhost\r\n"
                                     b"Content-Type: application/json\r\n" + headers + b"\r\n{}")
    _assert_unparsable(received, closed)
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []
    _still_serves(fake_client)


def _assert_unparsable(received: bytes, closed: bool) -> None:
    import json

    head, _, body = received.partition(b"\r\n\r\n")
    assert closed and head.startswith(b"HTTP/1.1 400 "), received
    lowered = head.lower()
    assert b"content-type: application/json" in lowered and b"connection: close" in lowered
    assert f"content-length: {len(body)}".encode() in lowered and b"\r\ndate: " in lowered  # as every answer
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error"
    assert "Content-Length" in error["message"] and "well-formed HTTP/1.1" in error["message"]


def test_both_transfer_encoding_and_content_length_is_refused_and_closed(fake_server, fake_client):
    """RFC 9112 6.3: the connection must be closed after such a request (a proxy in front may have framed its body
    by Content-Length: request smuggling). h11 read it by Transfer-Encoding and kept the connection open."""
    import json

    received, closed = _raw_response(fake_server.base_url, b"POST /v1/videos HTTP/1.1\r\nHost: localhost\r\n"
                                     b"Content-Type: application/json\r\nContent-Length: 5\r\n"
                                     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
                                     b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
    head, _, rest = received.partition(b"\r\n\r\n")
    assert closed and head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower(), received
    error = json.loads(rest)["error"]  # one answer only: the smuggled second request was never read
    assert error["code"] == "invalid_request" and "both Transfer-Encoding and Content-Length" in error["message"]
    assert fake_client.get("/v1/videos").json()["data"] == []  # no job was created
    _still_serves(fake_client)


@pytest.mark.parametrize("version", [b"9.9", b"2.0", b"0.9"])
def test_an_unsupported_http_version_is_refused_and_closed(fake_server, fake_client, version):
    """h11 parses any "HTTP/d.d" request line; anything but 1.0 and 1.1 is a 505 in the API's JSON, not an
    HTTP/1.1 answer to a request the server does not speak, and no job is made."""
    import json

    received, closed = _raw_response(fake_server.base_url, b"POST /v1/videos HTTP/" + version + b"\r\nHost: localhost\r\n"
                                     b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    head, _, body = received.partition(b"\r\n\r\n")
    assert closed and head.startswith(b"HTTP/1.1 505 ") and b"connection: close" in head.lower(), received
    error = json.loads(body)["error"]
    assert error["code"] == "http_version_not_supported"
    assert error["message"].startswith(f"HTTP/{version.decode()} is not supported: this server speaks HTTP/1.1")
    assert fake_client.get("/v1/videos").json()["data"] == []
    # HTTP/1.0 is still served.
    received, _ = _raw_response(fake_server.base_url, b"GET /v1/models HTTP/1.0\r\nHost: localhost\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 200 "), received
    _still_serves(fake_client)


@pytest.mark.parametrize("request_line", [b"POST /nope HTTP/1.1", b"GET /v1/models HTTP/1.1",
                                          b"POST /health HTTP/1.1"])
def test_a_broken_chunked_body_is_the_json_error_without_a_traceback(fake_server, fake_client, request_line,
                                                                      caplog):
    """The headers parse, the app starts answering, then the body's framing breaks: the client gets the JSON 400
    and the app's own answer is dropped (it used to be sent on the broken connection, which uvicorn logged as
    "Exception in ASGI application", every time for a fast route)."""
    import logging

    uvicorn_logger = logging.getLogger("uvicorn.error")  # uvicorn's "uvicorn" logger does not propagate to root
    uvicorn_logger.addHandler(caplog.handler)
    try:
        for _ in range(5):
            received, closed = _raw_response(fake_server.base_url, request_line + b"\r\nHost: localhost\r\n"
                                             b"Authorization: Bearer x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                             b"zz\r\n")
            _assert_unparsable(received, closed)
        time.sleep(0.2)  # the app's answer, had it been sent, comes after the 400
    finally:
        uvicorn_logger.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert "bad chunked encoding" in UNPARSABLE_REQUEST_MESSAGE
    _still_serves(fake_client)


def test_client_disconnect_mid_upload_leaves_nothing_and_server_keeps_serving(fake_server, fake_client):
    host, port = fake_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: localhost\r\nContent-Type: multipart/form-data; boundary=Q\r\n"
                     b"Content-Length: 100000\r\n\r\n--Q\r\nContent-Disposition: form-data; name=\"video_reference\";"
                     b" filename=\"v.mp4\"\r\n\r\n" + b"a" * 5000)
    _still_serves(fake_client)
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []


@pytest.mark.parametrize("content_type", ["multipart/form-data; boundary=Q", "application/json"])
def test_a_body_that_stalls_is_a_408_and_its_connection_closed(fake_server, fake_client, monkeypatch, content_type):
    """A client that stops sending mid-body held its connection, handler and spooled bytes for as long as it kept the
    socket open (60 of them held 520 MB); after BODY_IDLE_S without a byte the server answers and closes."""
    monkeypatch.setattr(uploads, "BODY_IDLE_S", 0.5)
    start = b"--Q\r\nContent-Disposition: form-data; name=\"input_reference\"; filename=\"a.png\"\r\n\r\n" + b"a" * 5000 \
        if content_type.startswith("multipart") else b'{"prompt": "a fox'
    request = (b"POST /v1/videos HTTP/1.1\r\nHost: localhost\r\nContent-Type: " + content_type.encode()
               + b"\r\nContent-Length: 100000\r\n\r\n" + start)
    started = time.monotonic()
    received, closed = _raw_response(fake_server.base_url, request, timeout=10)
    assert closed and 0.4 < time.monotonic() - started < 8, received
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), head
    assert b'"code":"request_timeout"' in body.replace(b" ", b"") and b"no byte of the request body for 0.5 s" in body
    assert list(fake_server.artifacts.upload_dir.iterdir()) == []  # the part written so far is removed
    _still_serves(fake_client)


def test_api_key_is_required_everywhere_but_health(tmp_path, monkeypatch):
    server = start_server(tmp_path, api_key="s3cret")
    try:
        with server.client() as authorised, server.client(headers={}) as anonymous:
            assert anonymous.get("/health").status_code == 200
            assert anonymous.get("/health/").status_code == 200  # the same path to the key check and the router
            assert anonymous.get("/v1/models/").status_code == 401
            # The API's description opens in a browser, which sends no key (test_api.py: its bearer scheme).
            assert anonymous.get("/openapi.json").status_code == 200 and anonymous.get("/docs").status_code == 200
            for method, path in (("GET", "/v1/videos"), ("POST", "/v1/videos"), ("GET", "/v1/models"),
                                 ("GET", "/metrics"), ("POST", "/openapi.json"), ("GET", "/v1/videos/x/content"),
                                 ("DELETE", "/v1/videos/x")):
                response = anonymous.request(method, path)
                _assert_error(response, 401, code="invalid_api_key")
                assert response.headers["WWW-Authenticate"] == "Bearer"
            wrong = anonymous.get("/v1/models", headers={"Authorization": "Bearer nope"})
            _assert_error(wrong, 401)
            assert anonymous.get("/v1/models", headers={"Authorization": "s3cret"}).status_code == 401
            assert anonymous.get("/v1/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
            # The scheme's name is case-insensitive (RFC 9110 11.1).
            assert anonymous.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
            assert authorised.get("/v1/models").status_code == 200
            # The refused creates are counted, by their code, as the route counts its own refusals.
            assert re.search(r'^k6serve_requests_rejected_total\{reason="invalid_api_key"\} 1$',
                             authorised.get("/metrics").text, re.MULTILINE)
            _still_serves(authorised)
    finally:
        server.stop()
    from k6serve.serve.settings import settings_from_options

    monkeypatch.setenv("K6SERVE_API_KEY", "from-env")
    assert settings_from_options({}).api_key == "from-env"
    assert settings_from_options({"api_key": "flag"}).api_key == "flag"


def test_dead_replicas_make_health_degraded_then_503_and_new_work_is_refused(fake_server, fake_client, monkeypatch):
    # The engine's probe (MultiProcessWorker.dead_replicas, tested in test_multi_process_engine) stood in for here:
    # the fake server's worker runs in-process and cannot die.
    engine = fake_server.engine
    monkeypatch.setattr(type(engine), "num_replicas", property(lambda self: 2))
    dead = ["replica 1 (ranks [1]) died while idle: rank 1 (pid 7) exited with code -9"]
    monkeypatch.setattr(engine, "dead_replicas", lambda: list(dead))
    health = fake_client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "degraded", "memory_released": False, "dead_replicas": dead}
    dead.append("replica 0 (ranks [0]) died running request 3")
    health = fake_client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert "restart the server" in health.json()["message"] and health.json()["dead_replicas"] == dead
    _assert_error(fake_client.post("/v1/videos", json={"prompt": "x"}), 503, code="engine_unavailable",
                  contains="restart the server")
    _assert_error(fake_client.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", b"x")}),
                  503, code="engine_unavailable")
    for path in ("/v1/unmerge_lora_weights", "/release_memory_occupation"):
        _assert_error(fake_client.post(path), 503, code="engine_unavailable")
    _assert_error(fake_client.get("/v1/list_loras"), 503, code="engine_unavailable")
    assert fake_client.get("/v1/videos").status_code == 200  # what already ran can still be listed and fetched
    dead.clear()
    assert fake_client.get("/health").json() == {"status": "ok", "memory_released": False}


def test_jobs_queued_when_the_last_replica_dies_stay_queued_for_the_restart(fake_server, fake_client, monkeypatch):
    # They were started one after another and failed with "every worker replica has died", though the restart that
    # /health asks for would have run them: the job store keeps queued jobs across restarts.
    running = fake_client.post("/v1/videos", json={"prompt": "hold", "size": "32x32", "num_frames": 5}).json()
    wait_for(fake_client, running["id"], ("in_progress",))
    queued = fake_client.post("/v1/videos", json={"prompt": "next", "size": "32x32", "num_frames": 5}).json()
    dead: list[str] = []
    monkeypatch.setattr(fake_server.engine, "dead_replicas", lambda: list(dead))
    dead.append("replica 0 (ranks [0]) died while idle: rank 0 (pid 7) exited with code -9")
    fake_server.worker.release.set()  # the running job ends (the fake replica cannot really die)
    assert wait_for(fake_client, running["id"])["status"] == "completed"
    time.sleep(1.5)  # the dispatcher would have started the next job by now
    assert fake_client.get(f"/v1/videos/{queued['id']}").json()["status"] == "queued"
    dead.clear()  # as after the restart: the queued job runs
    assert wait_for(fake_client, queued["id"])["status"] == "completed"


def test_json_depth_counts_objects_and_arrays_without_recursing():
    from k6serve.serve.body_parsing import MAX_JSON_DEPTH, json_depth

    assert [json_depth(v) for v in (1, "x", None, {}, [], {"a": [1, {"b": 2}]}, [[[]]])] == [0, 0, 0, 1, 1, 3, 3]
    deep: list = []
    for _ in range(100_000):  # far past the interpreter's recursion limit
        deep = [deep]
    assert json_depth(deep) == 100_001 > MAX_JSON_DEPTH


def test_every_refused_create_is_counted_by_its_code(fake_client):
    """k6serve_requests_rejected_total counted only queue_full; a client sending bad requests did not show."""
    _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "size": "33x32"}), 400,
                  code="invalid_parameter")
    _assert_error(fake_client.post("/v1/videos", content=b"x", headers={"Content-Type": "text/plain"}), 415)
    metrics = fake_client.get("/metrics").text
    assert 'k6serve_requests_rejected_total{reason="invalid_parameter"} 1' in metrics
    assert 'k6serve_requests_rejected_total{reason="unsupported_content_type"} 1' in metrics


def test_web_pages_of_other_sites_are_refused_without_an_api_key(fake_server, fake_client):
    """Without --api-key, a web page could make jobs through a visitor's browser (a cross-site form POST needs no
    permission) and, re-pointing its own name at 127.0.0.1 (DNS rebinding), read every job; programs send no Origin
    and connect by a loopback name."""
    body = {"prompt": "from a page", "size": "32x32", "num_frames": 5}
    host, port = fake_server.base_url.removeprefix("http://").split(":")
    for headers, refused in ((({"Origin": "https://evil.example"}), "comes from a web page of another site "
                                                                    "(Origin 'https://evil.example')"),
                             ({"Origin": "null"}, "Origin 'null'"),
                             ({"Host": f"attacker.example:{port}"}, "its Host 'attacker.example:" + port + "' is not a "
                                                                    "loopback name")):
        error = _assert_error(fake_client.post("/v1/videos", json=body, headers=headers), 403,
                              code="cross_site_request", contains=refused)
        assert "start the server with --allowed-origin" in error["message"] and error["type"] == "permission_error"
    assert fake_client.get("/v1/videos").json()["data"] == []
    # Refused creates are counted as the route counts its own (they never reach it).
    assert 'k6serve_requests_rejected_total{reason="cross_site_request"} 3' in fake_client.get("/metrics").text
    for headers in ({"Origin": f"http://{host}:{port}"}, {"Host": f"localhost:{port}"}, {"Host": f"[::1]:{port}"},
                    {"Host": f"localhost.:{port}"}, {"Host": f"127.1:{port}"}, {"Host": f"[::ffff:127.0.0.1]:{port}"}):
        assert fake_client.get("/v1/videos", headers=headers).status_code == 200, headers
    # headers that do not parse are refused, not a 500
    for raw in (f"Host: {host}:{port}\r\nOrigin: http://[", "Host: [::1"):
        received, _ = _raw_response(fake_server.base_url, f"GET /v1/videos HTTP/1.1\r\n{raw}\r\n"
                                                           "Connection: close\r\n\r\n".encode())
        assert received.startswith(b"HTTP/1.1 403 ") and b"cross_site_request" in received, received
    assert fake_client.get("/health", headers={"Origin": "https://evil.example"}).status_code == 200


def test_with_an_api_key_the_key_decides_not_the_origin(tmp_path):
    server = start_server(tmp_path, api_key="k3y")
    try:
        with server.client() as client:
            headers = {"Origin": "https://app.example", "Host": "api.example"}
            assert client.get("/v1/videos", headers=headers).status_code == 200  # the client sends the key
            assert client.get("/v1/videos", headers={**headers, "Authorization": "Bearer nope"}).status_code == 401
    finally:
        server.stop()


def test_slow_input_checks_do_not_hold_health_or_the_other_routes(fake_server, fake_client, monkeypatch):
    """Large uploads' checks (image decodes, video probes) ran on asyncio's default pool, 6 threads on 2 cores:
    a dozen of them held every thread, and /health (which needs one) took 35 s. They have threads of their own."""
    import threading

    from k6serve.serve import video_creation

    release = threading.Event()
    checking = []

    def slow_check(*args):
        checking.append(1)
        release.wait(20)

    monkeypatch.setattr(video_creation, "check_inputs_readable", slow_check)
    creates = [threading.Thread(target=lambda: fake_client.post("/v1/videos", json={"prompt": f"slow {i}",
                                                                                      "size": "32x32",
                                                                                      "num_frames": 5}))
               for i in range(min(32, (os.cpu_count() or 1) + 4) + 2)]  # more than asyncio's default pool holds
    try:
        for thread in creates:
            thread.start()
        wait_until(lambda: len(checking) >= 2)
        started = time.monotonic()
        assert fake_client.get("/health").status_code == 200
        assert fake_client.get("/v1/videos").status_code == 200
        assert time.monotonic() - started < 5
    finally:
        release.set()
        for thread in creates:
            thread.join(30)


def test_each_job_that_ends_is_logged_once_and_only_the_unexpected_failure_with_its_traceback(tmp_path, caplog):
    """A job failed on its input (a worker ValueError) was in no log line at all, and an unexpected failure was
    logged twice (the engine's traceback, then the runner's line)."""
    from harness import FakeWorker

    from k6serve.models.variants import VARIANTS

    class RefusingWorker(FakeWorker):
        def run(self, params, output, on_step=None):
            if params.prompt == "refuse":
                raise ValueError("the worker refuses this request")
            return super().run(params, output, on_step)

    server = start_server(tmp_path, worker=RefusingWorker(VARIANTS["pro-distill"]))
    try:
        with caplog.at_level("INFO"), server.client() as client:
            ids = {}
            for prompt in ("refuse", "fail", "fine"):
                ids[prompt] = client.post("/v1/videos", json={"prompt": prompt, "size": "32x32",
                                                               "num_frames": 5}).json()["id"]
                wait_for(client, ids[prompt])
        mentions = {prompt: [record for record in caplog.records if job_id in record.getMessage()
                             and record.name.startswith("k6serve")] for prompt, job_id in ids.items()}
        # One INFO line when each starts, then the one that says how it ended.
        for prompt, records in mentions.items():
            assert records[0].getMessage() == f"job {ids[prompt]} started" and records[0].levelname == "INFO"
        about = {prompt: records[1:] for prompt, records in mentions.items()}
        (refused,) = about["refuse"]
        assert refused.levelname == "WARNING" and refused.exc_info is None
        assert refused.getMessage() == (f"job {ids['refuse']} failed (invalid_request): the worker refuses this "
                                        "request")
        (failed,) = [record for record in about["fail"] if record.levelname in ("WARNING", "ERROR")]
        assert failed.levelname == "ERROR" and failed.exc_info is not None
        assert not [record for record in caplog.records if record.name == "k6serve.runtime.engine"
                    and record.levelname == "ERROR"]  # not a second time by the engine
        (done,) = about["fine"]
        # with the stages the engine timed, in the order they run (graphs_compiled, a count, is not one)
        assert done.levelname == "INFO" and re.fullmatch(rf"job {ids['fine']} completed in \d+\.\d s \(\d+\.\d s "
                                                         r"from its creation\); stages \(s\): encode 0\.00, "
                                                         r"denoise 0\.01, decode_video 0\.00, mux 0\.00",
                                                         done.getMessage()), done.getMessage()
    finally:
        server.stop()


def test_text_in_other_scripts_and_encodings(fake_server, fake_client):
    """Russian text through HTTP: a UTF-8 form reaches the job as typed; a Windows-1251 or KOI8-R form, a
    Windows-1251 JSON body and a UTF-16 form field are refused naming the encoding, not run as U+FFFD or control
    characters; a refused value is echoed as typed, not as \\u escapes."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    ok = fake_client.post("/v1/videos", content=b"prompt=%D0%9B%D0%B8%D1%81%D0%B0+" + "бежит".encode() + b"&"
                          b"size=32x32&num_frames=5", headers=form)
    assert ok.status_code == 200, ok.text
    assert wait_for(fake_client, ok.json()["id"])["status"] == "completed"
    assert fake_server.worker.requests[-1].prompt == "Лиса бежит"
    for encoding in ("cp1251", "koi8-r"):
        body = "prompt=" + urllib.parse.quote("Лиса бежит".encode(encoding))
        _assert_error(fake_client.post("/v1/videos", content=body.encode(), headers=form), 400, param="prompt",
                      code="invalid_form", contains="is not UTF-8 text (byte 1 of its value); send the form "
                                                    "percent-encoded as UTF-8")
    cp1251_json = '{"prompt": "Лиса"}'.encode("cp1251")
    _assert_error(fake_client.post("/v1/videos", content=cp1251_json,
                                   headers={"Content-Type": "application/json; charset=windows-1251"}), 400,
                  code="invalid_json", contains="it is not UTF-8 text (invalid continuation byte at byte 13); send "
                                                "JSON as UTF-8")
    utf16_field = fake_client.post("/v1/videos", files={"prompt": (None, "Лиса".encode("utf-16-le"),
                                                                   "text/plain; charset=utf-16le")})
    _assert_error(utf16_field, 400, param="prompt", contains="holds the control character U+001B at character 1")
    for text, contains in (("Лиса\x00бежит", "holds the control character U+0000 at character 5"),
                           ("\x1b[31mЛиса", "holds the control character U+001B at character 1")):
        _assert_error(fake_client.post("/v1/videos", json={"prompt": text}), 400, param="prompt", contains=contains)
    error = _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "seconds": "пять"}), 400,
                          param="seconds")
    assert '"пять"' in error["message"] and "\\u" not in error["message"]
    _still_serves(fake_client)


def test_openais_reference_objects_are_refused_saying_to_upload_the_file(fake_client):
    """OpenAI's input_reference {image_url} / {file_id}, as its SDKs send them in JSON or flattened in a form: the
    answer was "Unknown field 'input_reference[image_url]'" or "send it with multipart"."""
    for sent in ({"json": {"prompt": "x", "input_reference": {"image_url": "https://example.com/a.png"}}},
                 {"data": {"prompt": "x", "input_reference[file_id]": "file-abc"}},
                 {"json": {"prompt": "x", "video_reference": {"file_id": "file-abc"}}}):
        error = _assert_error(fake_client.post("/v1/videos", **sent), 400, code="invalid_parameter")
        assert "came as a reference object" in error["message"] and "fetches no URLs and has no Files API" in \
            error["message"] and "toFile(" in error["message"]
        assert error["param"] in ("input_reference", "video_reference")
    assert fake_client.get("/v1/videos").json()["data"] == []


def test_the_job_object_carries_openais_remix_field_as_null(fake_client):
    job = fake_client.post("/v1/videos", json={"prompt": "x", "size": "32x32", "num_frames": 5}).json()
    assert "remixed_from_video_id" in job and job["remixed_from_video_id"] is None


def test_a_reference_object_on_a_super_resolution_server_names_the_source_video(tmp_path):
    from harness import FakeWorker

    from k6serve.models.variants import VARIANTS

    server = start_server(tmp_path, worker=FakeWorker(VARIANTS["vsr-distilled2steps"]))
    try:
        with server.client() as client:
            error = _assert_error(client.post("/v1/videos", json={"input_reference": {"file_id": "file-1"}}), 400,
                                  code="invalid_parameter", param="input_reference")
            assert 'Path(\"input.mp4\")' in error["message"] and "server-side video_path" in error["message"]
    finally:
        server.stop()


def test_a_server_side_path_swapped_for_a_link_while_queued_fails_the_job_before_it_runs(fake_server, fake_client,
                                                                                          tmp_path):
    """The path is checked again as the job starts (`JobRunner._inputs_checked_again`): a folder in the allowed one
    replaced by a link out of it while the job waited was opened through the link."""
    inputs = tmp_path / "inputs"
    (inputs / "sub").mkdir()
    (inputs / "sub" / "ok.png").write_bytes(_png_bytes())
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "ok.png").write_bytes(_png_bytes())
    hold = fake_client.post("/v1/videos", json={"prompt": "hold", **SMALL}).json()  # holds the worker
    image = str(inputs / "sub" / "ok.png")
    queued = fake_client.post("/v1/videos", json={"prompt": "x", "image_path": image, **SMALL})
    assert queued.status_code == 200, queued.text
    (inputs / "sub").rename(inputs / "old")
    os.symlink(outside, inputs / "sub")
    fake_server.worker.release.set()
    assert wait_for(fake_client, hold["id"])["status"] == "completed"
    failed = wait_for(fake_client, queued.json()["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "path_not_allowed"
    assert failed["error"]["message"].startswith(
        "image_path passed the input check when the job was created but not when it started: image_path "
        f"{image!r} is outside the allowed input folders")
    assert [request.prompt for request in fake_server.worker.requests] == ["hold"]  # the worker never got it
    # a file swapped for another inside the allowed folders runs, as the path names it now
    os.unlink(inputs / "sub")
    (inputs / "old").rename(inputs / "sub")
    again = wait_for(fake_client, fake_client.post("/v1/videos", json={"prompt": "y", "image_path": image,
                                                                        **SMALL}).json()["id"])
    assert again["status"] == "completed" and fake_server.worker.requests[-1].image_path == image
