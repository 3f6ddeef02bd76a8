"""The result of simulating one training iteration (SimulationResult) and its JSON form."""

from __future__ import annotations

from dataclasses import dataclass, field

from topologies.common import finite_json

FLOPS_CONVENTION = ("reference formula of Narayanan et al. (SC'21): 96*B*s*l*h^2*(1 + s/(6h) + V/(16lh)) "
                    "with recomputation (72 instead of 96 without), V the padded vocabulary")
LLAMA_FLOPS_CONVENTION = ("the same count with a Llama's matrices (twin.program.model.ModelSpec.reference_flops): "
                          "4*B*s*l*(2*P_block + 4*s*h) + 6*B*s*h*V with recomputation (3 instead of 4 without), "
                          "P_block = h*(h + 2*kv*d) + h*h + 3*h*f the parameters of a block's matrices")


@dataclass
class SimulationResult:
    """One simulated iteration. Times in seconds, flops in flop, rates in flop/s, memory in bytes.

    breakdown_s = {"compute": s, "exposed_comm": {"x","y","z","data": s}, "idle": s} adds up to
    iteration_time_s: compute is the time the compute stream runs ops; exposed_comm[axis] the time it
    waits for a collective of that axis; idle the rest (mean over the simulated ranks). On a pipelined
    grid (grid["pipe"] > 1) exposed_comm also has "pipe" (waits for point-to-point sends on the wire)
    and breakdown_s a "bubble" (the pipeline bubble: waits for the previous stage's work, and the drain;
    twin.engine.pipeline), and `pipeline` says the schedule and what each stage did.
    flops_per_iteration is the model's reference-formula flop count (see FLOPS_CONVENTION), not the
    flops the ranks execute (those include replicated work).
    """

    system: str
    model: str
    gpus: int
    grid: dict[str, int]
    global_batch: int
    seq_len: int
    iteration_time_s: float
    flops_per_iteration: float
    flops_per_s: float
    flops_per_s_per_gpu: float
    percent_of_peak: float
    breakdown_s: dict
    memory_per_gpu_bytes: int
    simulated_ops: int
    mode: str = "symmetric"          # symmetric (one representative rank) or full (every rank)
    simulated_ranks: int = 1
    placement: str = "contiguous"
    profile: str = ""                # kernel profile used
    options: dict = field(default_factory=dict)
    grid_choice: str = "given"       # how the grid was chosen ("given", or what --grid auto did)
    notes: list = field(default_factory=list)  # what the prediction extrapolates, one line each
    flops_convention: str = FLOPS_CONVENTION
    wall_time_s: float = 0.0         # seconds this simulation took (not deterministic; last in JSON)
    spans: list = field(default_factory=list, repr=False)  # twin.program.trace.Span of every op, when recorded
    waits: list = field(default_factory=list, repr=False)  # the engine's exposed waits (trace.wait_span), when recorded
    pipeline: dict = field(default_factory=dict)  # pipelined grids: schedule, chunks, micro-batches, per stage
    checkpoint: dict = field(default_factory=dict)  # one checkpoint's bytes and write/read times (twin.predict.ckptcost)

    def as_dict(self, wall_time: bool = True) -> dict:
        d = {
            "system": self.system, "model": self.model, "gpus": self.gpus, "grid": dict(self.grid),
            "global_batch": self.global_batch, "seq_len": self.seq_len,
            "iteration_time_s": self.iteration_time_s, "flops_per_iteration": self.flops_per_iteration,
            "flops_per_s": self.flops_per_s, "flops_per_s_per_gpu": self.flops_per_s_per_gpu,
            "percent_of_peak": self.percent_of_peak, "breakdown_s": self.breakdown_s,
            "memory_per_gpu_bytes": self.memory_per_gpu_bytes, "simulated_ops": self.simulated_ops,
            "mode": self.mode, "simulated_ranks": self.simulated_ranks, "placement": self.placement,
            "profile": self.profile, "options": dict(self.options), "grid_choice": self.grid_choice,
            "flops_convention": self.flops_convention,
        }
        if self.pipeline:
            d["pipeline"] = self.pipeline
        if self.checkpoint:
            d["checkpoint"] = self.checkpoint
        if wall_time:
            d["wall_time_s"] = self.wall_time_s
        return d

    def to_json(self, wall_time: bool = True, indent: int | None = 1) -> str:
        """Deterministic JSON (fixed key order; wall_time_s, the one non-deterministic value, last)."""
        return finite_json(self.as_dict(wall_time), indent=indent)

    @property
    def grid_str(self) -> str:
        g = self.grid
        e = f"e{g['expert']}" if g.get("expert", 1) > 1 else ""  # the expert axis (twin/program/moe_grid.py)
        if g.get("pipe", 1) > 1:
            return f"{g['x']}x{g['y']}x{g['z']}x{g['pipe']}x{g['data']}{e}"
        return f"{g['x']}x{g['y']}x{g['z']}x{g['data']}{e}"
