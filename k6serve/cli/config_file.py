"""`--config FILE`: a YAML or JSON file of flag values (keys are flag names), read and checked as the same flags on
the command line would be, under the command line's values (the command line wins)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from k6serve.cli.flags import parse_bool
from k6serve.cli.unknown_flags import command_parsers, other_command_notes, command_surface
from k6serve.config import SEED_FLAG_SPELLINGS, flag_name
from k6serve.reference_names import aliases, unknown_names_hint


def load_config_file(path: str) -> dict[str, Any]:
    try:
        # UTF-8 whatever the locale (a Russian Windows reads cp1251 by default: a UTF-8 file's Cyrillic prompt ran as
        # mojibake), a byte-order mark allowed (JSON refused one that YAML took).
        text = Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise ValueError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path} is not UTF-8 text ({exc.reason} at byte {exc.start + 1}); save it as "
                         "UTF-8.") from None
    if path.lower().endswith((".yaml", ".yml")):  # run.YAML too: it was read as JSON and refused as such
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"--config {path} is not valid YAML: {exc}") from None
        if data is None:
            # An empty file, or one whose lines are all commented out, sets nothing (as a key with no value does);
            # it was refused as not holding a mapping.
            data = {}
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config {path} is not valid JSON ({exc}); a YAML file must end in .yaml or .yml"
                             ) from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of flag names to values")
    options = {str(key).lstrip("-").replace("-", "_"): value for key, value in data.items()}
    for key, value in options.items():
        # A shell expands $VAR on the command line; a file's value arrives as written: `output-path: ${OUT}/videos`
        # wrote into a folder named "${OUT}" under the working folder, with no word.
        if key.endswith(("_path", "_dir", "_config", "_store")) and isinstance(value, str) and _ENV_REFERENCE.search(
                value):
            raise ValueError(f"--config {path}: {key.replace('_', '-')} {value!r} names an environment variable, "
                             "which k6serve does not expand in a config file; write the value out, or pass it as a "
                             "flag, which the shell expands.")
    return options


_ENV_REFERENCE = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")


_COMPONENT_LIST_FLAGS = ("cpu_offload_components", "layerwise_offload_components", "component_residency")
# Lists of names in a --config file whose items must be strings: a number or a mapping would be turned into its text.
_NAME_LIST_FLAGS = ("quantization_ignored_layers",)
# Lists of sizes (`1280x720`) in a --config file: strings, parsed by the config (a YAML 1280 would be a number).
_SIZE_LIST_FLAGS = ("warmup_resolutions",)
# String flags whose --config value may be a mapping (the JSON object the flag would carry as text).
_MAPPING_FLAGS = ("cache_dit_config",)


def _config_value(action: argparse.Action, value: Any) -> Any:
    """A file value as the same flag on the command line gives it: JSON "64" is the integer 64 and YAML "no" is
    false, not a truthy string that would still save the file."""
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        return parse_bool(value)
    if value == [] and (action.nargs == "+" or isinstance(action, argparse._AppendAction)):
        # The flag takes one value or more, and the file's [] ran as if the key were absent: a list emptied to mean
        # "none" silently kept the default.
        offload = action.dest in ("cpu_offload_components", "layerwise_offload_components")
        none = " (`[none]` to offload none)" if offload else ""
        raise ValueError(f"is an empty list; the flag takes at least one value: drop the key for the default{none}")
    if action.dest in _COMPONENT_LIST_FLAGS:
        # Checked here too, so that a bad value names the file (the config normalises it again).
        from k6serve.offload.residency import normalise_component_names, normalise_residency_settings

        if action.dest == "component_residency":
            normalise_residency_settings(value)
        else:
            normalise_component_names(value, action.option_strings[0])
        return value
    if action.dest in _SIZE_LIST_FLAGS:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"takes sizes WxH or WxHxF (a string, or a list of strings, e.g. [1280x720, 768x512x61]), "
                             f"got {value!r}")
        return items
    if action.dest in _NAME_LIST_FLAGS:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"takes names (a string, or a list of strings), got {value!r}; quote a number to mean "
                             "it as a name")
        return items
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, (str, int, float)) and not isinstance(item, bool) for item in items):
            # str() made a folder named "{'a': 1}" of a mapping.
            raise ValueError(f"takes a string or a list of strings, got {value!r}")
        return [str(item) for item in items]
    if action.type in (None, str):
        if isinstance(value, (list, dict)) and action.dest not in _MAPPING_FLAGS:
            # Passed on as is, a list or mapping failed later as an internal error (`host: [a, b]`). A list of prompts
            # (the Python API's generate takes one) is what --prompt-file-path runs.
            several = (" (several prompts: write them one per line in a file and give it as prompt-file-path)"
                       if action.dest == "prompt" and isinstance(value, list) else "")
            raise ValueError(f"takes one string, got {value!r}{several}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # YAML reads "output-path: 2026" as a number; the flag would give the string
        value = _yaml_scalar_as_text(action, value)
    elif action.type in (int, float):
        wanted = "an integer" if action.type is int else "a number"
        if isinstance(value, str):
            try:
                value = action.type(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {wanted}, got {value!r}") from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or (
                action.type is int and isinstance(value, float)):
            # As `--seed 1.0` is refused. Caught here, with the file and the flag in the message, not later as a
            # bare "height must be an integer".
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value!r}")
    else:
        # typeshed allows a registry name too; k6serve's flags give their converting function
        value = cast(Callable[[Any], Any], action.type)(value)
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def _yaml_scalar_as_text(action: argparse.Action, value: Any) -> Any:
    """A string flag's --config value that YAML read as a boolean or a date, as the text the flag would give.

    YAML 1.1 reads unquoted off / on / yes / no as booleans and 2026-01-01 as a date: `warmup-mode: off` and
    `vae-tiling: off` (the flags' own choices) were refused as "expected one of off, request, server, got False",
    and `output-path: 2026-01-01` failed as "output_path must be a string, got datetime.date(2026, 1, 1)"."""
    import datetime

    if isinstance(value, bool):
        word = "on" if value else "off"
        if action.choices is not None and word in action.choices:
            return word
        # yes, true and on all read as True: the word written cannot be told, so it must be quoted.
        raise ValueError(f"takes one string, got {str(value).lower()} (YAML reads an unquoted yes, no, on, off, true "
                         "or false as a boolean); quote the value, e.g. 'no'")
    if isinstance(value, datetime.datetime):
        raise ValueError(f"takes one string, got the date and time {value} (YAML reads an unquoted date and time as "
                         "a timestamp); quote the value")
    if isinstance(value, datetime.date):
        return value.isoformat()  # YAML's only form of a plain date: 2026-01-01, as written
    return value


# Keys that give the same thing in two ways (`k6serve generate` refuses both at once).
_EITHER_OR_KEYS = (("prompt", "prompt_file_path"),)


def merged_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """CLI values over --config values; unset flags are omitted so the typed defaults apply."""
    options = {k: v for k, v in vars(args).items() if v is not None and k not in ("command", "config", "log_level")}
    if getattr(args, "config", None):
        from_file = load_config_file(args.config)
        actions = {action.dest: action
                   for action in command_parsers(parser)[args.command]._actions
                   if action.dest not in ("help", "config", "log_level")}
        # The seed's dotted `vae-config.*` keys name the same options as its flags; a nested `vae-config:` mapping
        # is read as those keys.
        seed_keys = {flag.lstrip("-").replace("-", "_"): name for name, flag in SEED_FLAG_SPELLINGS.items()}
        flat: dict[str, Any] = {}
        for key, value in from_file.items():
            if key == "vae_config" and isinstance(value, dict):
                flat.update({f"vae_config.{str(inner).replace('-', '_')}": item for inner, item in value.items()})
            else:
                flat[key] = value
        from_file = _renamed_reference_keys({seed_keys.get(key, key): value for key, value in flat.items()},
                                            args.config)
        unknown = sorted(set(from_file) - set(actions))
        if unknown:
            # --no-save-output and the other --no-* flags are the false value of one key, not keys of their own.
            negated = [key for key in unknown if key.startswith("no_")
                       and isinstance(actions.get(key[3:]), argparse.BooleanOptionalAction)]
            hint = "".join(f"; --{key.replace('_', '-')} is written as {key[3:].replace('_', '-')}: false"
                           for key in negated)
            # SGLang's names get what to use instead; other keys a "did you mean" where one is close.
            keys = [key for key in unknown if key not in negated]
            other = other_command_notes(keys, parser, args.command)
            reference = "".join(f" ({note})" for note in other.values()) + unknown_names_hint(
                [key for key in keys if key not in other], actions, surface=command_surface(args.command),
                named=len(keys) > 1)
            raise ValueError(f"--config {args.config}: unknown key(s) {unknown}{reference}{hint}")
        converted = {}
        for key, value in from_file.items():
            if value is None:
                continue  # "key:" with no value in YAML: as if the key were absent
            try:
                converted[key] = _config_value(actions[key], value)
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"--config {args.config}: {actions[key].option_strings[0]}: {exc}") from None
        file_gives_prompt = any(key in converted for key in ("prompt", "prompt_file_path"))
        for pair in _EITHER_OR_KEYS:
            # The command line wins over the file also where two keys exclude each other: --prompt-file-path typed
            # over a file's `prompt` replaces it, as --prompt would.
            if any(key in options for key in pair):
                converted = {key: value for key, value in converted.items() if key not in pair}
        if (file_gives_prompt and ("prompt" in options or "prompt_file_path" in options)
                and "prompt_file_lines" not in options):
            # The file's lines go with the prompt file it named, which a typed --prompt or --prompt-file-path
            # replaced (another file's lines 3-5 are other prompts). Lines alone in it pick from the typed file.
            converted.pop("prompt_file_lines", None)
        options = {**converted, **options}
    return options


def unsaved_by(args: argparse.Namespace) -> str:
    """What turned `generate`'s saving off, for its notes: --no-save-output typed, or the --config file's key. A
    `save-output: no` in the file was told "note: --no-save-output: ...", a flag the user never typed."""
    if args.save_output is None and args.config:
        return f"save-output: false (--config {args.config})"
    return "--no-save-output"


def _renamed_reference_keys(options: dict[str, Any], path: str) -> dict[str, Any]:
    """A --config file's keys with SGLang's names of k6serve options (`mode: speed`) read as those options."""
    renamed: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in options.items():
        name = aliases().get(key, key)
        if name in renamed:
            sglangs = [each for each in (given[name], key) if each != name]
            which = (f"{sglangs[0]!r} is SGLang's name of it" if len(sglangs) == 1
                     else "both are SGLang's names of it")
            raise ValueError(f"--config {path}: keys {given[name]!r} and {key!r} both set {flag_name(name)} ({which}); "
                             "keep one of them.")
        renamed[name], given[name] = value, key
    return renamed
