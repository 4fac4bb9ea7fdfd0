"""The one exception type forja raises for bad input.

A `ForjaError` carries a sentence meant for a person: what is wrong, naming the
thing (a key, a file, a tensor), and how to fix it. The CLI prints it without a
traceback; library callers can catch it.
"""


import difflib


class ForjaError(Exception):
    """Bad input or state that a user can fix; the message says how."""


INTERRUPTED = 130
"""The exit code of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it)."""


def unknown_key(key: str, valid: list[str], where: str = "") -> ForjaError:
    """The error for a config key `key` (dotted) that is none of `valid`, with the closest one."""
    close = difflib.get_close_matches(key.split(".")[-1], valid, n=1)
    hint = f"did you mean {key.rsplit('.', 1)[0]}.{close[0]}? " if close and "." in key else (
        f"did you mean {close[0]}? " if close else "")
    return ForjaError(f"unknown key {key}{' ' + where if where else ''}; {hint}valid keys: {', '.join(valid)}")
