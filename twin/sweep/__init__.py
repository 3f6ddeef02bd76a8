"""Design-space sweeps (`twin sweep SWEEP.toml`): the product of axes (systems, parameter overrides,
models, GPU counts, batches, sequence lengths, switches, grids), each point predicted with its best
grid, with time to train, GPU-hours and goodput under node failures.

- `spec.py`: the sweep file (its schema, its axes, the points and their keys);
- `overrides.py`: a system or profile parameter set by its dotted path (`node.nic_bandwidth`);
- `point.py`: one point predicted into one row (what each Dask task runs);
- `goodput.py`: expected wall time and goodput under node failures with checkpoints;
- `results.py`: the CSV the rows are appended to, read back to resume;
- `run.py`: the points run serially or as Dask tasks (local processes, a scheduler, Slurm);
- `page.py`: the HTML page (table, heat maps, Pareto front).

It sits above twin.predict (it predicts) and twin.present (its page), below twin.cli.
"""
