"""What ends or skips a training step besides its own work: non-finite numbers and stop signals.

`StepGuard` is asked once per step, after the gradients are reduced and before the optimizer's
update (`before_update`):
- the loss is not finite (it is the same on every rank: no communication);
- a gradient is not finite on some rank: with clipping (the default) the global norm, which every
  rank computes, says it (`after_update`); without clipping one small all-reduce over every rank does.
And once per step the ranks agree whether SIGTERM or SIGUSR1 reached any of them (Slurm sends one
before a job's time limit; `--signal`), so that all stop after the same step: an all-reduce of one
flag issued when the step starts (`begin`) and waited for when it ends (`stopping`), so that its
latency hides behind the step (a blocking one cost 3 ms on 4 gloo ranks of the 2-core machine,
about 5 % of a gpt-tiny step).

A step whose loss or gradients are not finite is never applied: the weights, the optimizer state and
every checkpoint keep only finite values. The run then stops with one line naming the step
(`NonFiniteError`), or, with `--skip-nonfinite`, goes on to the next step with this one skipped.
A stop signal ends the run after the first step that began after it arrived (the step the ranks agree
on): a checkpoint of that step is saved (with `--ckpt-dir`) and the run exits with 128 + the signal's
number (`Stopped`).
"""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path

from topologies.common import TwinError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class NonFiniteError(TwinError):
    """A step's loss or gradients are not finite (exit code 1: the run diverged). Every rank raises it
    alike, so the launcher reports rank 0's."""

    exit_code = 1
    on_every_rank = True


class Stopped(TwinError):
    """The run was asked to stop by a signal and stopped at a step boundary (exit code 128 + signal)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StepGuard:
    """Checks one step before its update (see the module docstring). `why`: why this step's update
    was not applied (None: it was); `stop`: the signal every rank agreed to stop on (None: go on)."""

    def __init__(self, check_grads: bool):
        self.check_grads = check_grads
        self.received: int | None = None   # a stop signal this rank received
        self.why: str | None = None
        self.stop: int | None = None
        self._before: dict = {}
        self._flag = self._work = None

    # -- signals ----------------------------------------------------------------------------------
    def install(self) -> None:
        """Catch SIGTERM and SIGUSR1 (main thread only; elsewhere they keep their action)."""
        for sig in STOP_SIGNALS:
            try:
                self._before[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                return

    def uninstall(self) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)
        self._before.clear()

    def _on_signal(self, signum, frame) -> None:
        self.received = self.received or signum

    # -- the step ---------------------------------------------------------------------------------
    def begin(self, device) -> None:
        """At the start of a step (every rank): issue the all-reduce that agrees on a stop signal."""
        if _world() > 1:
            import torch
            import torch.distributed as dist
            self._flag = torch.tensor([float(self.received or 0)], device=device)
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)

    def stopping(self) -> int | None:
        """At the end of a step (every rank): the signal some rank received before the step began, or None."""
        if self._work is not None:
            self._work.wait()
            self.stop, self._work = int(self._flag.item()) or None, None
        else:
            self.stop = self.received if _world() <= 1 else None
        return self.stop

    def before_update(self, loss: float, model) -> str | None:
        """Whether this step's update may run (the same answer on every rank); returns why not, or None."""
        self.why = None if math.isfinite(loss) else f"the loss is {loss}"
        if self.why is None and self.check_grads:
            import torch
            import torch.distributed as dist
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            bad = torch.zeros(1, device=model.ctx.device)
            if grads:  # a sum is not finite when any of its terms is not
                bad[0] = (~torch.isfinite(torch.stack([g.float().sum() for g in grads]).sum())).float()
            if _world() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item():
                self.why = "a gradient is not finite (NaN or infinite)"
        return self.why

    def after_update(self, grad_norm: float | None) -> None:
        """With clipping, the global gradient norm (the same on every rank) tells non-finite gradients
        (the optimizer skipped the update then: backend.runtime.layers.adamw)."""
        if self.why is None and grad_norm is not None and not math.isfinite(grad_norm):
            self.why = f"the gradient norm is {grad_norm}"


    def settle(self, step: int, skip: bool, init_from: str | None, say: bool) -> dict:
        """After a step: raise NonFiniteError when its update was not applied (one line naming the step),
        or with `skip` return {"skipped": why} for its log record (and warn in one line when `say`)."""
        if self.why is None:
            return {}
        if not skip:
            raise NonFiniteError(nonfinite_line(step, self.why, init_from))
        if say:
            print(f"warning: step {step} skipped: {self.why} (--skip-nonfinite)", file=sys.stderr, flush=True)
        return {"skipped": self.why}

    def stop_here(self, step: int, ckpt_dir: str | None) -> None:
        """Raise Stopped: the run stops after `step` on the signal every rank agreed on."""
        saved = (f"checkpoint {Path(ckpt_dir) / f'step_{step:08d}'} saved: rerun the same command to resume"
                 if ckpt_dir else "no --ckpt-dir, so nothing was saved")
        raise Stopped(f"stopped by {signal.Signals(self.stop).name} after step {step}; {saved}", self.stop)


def _world() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def nonfinite_line(step: int, why: str, init_from: str | None = None) -> str:
    """The line a run stops with when a step's numbers are not finite."""
    hint = (f" (the weights of {init_from} may hold NaN or infinite values)" if init_from and step == 1 else
            ": lower --lr, keep --grad-clip on, or pass --skip-nonfinite to skip such steps")
    return (f"step {step}: {why}; stopped before its update, so the weights and checkpoints hold only "
            f"finite values{hint}")


def check_finite_state(state: dict, what: str) -> None:
    """Raise NonFiniteError when a state dict (a model's) holds a NaN or infinite value."""
    import torch

    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"{what}: {name} holds NaN or infinite values")
