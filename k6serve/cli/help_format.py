"""The `--help` layout of k6serve's commands, the same on every Python version."""

from __future__ import annotations

import argparse
import sys


class HelpFormatter(argparse.HelpFormatter):
    """An option with several spellings is listed as `--dp-size, --dp, --data-parallel-size DP_SIZE`.

    That is Python 3.13's own layout; 3.11 and 3.12 repeat the value's name after each spelling
    (`--dp-size DP_SIZE, --dp DP_SIZE, ...`). docs/cli.md reproduces the help word for word (a test compares them),
    so the help must not depend on the Python that prints it: under 3.13 the documented 3.11 layout failed that
    test. The override below is 3.13's method (argparse has no public switch for it), defined only before 3.13: from
    there argparse's own gives the layout, and 3.14's also colours it in a terminal (the override's text had no
    colour, so the options that take a value lost theirs while -h kept its)."""

    if sys.version_info < (3, 13):
        def _format_action_invocation(self, action: argparse.Action) -> str:
            if not action.option_strings or action.nargs == 0:
                return super()._format_action_invocation(action)
            value = self._format_args(action, self._get_default_metavar_for_optional(action))
            return f"{', '.join(action.option_strings)} {value}"
