"""GEMM layout tuning: pick, once per shape, the fastest physical layout of each operand (GPU only).

A logical product a @ b can be handed to the BLAS with each operand row-major (N) or column-major
(T); the copy that makes an operand so is part of the cost timed. Off on CPU: the product is
computed as given. The program's (logical) layout is what the trace records; the one used goes
into the record's args as `impl`.
"""

from __future__ import annotations

import time

import torch


class GemmTuner:
    """Times the three physical layouts of each new GEMM shape and keeps the fastest."""

    VARIANTS = ("NN", "NT", "TN")

    def __init__(self, enabled: bool, repeats: int = 3):
        self.enabled, self.repeats = enabled, repeats
        self.choice: dict[tuple, str] = {}

    @staticmethod
    def _as(t: torch.Tensor, layout: str) -> torch.Tensor:
        return t.contiguous() if layout == "N" else t.t().contiguous().t()

    def _run(self, a: torch.Tensor, b: torch.Tensor, variant: str) -> torch.Tensor:
        return self._as(a, variant[0]) @ self._as(b, variant[1])

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, str]:
        """a @ b and the physical layout used ('' when not tuned)."""
        if not self.enabled:
            return a @ b, ""
        key = (tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype)
        if key not in self.choice:
            best, best_t = "NN", float("inf")
            sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
            for v in self.VARIANTS:
                self._run(a, b, v)  # warm up
                sync()
                t0 = time.perf_counter()
                for _ in range(self.repeats):
                    self._run(a, b, v)
                sync()
                if (dt := time.perf_counter() - t0) < best_t:
                    best, best_t = v, dt
            self.choice[key] = best
        v = self.choice[key]
        return self._run(a, b, v), v
