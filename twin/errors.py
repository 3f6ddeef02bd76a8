"""TwinError: bad user input (unknown model, a grid that does not divide, a model that does not fit).

The command line turns it into one line on stderr and exit code 2. It is the project-wide
topologies.errors.InputError under the twin's name, so an error raised while loading a system spec
and one raised while building a program are caught alike.
"""

from topologies.errors import InputError as TwinError

__all__ = ["TwinError"]
