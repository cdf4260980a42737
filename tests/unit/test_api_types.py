"""The public API as a type checker reads it (mypy and pyright are not test dependencies: the checks read the
source and the annotations the checkers read)."""

import ast
import inspect
import re
import types
import typing
from pathlib import Path

import pytest

import k6serve


def _statically_bound(tree: ast.Module) -> set[str]:
    """Names an import binds at module level or under `if typing.TYPE_CHECKING:`, as a checker sees them."""
    names: set[str] = set()
    for node in tree.body:
        body = node.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) else [node]
        if isinstance(node, ast.If) and ast.unparse(node.test).startswith("not "):
            continue
        for item in body:
            if isinstance(item, (ast.Import, ast.ImportFrom)):
                names.update(alias.asname or alias.name for alias in item.names)
    return names


def test_every_exported_name_is_visible_to_type_checkers():
    # DiffGenerator came only through the module's lazy __getattr__, so mypy and pyright typed it (and every
    # result a generator returns) as Any: no error was ever caught.
    tree = ast.parse(Path(inspect.getfile(k6serve)).read_text())
    assert set(k6serve.__all__) <= _statically_bound(tree)
    for name in k6serve.__all__:
        assert getattr(k6serve, name).__module__.startswith("k6serve.")


def test_the_names_api_py_re_exports_are_the_ones_in_their_modules():
    # `from k6serve.api import build_engine_config, split_kwargs` is the users' way in; the functions live in their own
    # modules (engine_arguments.py, request_arguments.py, output_checks.py, lora/arguments.py), and a copy kept here
    # instead of the import would drift from them unseen.
    from k6serve import api, engine_arguments, output_checks, request_arguments
    from k6serve.lora import arguments as lora_arguments

    homes = {name: module for module in (engine_arguments, output_checks, request_arguments, lora_arguments)
             for name in vars(module) if name in api.__all__}
    assert sorted(api.__all__) == sorted([*homes, "DiffGenerator"])
    for name, module in homes.items():
        assert getattr(api, name) is getattr(module, name), name


def test_diffgenerator_decorators_keep_the_method_types():
    # Annotated `Callable -> Callable`, they made set_lora, merge_lora_weights and the other decorated methods
    # `(*Any, **Any) -> Any` to mypy and pyright: a misspelled keyword or a wrong type went unseen.
    from k6serve import api_decorators

    for decorator in (api_decorators.in_callers_words, api_decorators.http_names_answered,
                      api_decorators.sglang_order_answered):
        hints = typing.get_type_hints(decorator)
        assert isinstance(hints["return"], typing.TypeVar) and hints["method"] is hints["return"], decorator


def test_public_methods_are_fully_annotated():
    # An unannotated return (the `variant` property) or a bare `dict` is Any, or dict[Any, Any], to a checker.
    from k6serve import DiffGenerator

    for name, member in vars(DiffGenerator).items():
        if name.startswith("_") and name not in ("__enter__", "__exit__"):
            continue
        function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if not callable(function):
            continue
        hints = typing.get_type_hints(inspect.unwrap(function))
        assert "return" in hints, name
        assert hints["return"] is not dict, name


