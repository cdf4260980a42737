"""A demanding client's edge cases: OpenAI `size` / `seconds` parsing, JSON types, and the errors they get."""

from __future__ import annotations

import pytest
from test_errors import _assert_error


@pytest.mark.parametrize("field", ["seed", "num_frames", "fps", "guidance_scale", "num_inference_steps", "seconds"])
def test_json_booleans_are_not_numbers(fake_client, field):
    # Pydantic's lax mode read true as 1: seed 1, one frame, 1 fps... all silently accepted.
    error = _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", field: True}), 400, param=field,
                          code="invalid_parameter")
    assert error["message"] == f"{field} must be a number, got true."


def test_boolean_prompt_says_string(fake_client):
    _assert_error(fake_client.post("/v1/videos", json={"prompt": False}), 400, param="prompt",
                  contains="prompt must be a string, got false.")


@pytest.mark.parametrize("size", ["\uff17\uff16\uff18x512", "\u00b2x512", "768x512\u0661", "-768x512"])
def test_size_needs_ascii_digits(fake_client, size):
    # Full-width digits were accepted as 768; '²' failed with "invalid literal for int() with base 10".
    _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "size": size}), 400, param="size",
                  contains="'WIDTHxHEIGHT' in ASCII digits, width first")


def test_size_tolerates_case_and_spaces(fake_client):
    response = fake_client.post("/v1/videos", json={"prompt": "x", "size": " 64 X 32 ", "num_frames": 5})
    assert response.status_code == 200, response.text
    assert response.json()["size"] == "64x32"


def test_size_errors_name_size_not_width(fake_client):
    error = _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "size": "770x512"}), 400,
                          param="size", code="invalid_parameter")
    assert error["message"].startswith("size '770x512' (width x height): width must be a positive multiple of 16")


def test_seconds_errors_name_seconds_not_num_frames(fake_client):
    error = _assert_error(fake_client.post("/v1/videos", json={"prompt": "x", "seconds": "600"}), 400,
                          param="seconds", code="invalid_parameter")
    assert error["message"].startswith("seconds '600' at 24 fps means 14401 frames: num_frames 14401 gives more")


@pytest.mark.parametrize("seconds", ["1e400", "[4]", '{"s": 4}'])
def test_seconds_of_the_wrong_type(fake_client, seconds):
    # 1e400 decodes to inf: the message was "seconds.str: Input should be a valid string (got inf)".
    response = fake_client.post("/v1/videos", content=f'{{"prompt": "x", "seconds": {seconds}}}',
                                headers={"Content-Type": "application/json"})
    _assert_error(response, 400, param="seconds", contains='seconds must be a number in (0, 600] such as "4" or 4')
