"""Bad input from the user: one `error:` line that says what was wrong and what to do, exit code 2."""

import sys


class InputError(Exception):
    """Bad input from the user: reported as one line, exit code 2, nothing written."""


def run_command(main):
    """Run a command's `main` and return what it returns, turning bad input into one `error:` line and exit code 2."""
    try:
        return main()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
