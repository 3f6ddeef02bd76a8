"""`twin models`, `program`, `systems` and `topology`: what the twin knows about models, schedules and
machines, printed as tables."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from twin.cli.common import PlacementOpt, SystemOpt, console, handles_errors
from topologies.common import TwinError, write_atomic
from twin.program.flags import (BatchOpt, CacheOpt, ChunksOpt, FrameworkOpt, GridOpt, ScheduleOpt, MicroOpt, ModelOpt, OagOpt, OarOpt, OrsOpt, RecomputeOpt,
                        SeqOpt, options_from_flags, output_file)
from twin.program.grid import Grid
from twin.predict.memory import GIB, check_fits, memory_per_gpu
from twin.program.model import list_models, load_model
from twin.program.pipeline import check_pipeline, stage_programs
from twin.program.program import build_program
from twin.program.programfile import save_program
from twin.present.tables import human_bytes, table


def _count(n: float) -> str:
    """A parameter count in B or M (gpt-tiny has 0.1 M, not "0.00 B")."""
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


@handles_errors
def models_cmd() -> None:
    """List the models that ship with the twin."""
    cols = ("model", "layers", "hidden", "heads", "vocab", "seq", "batch", "parameters")
    t = table(*cols, keep=cols, right=cols[1:])
    for name in list_models():
        m = load_model(name)
        t.add_row(name, str(m.layers), str(m.hidden), str(m.heads), str(m.vocab), str(m.seq_len),
                      str(m.global_batch), _count(m.parameters()))
    console.print(t)


@handles_errors
def program_cmd(
    model: ModelOpt = "gpt-5b",
    grid: GridOpt = "2x2x2x64",
    gpus: Annotated[Optional[int], typer.Option(help="GPU count; must equal the grid's product.")] = None,
    batch: BatchOpt = None,
    seq: SeqOpt = None,
    oar: OarOpt = True,
    ors: OrsOpt = True,
    oag: OagOpt = True,
    cache_layers: CacheOpt = 0,
    recompute: RecomputeOpt = True,
    micro_batches: MicroOpt = 1,
    schedule: ScheduleOpt = "1f1b",
    chunks: ChunksOpt = 1,
    framework: FrameworkOpt = "axonn",
    stage: Annotated[int, typer.Option(help="The pipeline stage whose program to print (grids XxYxZxPxD).")] = 0,
    hbm_gib: Annotated[Optional[float], typer.Option(help="GPU memory (GiB) to check the fit against; off by default.")] = None,
    json_print: Annotated[bool, typer.Option("--json", help="Print the whole program (every op) as JSON instead of its summary.")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json-out", help="Write the whole program (every op) as JSON to this file (`twin simulate --program`, `backend run --program`).", callback=output_file)] = None,
) -> None:
    """Build the schedule of one iteration for one rank and print its summary."""
    spec = load_model(model)
    g = Grid.parse(grid)
    opts = options_from_flags(oar, ors, oag, cache_layers, recompute, micro_batches, schedule=schedule, chunks=chunks,
                              framework=framework)
    g.validate(spec, gpus=gpus, batch=batch, micro_batches=micro_batches, seq_len=seq)
    check_pipeline(spec, g, opts)
    if not 0 <= stage < g.pipe:
        raise TwinError(f"--stage {stage} is not a stage of grid {g} (0..{g.pipe - 1})")
    mem = memory_per_gpu(spec, g, opts, batch, seq)
    if hbm_gib is not None:
        if not 0 < hbm_gib < 1e9:  # also refuses nan and inf
            raise TwinError(f"--hbm-gib must be a positive number of GiB, got {hbm_gib}")
        check_fits(mem, hbm_gib * GIB, f"{spec.name} on grid {g} ")
    prog = build_program(spec, g, opts, batch, seq, stage=stage)
    if json_out is not None:
        # a pipelined grid's file holds every stage's program
        save_program(stage_programs(spec, g, opts, batch, seq) if g.pipe > 1 else prog, json_out)
    if json_print:
        from twin.program.programfile import program_json
        typer.echo(program_json(stage_programs(spec, g, opts, batch, seq) if g.pipe > 1 else prog))
        return
    s = prog.summary()
    console.print(f"{spec.name} on grid {g} ({g.size} GPUs), batch {s['global_batch']} x "
                  f"{s['seq_len']} tokens, padded vocabulary {s['padded_vocab']}")
    kinds = table("kind", "ops", title="ops by kind", right=("ops",))
    for k, n in s["ops_by_kind"].items():
        kinds.add_row(k, str(n))
    console.print(kinds)
    axes = table("axis", "group size", "payload", "on the wire per rank", title="communication per rank (ring volumes)",
                 right=("group size", "payload", "on the wire per rank"))
    for a, v in s["wire_bytes_per_axis"].items():
        axes.add_row(a, str(g.axis_size(a)), human_bytes(s['payload_bytes_per_axis'][a]), human_bytes(v))
    console.print(axes)
    console.print(f"flops per rank {s['flops_per_rank']:.4g}; model flops {s['model_flops']:.4g} "
                  f"(GEMM+attention {s['matmul_flops']:.4g}, reference formula {s['reference_flops']:.4g})")
    console.print(f"memory per GPU {human_bytes(mem.total)} with bf16 activations (a GPU's): " + ", ".join(
        f"{k} {human_bytes(v)}" for k, v in mem.as_dict().items() if k != "total"))
    fp32 = memory_per_gpu(spec, g, opts, batch, seq, activation_bytes=4).total
    console.print(f"on a CPU (fp32 activations, gloo's reduce-scatter copies), as `twin simulate --system cpu "
                  f"--program` reports it: {human_bytes(fp32)}")
    if json_out is not None:
        console.print(f"wrote {json_out}")


@handles_errors
def systems_cmd() -> None:
    """List the systems with their key figures."""
    from topologies.system import list_systems, load_system
    t = table("system", "GPU", "bf16 TF/s", "HBM GiB", "nodes x GPUs", "NICs x GB/s", "groups x links", "default study",
              title="systems (per GPU; GB/s per direction; groups x global links per group pair)",
              keep=("system", "bf16 TF/s", "HBM GiB", "nodes x GPUs", "NICs x GB/s", "groups x links"),
              right=("bf16 TF/s", "HBM GiB"))
    for name in list_systems():
        s = load_system(name)
        df = s.dragonfly
        t.add_row(name, s.gpu.name, f"{s.gpu.peak_flops / 1e12:.4g}", f"{s.gpu.hbm_bytes / 2**30:.3g}",
                  f"{s.nodes} x {s.gpus_per_node}", f"{s.nics_per_node} x {s.nic_bandwidth / 1e9:.0f}",
                  f"{df.groups} x {df.global_links_per_pair}" if df else
                  f"fat tree ({len(s.fattree.levels)} levels)" if s.fattree else "-",
                  f"{s.default_model} on {s.default_gpus}")
    console.print(t)


@handles_errors
def topology_cmd(
    system: SystemOpt = "frontier",
    html: Annotated[Optional[str], typer.Option("--html", help="Write the dragonfly and node fabric as one HTML file here.", callback=output_file)] = None,
    gpus: Annotated[Optional[int], typer.Option(help="Place a job of this many GPUs (default: the system's default study).")] = None,
    placement: PlacementOpt = "contiguous",
    seed: Annotated[int, typer.Option(help="Seed of the scattered placement.")] = 0,
    grid: Annotated[Optional[str], typer.Option("--grid", "-g", help="Also print the ring bandwidth each axis of this 4D grid gets (all its groups at once).")] = None,
) -> None:
    """Build a system's network, place a job on it, print a summary and optionally draw it."""
    import time

    from topologies.network import build_network
    from topologies.placement import place
    from topologies.system import load_system
    s = load_system(system)
    g = Grid.parse(grid) if grid is not None else None
    if g is not None and gpus is not None and g.size != gpus:
        raise TwinError(f"grid {g} has {g.size} GPUs but --gpus is {gpus}: make G_x*G_y*G_z*G_data equal the GPU count")
    job = place(s, g.size if g is not None else s.default_gpus if gpus is None else gpus, placement, seed)
    t0 = time.perf_counter()
    net = build_network(s)
    dt = time.perf_counter() - t0
    info = net.summary()
    console.print(f"{s.name}: {s.description}")
    shape = f"a {len(s.fattree.levels)}-level fat tree" if s.fattree else f"{info['groups']} groups"
    console.print(f"network built in {dt:.3f} s: {shape}, {info['nodes']} nodes, {info['gpus']} GPUs, "
                  f"{info['nics']} NICs, {info['switches']} switches, {info['links']} directed links")
    links = table("link kind", "links", "GB/s per direction", keep=("link kind", "links"), right=("links",))
    for kind, n in info["links_by_kind"].items():
        if n:
            cap = net.capacity[net.kind == list(info["links_by_kind"]).index(kind)]
            links.add_row(kind, str(n), f"{cap.min() / 1e9:.0f}" + ("" if cap.min() == cap.max() else f"-{cap.max() / 1e9:.0f}"))
    console.print(links)
    if net.fattree is not None:  # where a fat tree's job sits: its leaves and pods
        import numpy as np
        ft = net.fattree
        e = ft.endpoint((job.nodes[:, None] * s.nics_per_node + np.arange(s.nics_per_node)).ravel())
        console.print(f"job of {job.ranks} GPUs ({placement}): {len(job.nodes)} nodes on "
                      f"{len(np.unique(e // ft.down[0]))} of {ft.switches[0]} {s.fattree.levels[0].name} switches, "
                      f"{len(np.unique(e // ft.pod_size))} of {ft.pods} pods")
    else:
        console.print(f"job of {job.ranks} GPUs ({placement}): {len(job.nodes)} nodes in "
                      f"{len(job.groups_used())} of {s.groups} groups")
    if g is not None:
        from twin.costs.collectives import CollectiveModel
        cm = CollectiveModel(s, g, placement=placement, seed=seed)
        cols = ("axis", "group size", "rank stride", "bus GB/s", "GB/s with all axes at once")
        axes = table(*cols, title=f"ring bandwidth per axis of grid {g} (every group of the axis at once)",
                     right=cols[1:])
        others = frozenset(a for a in ("x", "y", "z", "data") if g.axis_size(a) > 1)
        for a in ("x", "y", "z", "data"):
            if g.axis_size(a) > 1:
                axes.add_row(a, str(g.axis_size(a)), str(g.stride(a)), f"{cm.effective_bandwidth(a) / 1e9:.1f}",
                             f"{cm.effective_bandwidth(a, others - {a}) / 1e9:.1f}")
        console.print(axes)
    if html is not None:
        from topologies.draw import topology_figure
        write_atomic(html, topology_figure(net, job).to_html(include_plotlyjs=True))
        console.print(f"wrote {html}")
