"""The one exception type forja raises for bad input.

A `ForjaError` carries a sentence meant for a person: what is wrong, naming the
thing (a key, a file, a tensor), and how to fix it. The CLI prints it without a
traceback; library callers can catch it.
"""


class ForjaError(Exception):
    """Bad input or state that a user can fix; the message says how."""
