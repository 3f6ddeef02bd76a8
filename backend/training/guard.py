"""What ends or skips a training step besides its own work: non-finite numbers and stop signals.

`StepGuard` is asked once per step, after the gradients are reduced and before the optimizer's
update (`before_update`), in one small all-reduce over every rank (MAX of three flags):
- the loss is not finite (it is the same on every rank);
- a gradient is not finite on some rank (checked here only when the program does not clip: with
  clipping the global norm, which every rank computes, says it: `after_update`);
- SIGTERM or SIGUSR1 reached some rank (Slurm sends one before a job's time limit; `--signal`), so
  that all ranks agree to stop after the same step.

A step whose loss or gradients are not finite is never applied: the weights, the optimizer state and
every checkpoint keep only finite values. The run then stops with one line naming the step
(`NonFiniteError`), or, with `--skip-nonfinite`, goes on to the next step with this one skipped.
A stop signal ends the run after the step it arrived in: a checkpoint of that step is saved (with
`--ckpt-dir`) and the run exits with 128 + the signal's number (`Stopped`).
"""

from __future__ import annotations

import math
import signal

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
    def before_update(self, loss: float, model) -> str | None:
        """Agree over every rank whether this step's update may run; returns why not (or None)."""
        import torch
        import torch.distributed as dist

        flags = torch.zeros(3, dtype=torch.float32)
        flags[0] = 0.0 if math.isfinite(loss) else 1.0
        if self.check_grads and flags[0] == 0:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads:  # a sum is not finite when any of its terms is not
                total = torch.stack([g.float().sum() for g in grads]).sum()
                flags[1] = 0.0 if bool(torch.isfinite(total)) else 1.0
        flags[2] = float(self.received or 0)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = model.ctx.device
            flags = flags.to(device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            flags = flags.cpu()
        self.stop = int(flags[2]) or None
        self.why = (f"the loss is {loss}" if flags[0] else "a gradient is not finite (NaN or infinite)"
                    if flags[1] else None)
        return self.why

    def after_update(self, grad_norm: float | None) -> None:
        """With clipping, the global gradient norm (the same on every rank) tells non-finite gradients
        (the optimizer skipped the update then: backend.runtime.layers.adamw)."""
        if self.why is None and grad_norm is not None and not math.isfinite(grad_norm):
            self.why = f"the gradient norm is {grad_norm}"


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
