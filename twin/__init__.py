"""The twin: a discrete-event simulation of one iteration of 4D-parallel LLM training.

Data flows one way: model spec + grid + options -> program (the schedule of one rank)
-> simulation on a system -> result -> traces and plots. Nothing here imports torch.

The names below are loaded on first use, so that importing one module of the twin (the program
alone, say, as the backend does) does not import the simulator.
"""

import importlib

_EXPORTS = {
    "TwinError": "topologies.common", "Grid": "twin.program.grid", "ModelSpec": "twin.program.model",
    "load_model": "twin.program.model", "list_models": "twin.program.model", "Op": "twin.program.program",
    "Options": "twin.program.program", "Program": "twin.program.program", "build_program": "twin.program.program",
    "SimulationConfig": "twin.predict.simulate", "simulate": "twin.predict.simulate",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'twin' has no attribute {name!r}")
