"""What the process keeps per study, so that the ranking (twin.predict.search), the bounds (twin.predict.bounds) and
the simulations (twin.predict.simulate) of a study, and of any equal one (a new Study with the same
contents), share their work: the digests that name a study and its machine (`study_key`,
`machine_key`), the last few programs and collective models per grid (`program_for`, `model_for`)
and twin.costs.solobound's figures of ring sets per machine."""

from __future__ import annotations

import pickle
from typing import Callable

from topologies import caches
from topologies.memo import digest
from twin.program.grid import Grid
from twin.predict.study import Study, collective_model


def study_key(study: Study) -> bytes:
    """Digest of everything a study's results depend on (system, model, GPUs, batch, switches,
    placement, kernel profile and tuning): equal studies share ranked grids and simulations."""
    return digest(pickle.dumps((study.system, study.model, study.gpus, study.batch, study.seq_len,
                                study.options, study.placement, study.profile, study.kernels.tuning)))


def machine_key(study: Study) -> bytes:
    """Digest of what the collective model of a study depends on: system, placement and the kernel
    profile (which may carry measured collective tables)."""
    return digest(pickle.dumps((study.system, study.placement, study.profile)))


# twin.costs.solobound figures of ring sets, by machine, GPU count, size and stride (unbounded: small)
SOLO_PHASES: dict = caches.register("twin.predict.study_cache.solo_phases", {})


KEEP_GRIDS = 24  # programs and collective models kept: a search bounds up to 16 grids, then simulates some
# (program digest, grid) -> the study's program on the grid (program_for): the last KEEP_GRIDS
_PROGRAMS: dict[tuple[bytes, str], object] = caches.register("twin.predict.study_cache.programs", {})
# (machine_key, grid) -> the study's collective model on the grid (model_for): the last KEEP_GRIDS
_MODELS: dict[tuple[bytes, str], object] = caches.register("twin.predict.study_cache.models", {})


def _kept(cache: dict, key, make: Callable[[], object]):
    """cache[key], made by `make()` if missing; the KEEP_GRIDS most recently used entries are kept."""
    value = cache.pop(key, None)
    if value is None:
        value = make()
    cache[key] = value
    if len(cache) > KEEP_GRIDS:
        cache.pop(next(iter(cache)))
    return value


def _program_digest(study: Study) -> bytes:
    return digest(pickle.dumps((study.model, study.options, study.batch, study.seq_len)))


def program_for(study: Study, grid: Grid):
    """The study's program on `grid` (twin.program.program.build_program), the last few kept for the process:
    the search builds it for a grid's lower bound and then again to simulate it. A grid whose program
    has the same ops as a kept one's (twin.program.program.same_ops_but_shards) gets that one resized
    (twin.program.program.regrid: about 40 times cheaper than building it). Treat it as read-only."""
    d = _program_digest(study)

    def make():
        from twin.program.program import build_program, regrid, same_ops_but_shards
        for (k, name), prog in reversed(_PROGRAMS.items()):
            if k == d and same_ops_but_shards(prog.grid, grid):
                return regrid(prog, grid)
        return build_program(study.model, grid, study.options, study.batch, study.seq_len)

    return _kept(_PROGRAMS, (d, str(grid)), make)


def programs_kept(study: Study) -> list[Grid]:
    """The grids of the study's GPU count whose programs are kept (program_for), oldest first."""
    d = _program_digest(study)
    grids = [Grid.parse(name) for key, name in _PROGRAMS if key == d]
    return [g for g in grids if g.size == study.gpus]


def model_for(study: Study, grid: Grid):
    """The study's collective model on `grid` (twin.predict.study.collective_model), the last few kept for the
    process: a grid's lower bound asks it for contention-free times, the simulation of the grid then
    asks the same model (its flow sets and rates already computed)."""
    return _kept(_MODELS, (machine_key(study), str(grid)), lambda: collective_model(study, grid))
