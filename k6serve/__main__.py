"""`python -m k6serve`: the `k6serve` command, for an environment whose scripts folder is not on PATH."""

from k6serve.cli.main import console_main

# The same entry point as the console script ([project.scripts] in pyproject.toml), so the two never differ.
if __name__ == "__main__":
    console_main()
