"""The Python API's wording of engine errors: the keywords its caller passes, not the CLI's flags.

The config, launch, parallel-layout and LoRA checks are shared by the CLI, the server and the API, and name CLI
flags ("... but --num-gpus is 2. Pass --num-gpus 4 for this layout"). `DiffGenerator` re-raises their ValueErrors
through `reworded_errors(flags_as_keywords)`, which writes every flag of an engine option as the keyword argument a
Python caller passes (`num_gpus is 2`, `num_gpus=4`); the CLI and the server keep the flags.

Whether a flag is followed by its value is decided by the option's type and allowed values (an integer, a member of
its choices, a quoted string, component names), not by the words around it; a boolean flag without a value turns its
option on, so it reads `name=True`. Flags of other programs (torchrun's, `hf download`'s) stay as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from k6serve.config import OPTION_CHOICES, ModelConfig, ParallelConfig, RuntimeConfig, flag_name
from k6serve.models.variants import variant_from_id
from k6serve.offload.residency import OFFLOAD_COMPONENT_NAMES, RESIDENCY_NAMES
from k6serve.request import OutputOptions


@dataclass(frozen=True, slots=True)
class _Option:
    keyword: str
    # One word after the flag -> the value as a Python literal, or None when the word is not a value of this option.
    read: Callable[[str], str | None]
    # Options that take several words (component names, NAME=MODE settings): the literals -> one list or dict.
    gather: Callable[[list[str]], str] | None = None
    boolean: bool = False
    # The flag turns its option off (`--no-save-output`): it reads `name=False`.
    negated: bool = False


_QUOTED = r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\""
# The word after a flag: a quoted string, or a run up to a space or punctuation. A '.' ends it only where a sentence
# ends, so 1.5 and Kandinsky-6.0-Pro stay whole.
_BREAK = r"\s,;:()\[\]`'\""
_WORD = re.compile(rf"\s+({_QUOTED}|[^{_BREAK}]+?(?=\.?(?:[{_BREAK}]|$)))")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# Commands of other programs, to the end of their clause: their flags are theirs, even where the name matches ours
# (torchrun's --nnodes, hf's --revision).
_OTHER_PROGRAMS = re.compile(r"\b(?:torchrun|hf download)\b.*?(?=[;,)`]|\.(?:\s|$)|$)")
_FLAG_WORD = re.compile(r"\b([Ff])lag(s?)\b")


def _unquoted(word: str) -> str:
    return word[1:-1] if re.fullmatch(_QUOTED, word) else word


def _integer(word: str) -> str | None:
    return word if re.fullmatch(r"-?\d+", word) else None


def _number(word: str) -> str | None:
    return word if _NUMBER.fullmatch(word) else None


def _boolean(word: str) -> str | None:
    return {"true": "True", "false": "False"}.get(word)


def _choice(choices: tuple[str, ...]) -> Callable[[str], str | None]:
    return lambda word: repr(_unquoted(word)) if _unquoted(word) in choices else None


def _quoted(word: str) -> str | None:
    """A free-text option's value is recognisable only as the quoted string the messages print with !r."""
    return word if re.fullmatch(_QUOTED, word) else None


def _model_id(word: str) -> str | None:
    return _quoted(word) or (repr(word) if variant_from_id(word) is not None else None)


def _component(word: str) -> str | None:
    return repr(word) if word in OFFLOAD_COMPONENT_NAMES else None


def _residency_setting(word: str) -> str | None:
    name, equals, mode = word.partition("=")
    return f"{name!r}: {mode!r}" if equals and name in OFFLOAD_COMPONENT_NAMES and mode in RESIDENCY_NAMES else None


def _as_list(literals: list[str]) -> str:
    return f"[{', '.join(literals)}]"


def _as_dict(literals: list[str]) -> str:
    return f"{{{', '.join(literals)}}}"


def _option(field: dataclasses.Field) -> _Option:
    kind = str(field.type).partition(" | ")[0]
    if field.name in OPTION_CHOICES:
        return _Option(field.name, _choice(OPTION_CHOICES[field.name]))
    if field.name == "model_id":
        return _Option(field.name, _model_id)
    readers = {"int": _integer, "float": _number, "bool": _boolean}
    if kind in readers:
        return _Option(field.name, readers[kind], boolean=kind == "bool")
    if kind == "tuple[str, ...]":
        return _Option(field.name, _component, gather=_as_list)
    if kind == "tuple[tuple[str, str], ...]":
        return _Option(field.name, _residency_setting, gather=_as_dict)
    return _Option(field.name, _quoted)  # paths, names, addresses, the Cache-DiT config


