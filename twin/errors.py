"""The one exception type for bad user input.

The command line turns a TwinError into one line on stderr and exit code 2; the library raises it
wherever a user could have asked for something impossible (unknown model, a grid that does not divide).
"""


class TwinError(ValueError):
    """Bad input: the message says what is wrong and how to fix it."""
