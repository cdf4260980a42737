"""argparse's "unrecognized arguments", with what to do about each unknown flag or stray word (also the notes a
--config file's unknown keys get)."""

from __future__ import annotations

import argparse
from typing import cast

from k6serve.reference_names import lookup as lookup_reference_name
from k6serve.reference_names import own_name_note, unknown_names_hint


def command_surface(command: str) -> str:
    """Where `k6serve <command>`'s flags and --config keys were typed, for `reference_names`."""
    return "serve" if command == "serve" else "cli"


def _looks_like_flag(argument: str) -> bool:
    """`--dit-cpu-offload` or `--4k`, not a value such as `true` or `-0.5`, nor the `--` that ends the flags."""
    if not argument.startswith("-") or argument in ("-", "--"):
        return False
    try:
        float(argument)
    except ValueError:
        return True
    return False


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """`build_parser`'s command parsers by name: the choices of the one action in argparse's private subparsers
    group, which typeshed types as optional and as any action."""
    group = cast(argparse._ArgumentGroup, parser._subparsers)
    return cast("argparse._SubParsersAction[argparse.ArgumentParser]", group._group_actions[0]).choices


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")}


def other_command_notes(flags: list[str], parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """flag -> a note, for the `flags` that only the other command takes (`k6serve generate --port` was refused
    with no word of `k6serve serve`, a generate --config file's `prompt:` given to serve "did you mean 'port'?").
    A request field typed on `k6serve serve` gets `own_name_note`'s word instead, with the rest of the unknown."""
    if command not in ("generate", "serve"):
        return {}  # `k6serve bench` takes neither's flags
    commands = command_parsers(parser)
    other = "serve" if command == "generate" else "generate"
    only_other = _option_strings(commands[other]) - _option_strings(commands[command])
    notes = {}
    for flag in flags:
        spelled = "--" + flag.split("=", 1)[0].lstrip("-").replace("_", "-")
        if spelled not in only_other or own_name_note(spelled, command_surface(command)) is not None:
            continue
        if other == "serve":
            notes[flag] = (f"{spelled} is a flag of `k6serve serve`, which serves requests over HTTP; "
                           "`k6serve generate` runs its request and exits")
        else:
            notes[flag] = (f"{spelled} is a flag of `k6serve generate`; a server's requests come over HTTP, "
                           "POST /v1/videos (docs/http-api.md)")
    return notes


def unrecognized_arguments(unknown: list[str], parser: argparse.ArgumentParser, command: str) -> str:
    """argparse's "unrecognized arguments", with what to do about each: an unknown flag is named without the value
    it may have taken (`--dit-cpu-offload true` is one flag), SGLang's with what to use instead, an abbreviation or a
    typo with the flag it stands for; a flag of `k6serve` itself typed after the command is moved before it; and
    words that are no flag's value (`--prompt A cat` leaves `cat`; or what follows `--`) are named as such, since
    k6serve takes no positional arguments."""
    command_known = _option_strings(command_parsers(parser)[command])
    before_command = _option_strings(parser) - command_known
    shown: list[str] = []
    flags: list[str] = []
    loose: list[str] = []
    value_allowed = False  # the word after an unknown flag may be its value
    for position, word in enumerate(unknown):
        if word == "--":
            loose += unknown[position:]
            shown += unknown[position:]
            break
        if _looks_like_flag(word):
            name = word.split("=", 1)[0]
            if name not in flags:
                flags.append(name)
                shown.append(name)
            value_allowed = "=" not in word
        elif value_allowed:
            value_allowed = False
        else:
            loose.append(word)
            shown.append(word)
    notes = []
    misplaced = [flag for flag in flags if flag in before_command]
    notes += [f" ({flag} goes before the command: k6serve {flag})" for flag in misplaced]
    rest = [flag for flag in flags if flag not in before_command]
    # An abbreviation (flags are matched whole) gets the flags it begins (up to 3: `--compile` begins two), before
    # difflib's look-alike guess.
    whole = {flag: sorted(known for known in command_known if known.startswith(flag)) for flag in rest
             if lookup_reference_name(flag, command_surface(command)) is None}
    whole = {flag: matches for flag, matches in whole.items() if 1 <= len(matches) <= 3}
    notes += [f" ({flag}: flags are written whole; did you mean {' or '.join(map(repr, known))}?)"
              for flag, known in whole.items()]
    rest = [flag for flag in rest if flag not in whole]
    other = other_command_notes(rest, parser, command)
    notes += [f" ({note})" for note in other.values()]
    if rest_named := [flag for flag in rest if flag not in other]:
        notes.append(unknown_names_hint(rest_named, command_known, surface=command_surface(command),
                                        named=len(rest) > 1))
    if loose:
        notes.append(f"; k6serve takes no positional arguments ({' '.join(loose)}): quote a value with spaces, e.g. "
                     "--prompt \"A cat plays the piano\"")
    return f"unrecognized arguments: {' '.join(shown)}{''.join(notes)}"