def _engine_options() -> dict[str, _Option]:
    """Every engine and output option by its flag (`build_engine_config` and `generate` take the same names as
    keywords; the output checks are the CLI's too, e.g. "pass a folder with --output-path")."""
    sections = (ModelConfig, ParallelConfig, RuntimeConfig, OutputOptions)
    fields = [item for section in sections for item in dataclasses.fields(section)]
    options = {flag_name(item.name): _option(item) for item in fields}
    options["--no-save-output"] = _Option("save_output", lambda word: None, negated=True)
    return options


_OPTIONS = _engine_options()
# Longest first, so that no flag matches as the start of a longer one.
_FLAGS = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, sorted(_OPTIONS, key=len, reverse=True))) + r")(?![\w-])")


def _values(option: _Option, message: str, end: int) -> tuple[list[str], int]:
    """The values written after a flag ending at `end`, as Python literals, and where they end."""
    values: list[str] = []
    while (word := _WORD.match(message, end)) and (value := option.read(word.group(1))) is not None:
        values.append(value)
        end = word.end()
        if option.gather is None:
            break
    return values, end


def _keyword(option: _Option, message: str, end: int) -> tuple[str, int, bool]:
    """The keyword (with its value where one follows) for the flag ending at `end`: (text, where it ends, whether it
    is a keyword argument)."""
    values, end = _values(option, message, end)
    if values:
        return f"{option.keyword}={option.gather(values) if option.gather else values[0]}", end, True
    if option.negated:
        return f"{option.keyword}=False", end, True
    if option.boolean and not re.match(r"\s+must\b", message[end:]):
        # A boolean flag turns its option on; only the type check's "--x must be true or false" names the option.
        return f"{option.keyword}=True", end, True
    return option.keyword, end, False


def flags_as_keywords(message: str) -> str:
    """`message` with every engine option's flag written as the Python API's keyword (`--num-gpus 4` -> `num_gpus=4`,
    `--num-gpus is 2` -> `num_gpus is 2`, `--use-fsdp-inference` -> `use_fsdp_inference=True`); flags given one
    after the other become comma-separated keyword arguments. Where a flag was reworded, the word "flag" becomes
    "option". Other text, and flags of other programs, stay as they are."""
    foreign = [match.span() for match in _OTHER_PROGRAMS.finditer(message)]
    parts: list[str] = []
    done, previous_was_argument = 0, False
    for match in _FLAGS.finditer(message):
        if match.start() < done or any(start <= match.start() < stop for start, stop in foreign):
            continue
        text, end, is_argument = _keyword(_OPTIONS[match.group(1)], message, match.end())
        gap = message[done:match.start()]
        if previous_was_argument and is_argument and gap.isspace():
            gap = ", "  # `--ulysses-degree 2 --ring-degree 2` -> `ulysses_degree=2, ring_degree=2`
        parts += [gap, text]
        done, previous_was_argument = end, is_argument
    if not parts:
        return message
    return _options_not_flags("".join(parts) + message[done:])


def _options_not_flags(message: str) -> str:
    """"drop the parallel flags", "Drop the flag": an API caller passes options (not inside another program's
    command, whose flags are flags)."""
    foreign = [match.span() for match in _OTHER_PROGRAMS.finditer(message)]

    def option(word: re.Match) -> str:
        if any(start <= word.start() < stop for start, stop in foreign):
            return word.group(0)
        return ("Option" if word.group(1) == "F" else "option") + word.group(2)

    return _FLAG_WORD.sub(option, message)


@contextlib.contextmanager
def reworded_errors(wording: Callable[[str], str]) -> Iterator[None]:
    """Re-raise a ValueError (of any subclass, with its attributes and traceback) with its message passed through
    `wording`, e.g. `flags_as_keywords`."""
    try:
        yield
    except ValueError as error:
        if len(error.args) == 1 and isinstance(error.args[0], str):
            error.args = (wording(error.args[0]),)
        raise
