"""What one rank holds on its device at its peak, measured with torch's memory tracker."""

from __future__ import annotations


def peak_memory(fn, *modules_and_optimizers) -> tuple[object, int]:
    """Run `fn()` under torch's memory tracker; (its result, peak bytes this rank held on its device).

    The parameters, gradients and optimizer states of `modules_and_optimizers` count from the start,
    so the peak is everything the rank holds, not only what `fn` allocates.
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(*modules_and_optimizers)
    with tracker:
        out = fn()
    peak = tracker.get_tracker_snapshot("peak")
    return out, int(sum(v.get("Total", 0) for v in peak.values()))
