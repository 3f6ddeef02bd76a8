"""The twin: a discrete-event simulation of one iteration of 4D-parallel LLM training.

Data flows one way: model spec + grid + options -> program (the schedule of one rank)
-> simulation on a system -> result -> traces and plots. Nothing here imports torch.
"""

from twin.errors import TwinError
from twin.grid import Grid
from twin.model import ModelSpec, load_model, list_models
from twin.program import Op, Options, Program, build_program

__all__ = [
    "TwinError", "Grid", "ModelSpec", "load_model", "list_models",
    "Op", "Options", "Program", "build_program",
]
