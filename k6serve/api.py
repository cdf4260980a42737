"""The Python API: `DiffGenerator`, compatible with the seed documents' example.

    with DiffGenerator.from_pretrained(model_path="...", num_gpus=1) as generator:
        result = generator.generate(sampling_params_kwargs={"prompt": "...", "seed": 42})
        print(result.output_file_path)

LoRA adapters (`set_lora`, `merge_lora_weights`, `unmerge_lora_weights`, `list_loras`) are changed between requests,
in order with them, on every rank of every replica.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

from k6serve.api_decorators import http_names_answered, in_callers_words, sglang_order_answered
from k6serve.api_errors import flags_as_keywords, reworded_errors
from k6serve.engine_arguments import (
    EngineOptions,
    build_engine_config,
    check_local_mode,
    model_path_of,
    options_with_server_args,
)
from k6serve.lora.arguments import (
    HTTP_LORA_NAMES,
    LoraArgumentError,
    LoraPaths,
    merge_lora_operation,
    set_lora_operation,
    unload_lora_operation,
    unmerge_lora_operation,
)
from k6serve.lora.spec import ListLoras, LoraChange, LoraListing
from k6serve.lora.preflight import check_start_adapter
from k6serve.models.checkpoint_files import ignored_revision_note
from k6serve.models.variants import GENERATION, Variant
from k6serve.output_checks import (
    check_output,
    check_output_folder,
    final_file_name,
    require_media_package,
    unsaved_output_keys,
    warn_without_media_package,
)
from k6serve.request import (
    GenerateKwargs,
    OutputOptions,
    PromptListOptions,
    ProgressCallback,
    PromptListRequest,
    RequestOptions,
    SamplingParams,
    VideoResult,
    drawn_seed,
    fspath_values,
    plain_scalars,
)
from k6serve.request_arguments import check_progress_bar, request_options, split_kwargs
from k6serve.prompt_lists import Listed, run_side_by_side, shown_prompt, stopped_list
from k6serve.request_refusals import MissingPrompt, MissingSourceVideo
from k6serve.runtime.engine import Engine
from k6serve.runtime.memory import MemoryReply
from k6serve.media.image import looks_like_url
from k6serve.media.output_names import numbered_file_names

# The Python API's names, `DiffGenerator` and those defined beside it: `from k6serve.api import build_engine_config,
# split_kwargs` keeps working, the functions re-exported from their own modules (engine_arguments.py,
# request_arguments.py, output_checks.py, lora/arguments.py), where k6serve's own code imports them.
__all__ = [
    "DiffGenerator",
    "HTTP_LORA_NAMES",
    "LoraArgumentError",
    "build_engine_config",
    "check_output",
    "check_output_folder",
    "final_file_name",
    "merge_lora_operation",
    "request_options",
    "require_media_package",
    "set_lora_operation",
    "split_kwargs",
    "unload_lora_operation",
    "unmerge_lora_operation",
    "unsaved_output_keys",
]

logger = logging.getLogger(__name__)
# The generators not yet shut down. A notebook cell that runs `generator = DiffGenerator.from_pretrained(...)` again
# loads the new model while the name still holds the old one, so both are in memory until the load ends: a second
# load beside a running generator is warned about before it starts.
_RUNNING: "weakref.WeakSet[DiffGenerator]" = weakref.WeakSet()


def _from_here(path: Any, *, existing_only: bool) -> Any:
    """A relative `path` made absolute from this process's folder (`DiffGenerator._from_callers_folder`); with
    `existing_only`, only one that exists here (a LoRA path may be a hub id). A URL or data URI is left as it is,
    for its own refusal (k6serve fetches no URLs), as are empty and non-path values."""
    if not isinstance(path, (str, os.PathLike)):
        return path
    text = os.path.expanduser(os.fspath(path))
    if not text.strip() or looks_like_url(text) or (existing_only and not os.path.exists(text)):
        return path
    return os.path.abspath(text)


class DiffGenerator:
    """Loads a Kandinsky 6 checkpoint once and generates (or upscales) videos with it.

        with DiffGenerator.from_pretrained(model_path="demo") as generator:
            result = generator.generate(prompt="A cat plays piano", seed=42)

    The model runs in worker processes (one per GPU); `shutdown()`, the end of the `with` block, or dropping the
    last reference to the generator stops them and frees their memory. In a notebook, call `shutdown()` (or use
    `with`): a cell that showed the generator keeps a reference to it in IPython's output history (`Out`, `_`), so
    `del generator` leaves its workers running. Its ValueErrors name the keyword arguments (`num_gpus=4`) where the
    CLI names its flags (`--num-gpus 4`).
    """

    def __init__(self, engine: Engine, *, wording: Callable[[str], str] = flags_as_keywords) -> None:
        self.engine = engine
        # The engine's checks, shared with the CLI and the server, name CLI flags (`--num-gpus 4`); a Python caller
        # reads the keywords it passes (`num_gpus=4`, api_errors.py). `k6serve generate` keeps the flags (`str`).
        self._wording = wording
        # A generator dropped without shutdown() (a notebook cell run again rebinds its name) kept its worker
        # processes, and their GPU memory, until the interpreter exited.
        self._shutdown = weakref.finalize(self, engine.shutdown)
        _RUNNING.add(self)
        # The worker processes keep the folder they started in; a caller that moves (a notebook's %cd) gives its
        # relative paths from where it is (`_from_callers_folder`).
        self._start_folder = os.getcwd()

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike[str] | None = None, *, local_mode: bool = True,
                        server_args: Mapping[str, Any] | None = None,
                        **kwargs: Unpack[EngineOptions]) -> "DiffGenerator":
        """Load `model_path` (a local Diffusers folder, a hub id, or "demo" / "demo-sr": the built-in tiny random
        checkpoints) and start its worker processes. `kwargs` are the engine options, the CLI's flags with underscores
        (num_gpus, performance_mode, attention_backend, warmup_mode, device, ...; docs/cli.md lists them), typed
        for checkers by `EngineOptions`. A bad option raises ValueError before anything loads, naming the keywords
        (e.g. `num_gpus=4`); request parameters (prompt, seed, ...) go to `generate`.

        SGLang's two other arguments are taken as it defines them: `server_args`, the engine options as a dict
        (`model_path` may be one of them), under the keyword arguments (a keyword given in both wins, as SGLang's
        doc ranks them); `local_mode=True`, the only mode, as the workers always run here."""
        with reworded_errors(flags_as_keywords):
            check_local_mode(local_mode)
            options = options_with_server_args(server_args, kwargs)
            model_path = model_path_of(model_path, options)
            warn_without_media_package()
            return cls._load(model_path, options, wording=flags_as_keywords)

    @classmethod
    def from_server_args(cls, server_args: Mapping[str, Any], local_mode: bool = True) -> "DiffGenerator":
        """SGLang's other constructor: `from_pretrained(server_args=server_args)`, the model path among them."""
        return cls.from_pretrained(server_args=server_args, local_mode=local_mode)

    @classmethod
    def from_cli_options(cls, model_path: str, **options: Any) -> "DiffGenerator":
        """`from_pretrained` for `k6serve generate`: the same checks and load, and a generator whose errors and
        warnings name the flags the options came from."""
        return cls._load(model_path, options, wording=str)

    @classmethod
    def _load(cls, model_path: str | os.PathLike[str], options: dict[str, Any], *,
              wording: Callable[[str], str]) -> "DiffGenerator":
        config = build_engine_config(model_path, **options)
        note = ignored_revision_note(config.model.model_path, config.model.revision, config.model.load_format)
        if note is not None:
            logger.warning(wording(note))  # before the load, which can take minutes
        check_start_adapter(config)  # a bad --lora-path adapter: refused now, not after the load
        # A generator whose every replica died holds no model (its processes are gone): not counted.
        running = sorted(generator.engine.config.model.model_path for generator in list(_RUNNING)
                         if len(generator.engine.dead_replicas()) < generator.engine.num_replicas)
        if running:
            logger.warning(
                f"{len(running)} generator(s) loaded earlier ({', '.join(map(repr, running))}) still hold their "
                "model and its memory until shut down; this one loads beside them. Call shutdown() on one you are "
                "replacing first (or open generators with `with DiffGenerator.from_pretrained(...) as generator:`).")
        return cls(Engine(config), wording=wording)

    @property
    def variant(self) -> Variant:
        """The loaded checkpoint's model variant (its family, defaults and limits)."""
        return self.engine.variant

    if not typing.TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any attribute as valid
        def __getattr__(self, name: str) -> Any:
            # Only for names the instance lacks: SGLang's generate_with_lora got a bare AttributeError.
            if name == "generate_with_lora":
                raise AttributeError(
                    "'DiffGenerator' object has no attribute 'generate_with_lora' (SGLang's method; load the adapter "
                    "with set_lora(nickname, path, merge_mode='dynamic'), then generate(prompt=..., loras={nickname: "
                    "strength}) for that request alone, or generate() with the adapters set_lora made active)",
                    name=name, obj=self)
            raise AttributeError(f"'DiffGenerator' object has no attribute {name!r}", name=name, obj=self)

    def __repr__(self) -> str:
        # A notebook shows this for a bare `generator`: which model, and whether it still holds its workers.
        state = "running" if self._shutdown.alive else "shut down"
        return f"<DiffGenerator {str(self.engine.config.model.model_path)!r}, {state}>"

    def _require_running(self) -> None:
        if not self._shutdown.alive:
            raise RuntimeError("This DiffGenerator has been shut down (shutdown() or the end of its `with` block); "
                               "load a new one with DiffGenerator.from_pretrained(...).")

    @typing.overload
    def generate(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None = None, *,
                 prompt: list[str] | tuple[str, ...], on_progress: ProgressCallback | None = None,
                 progress_bar: bool = False, **kwargs: Unpack[PromptListOptions]) -> list[VideoResult]: ...

    @typing.overload
    def generate(self, sampling_params_kwargs: PromptListRequest, *, on_progress: ProgressCallback | None = None,
                 progress_bar: bool = False, **kwargs: Unpack[PromptListOptions]) -> list[VideoResult]: ...

    @typing.overload
    def generate(self, sampling_params_kwargs: GenerateKwargs | SamplingParams | None = None, *,
                 on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                 **kwargs: Unpack[GenerateKwargs]) -> VideoResult: ...

    @typing.overload
    def generate(self, sampling_params_kwargs: Mapping[str, Any], *, prompt: str | None,
                 on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                 **kwargs: Unpack[PromptListOptions]) -> VideoResult: ...

    # An untyped dict (`dict[str, Any]`, or the `dict[str, object]` a dict of mixed values is inferred as) may hold
    # a list of prompts, which a checker cannot see: one result or a list, as at run time.
    @typing.overload
    def generate(self, sampling_params_kwargs: Mapping[str, Any], *, on_progress: ProgressCallback | None = None,
                 progress_bar: bool = False,
                 **kwargs: Unpack[PromptListOptions]) -> VideoResult | list[VideoResult]: ...

    @in_callers_words
    def generate(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None = None, *,
                 on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                 **kwargs: Any) -> VideoResult | list[VideoResult]:
        """Run one request and return its `VideoResult`; a list of prompts runs one request per prompt and returns
        their results in a list (`_each_prompt`). The request is a dict (the seed's sampling_params_kwargs),
        keyword arguments, or both (keywords win): every SamplingParams field plus save_output (default True),
        output_path (default "outputs"), output_file_name, return_frames and return_file_paths_only (the seed's
        names); None for any of them means its default. The frames and the waveform are returned with
        return_frames=True or return_file_paths_only=False, and with save_output=False unless return_frames=False
        (without a file they are the result). A `SamplingParams` object (the class is exported)
        stands for the fields it sets away from their defaults.

        The request and the output are checked before it runs: bad input raises ValueError naming the key and the
        fix, and writes nothing. `on_progress(step, total)` runs after every denoising step (SR: every DiT call),
        then again with `(total, total)` after each chunk of the video decode; raising from it (or Ctrl-C) stops
        the request there, with no file left behind. `progress_bar=True` shows the CLI's bar over the steps on
        stderr (in a notebook, under the cell), beside any on_progress. Several threads may call this at once:
        requests run in order (N at a time with dp_size=N). A list of prompts runs N at a time with dp_size=N too:
        on_progress then hears every running prompt's steps, interleaved, and the bar counts finished prompts.
        From asyncio code, `await generator.agenerate(...)`."""
        if (listed := self._each_prompt(sampling_params_kwargs, on_progress, kwargs)) is not None:
            if self.engine.num_replicas > 1 and len(listed) > 1:
                self.engine.check_not_own_thread("a request")  # as Engine.generate: the list waits on its replicas
                return self._side_by_side(listed, on_progress, progress_bar, threading.Event())
            results: list[VideoResult] = []
            for params, output, warnings in listed:
                # The bar first: a bad progress_bar is refused as it is, not as a prompt that stopped the list.
                with self._step_bar(on_progress, progress_bar) as on_step, stopped_list(listed, results):
                    results.append(self.engine.generate(params, output, on_progress=on_step))
                results[-1].notes[:0] = warnings
            return results
        params, output, warnings = self._checked_request(sampling_params_kwargs, on_progress, kwargs)
        with self._step_bar(on_progress, progress_bar) as on_step:
            result = self.engine.generate(params, output, on_progress=on_step)
        result.notes[:0] = warnings
        return result

    @typing.overload
    async def agenerate(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None = None, *,
                        prompt: list[str] | tuple[str, ...], on_progress: ProgressCallback | None = None,
                        progress_bar: bool = False, **kwargs: Unpack[PromptListOptions]) -> list[VideoResult]: ...

    @typing.overload
    async def agenerate(self, sampling_params_kwargs: PromptListRequest, *, on_progress: ProgressCallback | None = None,
                        progress_bar: bool = False, **kwargs: Unpack[PromptListOptions]) -> list[VideoResult]: ...

    @typing.overload
    async def agenerate(self, sampling_params_kwargs: GenerateKwargs | SamplingParams | None = None, *,
                        on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                        **kwargs: Unpack[GenerateKwargs]) -> VideoResult: ...

    @typing.overload
    async def agenerate(self, sampling_params_kwargs: Mapping[str, Any], *, prompt: str | None,
                        on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                        **kwargs: Unpack[PromptListOptions]) -> VideoResult: ...

    # An untyped dict (`dict[str, Any]`, or the `dict[str, object]` a dict of mixed values is inferred as) may hold
    # a list of prompts, which a checker cannot see: one result or a list, as at run time.
    @typing.overload
    async def agenerate(self, sampling_params_kwargs: Mapping[str, Any], *, on_progress: ProgressCallback | None = None,
                        progress_bar: bool = False,
                        **kwargs: Unpack[PromptListOptions]) -> VideoResult | list[VideoResult]: ...

    @in_callers_words
    async def agenerate(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None = None, *,
                        on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                        **kwargs: Any) -> VideoResult | list[VideoResult]:
        """`generate` for asyncio code (a web app, a notebook's event loop): the same request, checks and result,
        awaited without blocking the loop. Cancelling the awaiting task (asyncio.wait_for's timeout, task.cancel())
        cancels the request at its next step boundary, with no file left behind; several may be awaited at once
        (asyncio.gather), run in order as threads' generate() calls are. Super-resolution: pass video_path=."""
        if (listed := self._each_prompt(sampling_params_kwargs, on_progress, kwargs)) is not None:
            if self.engine.num_replicas > 1 and len(listed) > 1:
                import asyncio

                self.engine.check_not_own_thread("a request")  # as Engine.agenerate: the list waits on its replicas
                stop = threading.Event()
                try:
                    return await asyncio.to_thread(self._side_by_side, listed, on_progress, progress_bar, stop)
                except asyncio.CancelledError:
                    stop.set()  # the thread stops the running prompts at their next step
                    raise
            results: list[VideoResult] = []
            for params, output, warnings in listed:
                # The bar first: a bad progress_bar is refused as it is, not as a prompt that stopped the list.
                with self._step_bar(on_progress, progress_bar) as on_step, stopped_list(listed, results):
                    results.append(await self.engine.agenerate(params, output, on_progress=on_step))
                results[-1].notes[:0] = warnings
            return results
        params, output, warnings = self._checked_request(sampling_params_kwargs, on_progress, kwargs)
        with self._step_bar(on_progress, progress_bar) as on_step:
            result = await self.engine.agenerate(params, output, on_progress=on_step)
        result.notes[:0] = warnings
        return result

    def _side_by_side(self, listed: Listed, on_progress: ProgressCallback | None, progress_bar: bool,
                      stop: threading.Event) -> list[VideoResult]:
        """A list on dp replicas (`prompt_lists.run_side_by_side`); `progress_bar` counts finished prompts, since
        the running prompts' steps would move one bar back and forth."""
        from k6serve.step_bar import StepBar

        with self._step_bar(on_progress, False) as on_step:  # on_progress's step-0 filter, as for one prompt
            check_progress_bar(progress_bar)
            bar = StepBar("prompts", unit="prompt") if progress_bar else None
            try:
                return run_side_by_side(self.engine, listed, on_step, bar, stop)
            finally:
                if bar is not None:
                    bar.close()

    @contextlib.contextmanager
    def _step_bar(self, on_progress: ProgressCallback | None, progress_bar: bool):
        """`on_progress`, and with `progress_bar` the bar fed first (a callback that raises to stop the request
        leaves the bar at the step it stopped), closed when the request ends however it ends."""
        check_progress_bar(progress_bar)
        # The engine also reports step 0, as a cancellation point before the first step (a warm-up, the prompt's
        # rewrite every 16 tokens); on_progress's contract is steps counting from 1 (an ETA callback divided by the
        # step). A cancel still reaches those points through the engine's own check.
        user = None if on_progress is None else (
            lambda step, total: on_progress(step, total) if step > 0 else None)
        if not progress_bar:
            yield user
            return
        from k6serve.step_bar import StepBar

        bar = StepBar("denoising" if self.engine.variant.family == GENERATION else "super-resolution")

        def on_step(step: int, total: int) -> None:
            bar.update(step, total)
            if user is not None:
                user(step, total)

        try:
            yield on_step
        finally:
            bar.close()

    def _each_prompt(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None,
                     on_progress: ProgressCallback | None, kwargs: dict[str, Any]
                     ) -> list[tuple[SamplingParams, OutputOptions, list[str]]] | None:
        """A request whose prompt is a list (or tuple) as one checked request per prompt, else None. The seed's
        `generate` takes a list, one request per prompt, run in order (a diffusers batch would draw its own noise,
        which no seed reproduces): every prompt is checked before the first runs, so a bad one raises before any
        work, naming its place in the list; a given output_file_name is numbered per prompt as the CLI's prompt
        file numbers it (clip.mp4 -> clip_1.mp4, clip_2.mp4); the seed (and -1, drawn for each) is every prompt's.
        The seed's generate logs a failing prompt and goes on; here the failure stops the list and raises, with a
        note of what had finished (`prompt_lists.stopped_list`), since a list whose results silently miss one
        misnumbers the rest. The prompts run one at a time; with dp_size=N, N at a time, one per replica
        (`prompt_lists.run_side_by_side`), their results still in the list's order."""
        # A pathlib output_file_name (taken as a str) and np.False_ as save_output are read as they are for one prompt:
        # a Path was not numbered, so the second prompt's video was moved on to clip_1.mp4 beside the first's clip.mp4.
        options = fspath_values(plain_scalars(request_options(sampling_params_kwargs, kwargs)))
        prompts = options.get("prompt")
        if not isinstance(prompts, (list, tuple)):
            return None
        if not prompts:
            raise ValueError("prompt is an empty list: pass one prompt as a string, or a list of at least one.")
        if self.engine.variant.family != GENERATION:
            raise ValueError("prompt is a list, which runs one generation per prompt, and the super-resolution model "
                             "takes no prompt: upscale one video a call (video_path='/path/to/input.mp4').")
        name, name_warning = options.get("output_file_name"), None
        names: Sequence[str | None] = [None] * len(prompts)
        if isinstance(name, str) and options.get("save_output") is not False and len(prompts) > 1:
            final, name_warning = final_file_name(name)  # said once, of the name given, before it is numbered
            names = numbered_file_names(final, len(prompts))
            if name_warning:
                # Logged as one prompt's check logs its warnings; each result's notes keep it too.
                logger.warning(name_warning)
        listed = []
        said: set[str] = set()  # a warning every prompt gets (save_output=False with an output_path) is logged once
        for index, (prompt, numbered) in enumerate(zip(prompts, names)):
            each = {**options, "prompt": prompt, **({"output_file_name": numbered} if numbered else {})}
            try:
                params, output, warnings = self._checked_request(each, on_progress, {}, said=said)
            except ValueError as exc:
                raise ValueError(f"prompt {index} of the list ({shown_prompt(prompt)}): {exc}") from None
            listed.append((params, output, [name_warning, *warnings] if name_warning else warnings))
        return listed

    def _checked_request(self, sampling_params_kwargs: Mapping[str, Any] | SamplingParams | None,
                         on_progress: ProgressCallback | None, kwargs: dict[str, Any], *, said: set[str] | None = None
                         ) -> tuple[SamplingParams, OutputOptions, list[str]]:
        """`generate`'s request as (params, output, warnings), checked: raises ValueError before anything runs. The
        warnings are logged, except those already in `said` (a list's earlier prompts logged them), which are added
        to it; all of them are returned, for the result's notes."""
        self._require_running()
        if on_progress is not None and not callable(on_progress):
            raise ValueError(f"on_progress must be a function called as on_progress(step, total), got "
                             f"{on_progress!r} ({type(on_progress).__name__}).")
        if inspect.iscoroutinefunction(on_progress) or inspect.iscoroutinefunction(
                getattr(on_progress, "__call__", None)):
            # Called, it only makes a coroutine nobody awaits: no progress, and "never awaited" warnings.
            raise ValueError("on_progress is an async function; it is called on the engine's thread, outside any "
                             "event loop, so pass a plain function (to reach a loop from it, use "
                             "loop.call_soon_threadsafe).")
        if on_progress is not None:
            try:
                inspect.signature(on_progress).bind(1, 1)
            except TypeError:
                # diffusers' callback_on_step_end(pipe, i, t, kwargs) failed only after the encoders and the first
                # step had run (minutes on a real model), as a bare TypeError.
                raise ValueError("on_progress is called as on_progress(step, total) after each denoising step (step "
                                 "counts from 1; raise from it to stop the request), not as diffusers' "
                                 "callback_on_step_end(pipe, i, t, callback_kwargs); pass a function of two "
                                 "arguments.") from None
            except ValueError:
                pass  # no signature to read (some builtins): called as given
        # Paths as str here too: a warning naming a pathlib output_path showed "output_path=PosixPath('out')".
        options = fspath_values(self._from_callers_folder(request_options(sampling_params_kwargs, kwargs)))
        params, output = split_kwargs(options)
        params, seed_note = drawn_seed(params)  # once, here: the result reports the seed drawn
        require_media_package(params, output)
        try:
            self.engine.resolve(params)  # the worker resolves it again; here the two missing inputs get API words
        except MissingPrompt as exc:
            raise MissingPrompt("prompt is required for Kandinsky 6 generation: pass prompt='A cat plays piano'.",
                                detail=exc.detail) from None
        except MissingSourceVideo:
            raise MissingSourceVideo("super-resolution needs one source video: pass video_path='/path/to/input.mp4' "
                                     "(or call generator.upscale('/path/to/input.mp4')).") from None
        output, warnings = check_output(output)
        warnings += [f"{key}={options[key]!r} is ignored: save_output=False writes no file."
                     for key in unsaved_output_keys(options)]
        for warning in warnings:
            if said is None or warning not in said:
                logger.warning(warning)
        if said is not None:
            said.update(warnings)
        if seed_note:
            logger.debug(seed_note)  # news, not a warning: it reaches the caller as a note of the result
            warnings.append(seed_note)
        return params, output, warnings

    def _from_callers_folder(self, options: dict[str, Any]) -> dict[str, Any]:
        """`options` with relative paths made absolute from the caller's folder when it is not the one the workers
        started in: after a chdir, the caller's check created an empty output folder here and the MP4 was written
        there (its returned path a relative one that did not exist from here), and a source here "did not exist".
        Unchanged otherwise, so paths (and the messages naming them) stay as given."""
        if not self._moved():
            return options
        options = dict(options)
        if options.get("output_path") is None and options.get("save_output") is not False:
            options["output_path"] = OutputOptions().output_path
        for key in ("image_path", "video_path", "output_path"):
            if key in options:
                options[key] = _from_here(options[key], existing_only=False)
        return options

    def _moved(self) -> bool:
        """Whether this process is in another folder than the one the workers started in (False when its folder
        was deleted: paths are then left to fail as they are)."""
        try:
            return os.getcwd() != self._start_folder
        except FileNotFoundError:
            return False

    def upscale(self, video_path: str | os.PathLike[str] | None = None, *,
                on_progress: ProgressCallback | None = None, progress_bar: bool = False,
                **kwargs: Unpack[RequestOptions]) -> VideoResult:
        """Super-resolution convenience (the VSR checkpoint): `generate(video_path=..., **kwargs)`, e.g. with
        sr_resolution_scale=2, seed, output_path; the same progress callback and bar."""
        # Without a path the request is generate's to refuse: diffusers' `upscale(video=...)` then gets its note
        # (pass video_path=) instead of Python's "missing 1 required positional argument".
        request: Mapping[str, Any] = kwargs if video_path is None else {"video_path": video_path, **kwargs}
        # One result, as typed: `RequestOptions` holds no prompt, so no list of them (a list prompt slipped in by an
        # untyped caller is refused by the super-resolution model, which upscale is for).
        return typing.cast(VideoResult, self.generate(request, on_progress=on_progress, progress_bar=progress_bar))

    @in_callers_words
    @http_names_answered
    @sglang_order_answered
    def set_lora(self, nickname: str | list[str], path: LoraPaths = None,
                 strength: float | Sequence[float] = 1.0, *, merge_mode: str = "auto", target: str | list[str] = "all",
                 lora_alpha: float | None = None) -> LoraChange:
        """Make `nickname` (or a list of nicknames) the active LoRA adapters, replacing the previous ones.

        `path` is a .safetensors file, a folder holding one, or a hub id, loaded under the nickname; None reuses the
        adapter already loaded under it (a list gives one entry per nickname). `strength` scales each adapter (one
        number for all, or a list; each from -100 to 100, `MAX_LORA_STRENGTH`). `merge_mode`: "merge" adds
        strength * (alpha / rank) * B @ A into the weights (no per-step cost), "dynamic" leaves the weights untouched
        and adds the adapter's output in every forward (cheap to change or stack), "auto" merges unless the weights
        are sharded by FSDP. `lora_alpha` overrides the alpha stored in the file (from -10000 to 10000,
        `MAX_LORA_ALPHA`). `target`: "all" or "transformer" (the one DiT), or one of them per adapter (SGLang's
        list). Runs after the requests already submitted and before later ones, on every replica; returns
        `{"status": "ok", "message": ..., "loras": [...]}`. Bad input raises ValueError and changes nothing."""
        self._require_running()
        if self._moved():  # a relative adapter path from the caller's folder, as a request's; a hub id as it is
            # A tuple too (it is taken as a list): its relative paths were left as given, the workers' folder's.
            path = ([_from_here(item, existing_only=True) for item in path] if isinstance(path, (list, tuple))
                    else _from_here(path, existing_only=True))
        operation = set_lora_operation(nickname, path, strength, merge_mode=merge_mode, target=target,
                                       lora_alpha=lora_alpha)
        return typing.cast(LoraChange, self.engine.lora(operation))

    @in_callers_words
    def merge_lora_weights(self, target: str = "all", strength: float | None = None) -> LoraChange:
        """Merge the active adapters into the weights (from dynamic mode, or again at a new `strength`, from -100 to
        100). A bad target or strength raises ValueError before anything queues."""
        self._require_running()
        return typing.cast(LoraChange, self.engine.lora(merge_lora_operation(target, strength)))

    @in_callers_words
    def unmerge_lora_weights(self, target: str = "all") -> LoraChange:
        """Deactivate every adapter and restore the base weights bit for bit (merged weights are restored from
        the saved base copy, not by subtracting the delta)."""
        self._require_running()
        return typing.cast(LoraChange, self.engine.lora(unmerge_lora_operation(target)))

    @in_callers_words
    @http_names_answered
    def unload_lora(self, nickname: str | list[str]) -> LoraChange:
        """Forget loaded adapters that are not active (a nickname or a list): their weights leave memory. An active
        or unknown one raises ValueError and nothing changes; deactivate it first (`set_lora` with the adapters to
        keep, or `unmerge_lora_weights`). Runs after the requests already submitted, as the other LoRA calls."""
        self._require_running()
        return typing.cast(LoraChange, self.engine.lora(unload_lora_operation(nickname)))

    @in_callers_words
    def list_loras(self) -> LoraListing:
        """The loaded adapters and their state: `{"loras": [...]}`, one `LoraAdapterState` each (lora/spec.py)."""
        self._require_running()
        return self.engine.lora(ListLoras())

    @in_callers_words
    def release_memory(self) -> MemoryReply:
        """Give the GPU memory back (sleep, e.g. to an RL trainer on the same GPUs): after the requests already
        submitted, every weight moves to host memory on every rank and the allocator caches are freed; requests
        submitted meanwhile wait for `resume_memory`. Returns each rank's report of what moved and what the process
        still holds on its GPU (docs/http-api.md, POST /release_memory_occupation). Releasing twice changes
        nothing and says so ("status": "already_released"); use_fsdp_inference=True raises ValueError."""
        self._require_running()
        return self.engine.release_memory()

    @in_callers_words
    def resume_memory(self, *, keep_host_copy: bool = False) -> MemoryReply:
        """Copy the weights back to the GPUs, bit for bit; the waiting requests then run in order. Resuming while
        not released changes nothing ("status": "not_released"). `keep_host_copy=True` keeps the host copy (host
        memory stays taken), so the next release re-points the weights to it without copying: for a loop of
        releases and resumes. A LoRA change drops it."""
        self._require_running()
        return self.engine.resume_memory(keep_host_copy=keep_host_copy)

    def shutdown(self) -> None:
        """Finish the running requests, then stop the worker processes; later requests raise RuntimeError. Calling
        it again does nothing, unless the first was interrupted (Ctrl-C while it waited): then it finishes the job.
        Requests still running after 30 s are cancelled at their next step (their callers get RequestCancelled
        saying so), and those queued behind them do not start."""
        if self._shutdown.alive:
            # Not the finalizer itself: once called it is spent even if interrupted, and the worker's ranks stayed.
            self.engine.shutdown()
            self._shutdown.detach()
        _RUNNING.discard(self)

    # `close()` is what contextlib.closing and most Python resources call; the seed's name is shutdown().
    close = shutdown

    def __enter__(self) -> "DiffGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
