"""Text in other scripts and encodings outside HTTP: --config and prompt files, what a wrong encoding leaves of a
prompt, a console that cannot print Cyrillic, and a process whose filesystem encoding is not UTF-8."""

from __future__ import annotations

import io
import os
import sys

import pytest

from k6serve.cli.config_file import load_config_file
from k6serve.cli.prompt_file import read_prompt_file
from k6serve.cli.main import _printable_stdout
from k6serve.request import SamplingParams, unencodable_path
from k6serve.request_resolution import _check_prompt_texts


def test_a_config_file_is_utf8_whatever_the_locale_with_or_without_a_byte_order_mark(tmp_path, monkeypatch):
    """Path.read_text() took the locale's encoding: under ru_RU.CP1251 a UTF-8 file's Cyrillic prompt ran as
    mojibake; a JSON file with a byte-order mark was refused while YAML took one."""
    import locale

    monkeypatch.setattr(locale, "getpreferredencoding", lambda do_setlocale=True: "cp1251")
    monkeypatch.setattr(locale, "getencoding", lambda: "cp1251", raising=False)
    json_file = tmp_path / "run.json"
    json_file.write_bytes('\ufeff{"prompt": "Лиса бежит по снегу"}'.encode())
    assert load_config_file(str(json_file)) == {"prompt": "Лиса бежит по снегу"}
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_bytes("prompt: 一只狐狸\n".encode())
    assert load_config_file(str(yaml_file)) == {"prompt": "一只狐狸"}
    cp1251 = tmp_path / "cp1251.yaml"
    cp1251.write_bytes("prompt: Лиса\n".encode("cp1251"))
    with pytest.raises(ValueError, match=rf"^--config {cp1251} is not UTF-8 text \(invalid continuation byte at "
                                         r"byte 9\); save it as UTF-8\.$"):
        load_config_file(str(cp1251))


def test_a_utf16_prompt_file_is_refused_as_such(tmp_path):
    """Without a byte-order mark, UTF-16 Cyrillic is valid UTF-8 byte for byte: it ran as control characters."""
    for encoding in ("utf-16-le", "utf-16-be", "utf-16"):
        path = tmp_path / f"{encoding}.txt"
        path.write_bytes("Лиса бежит\nМедведь спит\n".encode(encoding))
        with pytest.raises(ValueError, match=r"holds NUL bytes, as a UTF-16 file does; save it as UTF-8\.$"):
            read_prompt_file(str(path))
    path = tmp_path / "utf8.txt"
    path.write_bytes("\ufeffЛиса бежит\r\nМедведь спит\r\n".encode())
    assert read_prompt_file(str(path)) == [(1, "Лиса бежит"), (2, "Медведь спит")]


@pytest.mark.parametrize(("text", "message"), [
    ("Лиса\udcd0\udcbb", "prompt is not valid Unicode text: character 5 is a lone surrogate (U+DCD0), what a "
                         "command line or file read under a non-UTF-8 locale leaves of non-ASCII text; use a UTF-8 "
                         "locale"),
    ("\x1b\x048\x04A\x04", "prompt holds the control character U+001B at character 1: text read in the wrong "
                           "encoding (a UTF-16 file read as UTF-8 has a control character beside every letter)"),
    ("cafÃ©\x85", "prompt holds the control character U+0085 at character 6"),
])
def test_what_a_wrong_encoding_leaves_of_a_prompt_is_refused(text, message):
    with pytest.raises(ValueError) as raised:
        _check_prompt_texts(SamplingParams(prompt=text))
    assert str(raised.value).startswith(message)
    # Tabs, line ends, emoji, ZWJ: text.
    _check_prompt_texts(SamplingParams(prompt="Лиса бежит\tпо снегу\r\n🦊 👨‍👩‍👧 café"))


def test_an_api_prompt_with_a_lone_surrogate_is_refused_before_the_worker(tiny_distill_dir):
    """It reached the tokenizer, which failed as 'a bug in k6serve'."""
    from k6serve import DiffGenerator
    from k6serve.engine_arguments import build_engine_config
    from k6serve.runtime.engine import Engine
    from k6serve.runtime.worker import ModelWorker

    config = build_engine_config(str(tiny_distill_dir), device="cpu")
    with DiffGenerator(Engine(config, worker=ModelWorker(config))) as generator:
        with pytest.raises(ValueError, match="prompt is not valid Unicode text"):
            generator.generate({"prompt": "Лиса\udcd0", "height": 32, "width": 32, "num_frames": 5,
                                "save_output": False})


def test_a_console_that_cannot_print_cyrillic_gets_escapes_not_a_failed_command(monkeypatch):
    """A saved video's Chinese path under a cp1251 stdout failed the command after the video was written."""
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="cp1251")
    monkeypatch.setattr(sys, "stdout", stdout)
    _printable_stdout()
    print("saved /out/视频/Лиса.mp4")
    stdout.flush()
    assert stdout.buffer.getvalue() == "saved /out/\\u89c6\\u9891/Лиса.mp4\n".encode("cp1251")
    utf8 = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", utf8)
    _printable_stdout()
    assert utf8.errors == "strict"  # a UTF-8 console prints everything: left as it is


def test_a_path_the_filesystem_encoding_cannot_hold_is_said_so(monkeypatch):
    """Under PYTHONUTF8=0 with LANG=C (or a CP1251 locale), a Cyrillic image_path was a 500 and a LoRA file that
    exists 'does not exist'."""
    monkeypatch.setattr(os, "fsencode", lambda path: path.encode("ascii"))
    monkeypatch.setattr(sys, "getfilesystemencoding", lambda: "ascii")
    assert unencodable_path("/data/clip.mp4") is None
    assert unencodable_path("/data/входные/лиса.png") == (
        "'/data/входные/лиса.png' has characters ('входные') that this process's filesystem encoding, ascii, cannot "
        "hold; run it under a UTF-8 locale (e.g. LANG=C.UTF-8) or with PYTHONUTF8=1")
    from k6serve.lora.adapter_file import resolve_adapter_file

    with pytest.raises(ValueError, match="^LoRA file '/loras/стиль.safetensors' has characters"):
        resolve_adapter_file("/loras/стиль.safetensors")
