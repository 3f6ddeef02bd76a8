"""The one exception type for bad user input, shared by every layer of the project.

It lives here, at the bottom of the import order (topologies <- twin <- backend, calibration), so
that topologies never imports twin; twin re-exports it as TwinError. The command lines turn it into
one line on stderr and exit code 2.
"""


class InputError(ValueError):
    """Bad input: the message says what is wrong and how to fix it."""