def _kinds(hint: object) -> set[object]:
    """A type's union members, generics by their origin (`dict[str, Any]` as dict), None left out."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return {typing.get_origin(member) or member for member in members} - {type(None)}


def _keyword_types(function) -> dict[str, object]:
    """The keyword arguments a type checker reads off `function`: its named parameters and the keys of its
    `**kwargs: Unpack[TypedDict]`."""

    hints = typing.get_type_hints(function)
    (typed_dict,) = typing.get_args(hints.pop("kwargs"))
    hints.pop("return")
    return {**hints, **typing.get_type_hints(typed_dict)}


def test_typed_keyword_arguments_follow_sampling_params():
    # generate / agenerate / upscale take the request's fields as `**kwargs: Unpack[...]`, so a checker catches a
    # misspelled keyword or a wrong type; a field added to SamplingParams and not to the TypedDicts (or a
    # TypedDict key no field has) fails here. Every key is optional (None is the default), and takes at least the
    # field's own types (paths also as os.PathLike).
    import os

    from k6serve import DiffGenerator, SamplingParams
    from k6serve.request import _PATH_FIELDS, GenerateKwargs

    fields = typing.get_type_hints(SamplingParams)
    overloads = [*typing.get_overloads(DiffGenerator.generate), *typing.get_overloads(DiffGenerator.agenerate)]
    assert len(overloads) == 10
    for function in [*overloads, inspect.unwrap(DiffGenerator.upscale)]:
        keywords = _keyword_types(function)
        for name in ("sampling_params_kwargs", "on_progress", "progress_bar"):
            keywords.pop(name, None)
        # upscale takes no prompt (the SR model refuses one); its video_path is its first argument. An overload of a
        # request dict whose prompt it leaves to the dict takes no prompt keyword (which would win over the dict's).
        no_prompt = function.__name__ == "upscale" or "prompt" not in keywords
        assert set(keywords) == set(fields) - ({"prompt"} if no_prompt else set()), function
        for name, hint in keywords.items():
            kinds = _kinds(hint)
            if name == "prompt" and kinds == {list, tuple}:
                continue  # the overload of a list of prompts, which returns a list
            assert _kinds(fields[name]) <= kinds, (function, name)
            assert (os.PathLike in kinds) == (name in _PATH_FIELDS), (function, name)
    assert GenerateKwargs.__required_keys__ == frozenset()
    assert sorted(GenerateKwargs.__optional_keys__) == sorted(fields)


def _prompt_is_list(hint: object) -> bool | None:
    """Whether a prompt of this type is a list (True), never one (False), or may be either (None)."""
    kinds = _kinds(hint)
    if kinds <= {list, tuple}:
        return True
    return None if kinds & {list, tuple, object} else False


def _request_prompt_is_list(request: object) -> bool | None:
    """`_prompt_is_list` of the prompt a `sampling_params_kwargs` of this type holds: a TypedDict's is its key's,
    a SamplingParams' a str (it refuses a list), and an untyped Mapping's unknown."""
    from k6serve import SamplingParams

    answers = set()
    for member in typing.get_args(request) if typing.get_origin(request) in (typing.Union, types.UnionType) \
            else (request,):
        if member is type(None) or member is SamplingParams:
            answers.add(False)
        elif typing.is_typeddict(member):
            answers.add(_prompt_is_list(typing.get_type_hints(member)["prompt"]))
        else:
            answers.add(None)  # Mapping[str, Any]: its prompt may be anything
    return answers.pop() if len(answers) == 1 else None


def test_generate_is_typed_as_returning_a_list_exactly_where_a_list_of_prompts_may_come():
    # generate({"prompt": ["A cat", "A dog"]}) returns a list at run time, but the overload of a request dict said
    # `-> VideoResult`: a checker let `result.output_file_path` through, which failed on the list. Each overload's
    # return now follows the prompt it can be given: the prompt keyword (which wins over the dict's), else the
    # request's (a TypedDict's key; an untyped dict's may be a list: one result or a list).
    from k6serve import DiffGenerator, VideoResult

    seen = set()
    for method in (DiffGenerator.generate, DiffGenerator.agenerate):
        for overload in typing.get_overloads(method):
            hints = typing.get_type_hints(overload)
            keywords = _keyword_types(overload)
            if "prompt" in keywords:
                is_list = _prompt_is_list(keywords["prompt"])
            else:
                is_list = _request_prompt_is_list(hints["sampling_params_kwargs"])
            returns = typing.get_args(hints["return"]) if typing.get_origin(hints["return"]) in (
                typing.Union, types.UnionType) else (hints["return"],)
            expected = {True: {list[VideoResult]}, False: {VideoResult}, None: {VideoResult, list[VideoResult]}}
            assert set(returns) == expected[is_list], (method.__name__, hints)
            seen.add((method.__name__, is_list))
    # Each method has an overload of each kind: a list of prompts, one prompt, and an untyped request dict.
    assert seen == {(name, kind) for name in ("generate", "agenerate") for kind in (True, False, None)}
    # The request dict of a list of prompts is a type of its own, whose prompt must be given.
    from k6serve.request import PromptListRequest

    # (Its __required_keys__ misses it on Python 3.11, which does not read Required in a string annotation.)
    hint = typing.get_type_hints(PromptListRequest, include_extras=True)["prompt"]
    assert typing.get_origin(hint) is typing.Required
    assert _prompt_is_list(typing.get_type_hints(PromptListRequest)["prompt"]) is True


def test_set_lora_takes_what_it_accepts_at_run_time():
    # A pathlib path (turned into a str by os.fspath) and a list[str] / list[int] variable (lists are invariant:
    # list[str] is no list[str | None]) were refused by checkers: `path: str | list[str | None] | None`.
    import collections.abc
    import os

    from k6serve import DiffGenerator

    hints = typing.get_type_hints(inspect.unwrap(DiffGenerator.set_lora))
    assert {str, os.PathLike, collections.abc.Sequence} <= _kinds(hints["path"])
    assert list not in _kinds(hints["path"]) | _kinds(hints["strength"])
    sequence_items = [typing.get_args(member)[0] for member in typing.get_args(hints["path"])
                      if typing.get_origin(member) is collections.abc.Sequence]
    assert _kinds(sequence_items[0]) == {str, os.PathLike}


def test_progress_callbacks_may_return_anything():
    # on_progress's return is ignored; typed `-> None`, a checker refused `def on_step(step, total) -> bool`. The
    # layers it passes through (the API, the engine, the workers, the pipelines) had five definitions of it, three
    # typed `-> None`: one now, in request.py.
    from k6serve import api
    from k6serve.pipelines import denoise, sr_stages, super_resolution, text_to_video
    from k6serve.request import ProgressCallback
    from k6serve.runtime import engine, mp4_output, process_group_worker, rank_process, worker

    assert typing.get_args(ProgressCallback)[-1] is object
    for module in (api, engine, worker, rank_process, process_group_worker, mp4_output, denoise, sr_stages,
                   super_resolution, text_to_video):
        assert module.ProgressCallback is ProgressCallback, module.__name__


def test_engine_options_are_the_options_from_pretrained_takes():
    # from_pretrained took `**kwargs: Any`: `num_gpu=1` or `num_gpus="1"` reached a checker unseen, and failed only
    # when the script ran. Its keys are what build_engine_config takes at run time (every config section's field but
    # model_path, from_pretrained's own argument), each with at least the field's own types.
    import collections.abc
    import dataclasses
    import os

    import torch

    from k6serve import DiffGenerator, EngineOptions
    from k6serve.engine_arguments import ENGINE_SECTIONS, build_engine_config

    # No namespace given: the torch annotations resolve in the module's own (torch imported on demand).
    hints = typing.get_type_hints(DiffGenerator.from_pretrained)
    assert typing.get_args(hints["kwargs"]) == (EngineOptions,)
    options = typing.get_type_hints(EngineOptions)
    assert options["dtype"] == str | torch.dtype and options["device"] == str | torch.device
    fields = {item.name: item for cls in ENGINE_SECTIONS for item in dataclasses.fields(cls)}
    field_types = {name: hint for cls in ENGINE_SECTIONS for name, hint in typing.get_type_hints(cls).items()}
    del fields["model_path"]
    assert sorted(options) == sorted(fields)
    assert EngineOptions.__required_keys__ == frozenset()
    for name, item in fields.items():
        default = item.default if item.default is not dataclasses.MISSING else item.default_factory()
        build_engine_config("demo", **{name: default})  # taken at run time, as its own default
        kinds = _kinds(options[name])
        for kind in _kinds(field_types[name]):
            assert any(issubclass(kind, accepted) for accepted in kinds), (name, kind)
        # None is in the type exactly where the run time takes it (an optional field, or "no names given").
        admits_none = type(None) in typing.get_args(options[name])
        try:
            build_engine_config("demo", **{name: None})
        except ValueError:
            assert not admits_none, name
        else:
            assert admits_none, name
    # The other spellings the type admits are taken at run time too; a name outside it is refused.
    build_engine_config("demo", dtype=torch.float32, device=torch.device("cpu"), lora_path=os.path.abspath("x"),
                        cpu_offload_components="vae", layerwise_offload_components=("text_encoder",),
                        component_residency={"vae": "resident"}, warmup_mode="server", warmup_resolutions=["64x96"],
                        cache_dit_config={"residual_diff_threshold": 0.1})
    build_engine_config("demo", quantization="fp8", quantization_ignored_layers=["a"],
                        component_residency=[("vae", "resident")], warmup_mode="server",
                        warmup_resolutions="64x96x5", cache_dit_config='{"residual_diff_threshold": 0.1}')
    assert collections.abc.Mapping in _kinds(options["component_residency"])
    with pytest.raises(ValueError, match="Unknown engine option 'num_gpu'"):
        build_engine_config("demo", num_gpu=1)


_CHECKED = '''
from typing import Any

from k6serve import DiffGenerator, GenerateKwargs

generator = DiffGenerator.from_pretrained("demo", num_gpus=1, attention_backend="sdpa")
untyped: dict[str, Any] = {"prompt": ["A cat", "A dog"]}
reveal_type(generator.generate({"prompt": ["A cat", "A dog"], "seed": 7}))
reveal_type(generator.generate({"prompt": "A cat", "seed": 7}))
reveal_type(generator.generate(prompt=["A cat", "A dog"]))
reveal_type(generator.generate(untyped))
reveal_type(generator.generate(untyped, prompt="A cat"))
options: GenerateKwargs = {"prompt": "A cat"}
reveal_type(generator.generate(**options))
DiffGenerator.from_pretrained("demo", num_gpu=1)
DiffGenerator.from_pretrained("demo", num_gpus="1")
reveal_type(generator.list_loras()["loras"][0]["merge_mode"])
reveal_type(generator.release_memory()["ranks"][0]["moved_bytes_by_owner"])
generator.set_lora("style", "style.safetensors")["lora"]


async def main() -> None:
    reveal_type(await generator.agenerate({"prompt": ["A cat"]}))
'''


def test_mypy_reads_the_api_as_it_behaves(tmp_path, monkeypatch):
    # The tests above read the annotations; this asks mypy itself, where it is installed (not a test dependency):
    # the return follows the prompt, and a misspelt or mistyped engine option is an error.
    mypy_api = pytest.importorskip("mypy.api")
    (tmp_path / "checked.py").write_text(_CHECKED)
    monkeypatch.setenv("MYPYPATH", str(Path(inspect.getfile(k6serve)).parents[1]))  # this checkout's k6serve
    # Without site-packages (torch, numpy, ... read as Any): k6serve's own annotations are what is checked.
    report, _, _ = mypy_api.run(["--follow-imports=silent", "--ignore-missing-imports", "--no-site-packages",
                                 "--no-error-summary", "--cache-dir", str(tmp_path / "cache"),
                                 str(tmp_path / "checked.py")])
    one, many = '"k6serve.request.VideoResult"', '"list[k6serve.request.VideoResult]"'
    revealed = re.findall(r'Revealed type is (".*")', report)
    either = '"k6serve.request.VideoResult | list[k6serve.request.VideoResult]"'
    # The LoRA and memory replies are TypedDicts (they were dict[str, Any]: any key, any value).
    merge_mode, moved = "\"Literal['merge'] | Literal['dynamic'] | None\"", '"dict[str, int]"'
    assert revealed == [many, one, many, either, one, one, merge_mode, moved, many], report
    assert 'Unexpected keyword argument "num_gpu" for "from_pretrained"' in report, report
    assert 'Argument "num_gpus" to "from_pretrained" of "DiffGenerator" has incompatible type "str"' in report, report
    assert 'TypedDict "LoraChange" has no key "lora"' in report, report
    assert report.count("error:") == 3, report


def test_a_missing_media_package_is_warned_of_before_the_load_under_the_apis_logger(monkeypatch, caplog):
    # from_pretrained says it before the load (minutes for a real checkpoint); the requests that write an MP4 are
    # refused later, the frames-only ones still run.
    from k6serve import output_checks
    from k6serve.dependencies import MissingPackage

    def missing(module, needed_for):
        raise MissingPackage(f"PyAV ({module}) is needed {needed_for}: pip install av.")

    monkeypatch.setattr(output_checks, "require_package", missing)
    with caplog.at_level("WARNING", logger="k6serve.api"):
        output_checks.warn_without_media_package()
    assert [record.name for record in caplog.records] == ["k6serve.api"]
    assert caplog.records[0].getMessage() == ("PyAV (av) is needed to write the MP4: pip install av. Until then "
                                              "generate() runs only requests with save_output=False and no source "
                                              "video.")
