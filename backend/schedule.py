"""What the 3D-parallel layers share while they run the program: pass, names, weight gathers, grads.

One `Schedule` per model. It knows
- the op-name prefix (`mb<j>.` with several micro-batches) and the phase (`fwd`, `rec`, `bwd`);
- the z all-gathers of weights in the program's order for the pass, with the one-layer-ahead prefetch
  (OAG) and the weight cache of the first `cache_layers` blocks (`_Builder.gather` in twin/program.py);
- the z reduce-scatters of weight gradients, blocking or deferred (ORS);
- the GEMMs, recorded under their names and, on GPU, run in the fastest physical layout (GemmTuner).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from backend.comm import Comm, Pending
from backend.dist import ParallelContext
from backend.recorder import NULL_RECORDER, Recorder
from twin.program import ACT_BYTES, Options

LINEARS = ("qkv", "attn_out", "mlp_up", "mlp_down")


class GemmTuner:
    """Pick, once per shape, the fastest physical layout of each GEMM operand (GPU only).

    A logical product a @ b can be handed to the BLAS with each operand row-major (N) or
    column-major (T); the copy that makes an operand so is part of the cost timed. Off on CPU:
    the product is computed as given.
    """

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


class Schedule:
    """Shared run-time state of the layers of one model (see the module docstring)."""

    def __init__(self, ctx: ParallelContext, options: Options, layers: int,
                 recorder: Recorder = NULL_RECORDER, tune_gemms: bool | None = None):
        self.ctx, self.options, self.layers = ctx, options, layers
        self.comm = Comm(ctx, recorder)
        self.dtype = ctx.compute_dtype
        self.tuner = GemmTuner(ctx.device.type == "cuda" if tune_gemms is None else tune_gemms)
        self.prefix, self.phase = "", "fwd"
        self.shape = (0, 0)  # (sequences, sequence length) of the current micro-batch on this rank
        self.first_micro_batch = True
        # weight gathers: key -> (shard tensors, function from the gathered flat tensor to weights)
        self.sources: dict[str, tuple[list[torch.Tensor], Callable]] = {}
        self.pass_name, self.order = "fwd", []
        self.issued: dict[str, Pending] = {}
        self.cache: dict[str, object] = {}
        self.cache_keys = {f"L{i}.{ln}" for i in range(min(options.cache_layers, layers)) for ln in LINEARS}
        self.pending: list[tuple[Pending, list[torch.nn.Parameter]]] = []  # deferred reduce-scatters

    # -- recording ---------------------------------------------------------------------------------
    @property
    def recorder(self) -> Recorder:
        return self.comm.recorder

    @recorder.setter
    def recorder(self, rec: Recorder) -> None:
        self.comm.recorder = rec

    def name(self, layer: str, what: str, phase: str | None = None) -> str:
        """The program's name of an op: `[mb<j>.]<layer>.<phase>.<what>` (no what: `<layer>.<phase>`)."""
        phase = phase or self.phase
        return f"{self.prefix}{layer}.{phase}" + (f".{what}" if what else "")

    @contextmanager
    def compute(self, name: str, kind: str) -> Iterator[None]:
        """Record a non-GEMM compute op."""
        with self.recorder.op(name, kind, "compute"):
            yield

    def gemm(self, name: str, a: torch.Tensor, b: torch.Tensor, layout: str) -> torch.Tensor:
        """C[m,n] = A[m,k] B[k,n], recorded with the program's (logical) layout."""
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        rec = self.recorder.begin(name, "gemm", "compute", bytes=ACT_BYTES * (m * k + k * n + m * n),
                                  m=m, n=n, k=k, layout=layout)
        out, used = self.tuner.matmul(a, b)
        if rec is not None and used:
            rec.args["impl"] = used
        self.recorder.end(rec)
        return out

    # -- passes ------------------------------------------------------------------------------------
    def begin_forward(self, micro_batch: int, sequences: int, seq_len: int) -> None:
        """Start the forward pass of micro-batch `micro_batch`; declare its gather order."""
        self.prefix = f"mb{micro_batch}." if self.options.micro_batches > 1 else ""
        self.phase, self.shape = "fwd", (sequences, seq_len)
        self.first_micro_batch = micro_batch == 0
        if self.first_micro_batch:  # a new step: weights may have changed since the cache was filled
            self.finish_grads()
            self.cache = {}
        order = ["emb"]
        for i in range(self.layers):
            if not (i < self.options.cache_layers and not self.first_micro_batch):
                order += [f"L{i}.{ln}" for ln in LINEARS]
        self._start_pass("fwd", order + ["head"])

    def begin_backward(self) -> None:
        """Start the backward pass (called by the loss's backward, the first op of the pass)."""
        self.phase = "bwd"
        order = ["head"]
        lin = LINEARS if self.options.recompute else LINEARS[::-1]
        for i in reversed(range(self.layers)):
            if i >= self.options.cache_layers:
                order += [f"L{i}.{ln}" for ln in lin]
        self._start_pass("bwd", order)

    def _start_pass(self, name: str, order: list[str]) -> None:
        self.pass_name = name
        self.order = order if self.ctx.size("z") > 1 else []
        self.issued = {}

    def end_step(self) -> None:
        """Forget the cached weights (they change with the optimizer step)."""
        self.finish_grads()
        self.cache = {}

    # -- weights -----------------------------------------------------------------------------------
    def register(self, key: str, shards: list[torch.Tensor], unpack: Callable) -> None:
        """Declare weight `key`: its z-shards (concatenated when gathered) and how to unpack the
        gathered flat tensor [G_z * sum(shard sizes)] into the full local weight(s)."""
        self.sources[key] = (shards, unpack)

    def _flat_shard(self, key: str) -> torch.Tensor:
        shards, _ = self.sources[key]
        if len(shards) == 1:  # no concatenation copy
            return shards[0].detach().reshape(-1).to(self.dtype)
        return torch.cat([s.detach().reshape(-1) for s in shards]).to(self.dtype)

    def _issue(self, key: str) -> None:
        name = f"{self.prefix}{key}.{self.pass_name}.ag_z"
        self.issued[key] = self.comm.all_gather(self._flat_shard(key), "z", name, async_op=True)

    def weight(self, key: str):
        """The full local weight of `key` (gathered over z, prefetching the next one with OAG)."""
        if key in self.cache:
            return self.cache[key]
        _, unpack = self.sources[key]
        if key not in self.order:  # G_z = 1: the shard is the whole block
            return unpack(self._flat_shard(key).view(1, -1))
        pos = self.order.index(key)
        if key not in self.issued:
            self._issue(key)
        if self.options.oag and pos + 1 < len(self.order) and self.order[pos + 1] not in self.issued:
            self._issue(self.order[pos + 1])
        flat = self.issued[key].wait()
        w = unpack(flat.view(self.ctx.size("z"), -1))
        if key in self.cache_keys:
            self.cache[key] = w
        return w

    # -- weight gradients --------------------------------------------------------------------------
    def reduce_grad(self, name: str, full: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        """Reduce-scatter a weight gradient over z and add this rank's chunk to the params' grads.

        full: [G_z, sum of the params' sizes] (row j holds what shard j of every param receives).
        Blocking without ORS; deferred (waited in finish_grads) with ORS.
        """
        p = self.comm.reduce_scatter(full.reshape(-1), "z", name, async_op=self.options.ors)
        if p.done:
            self._accumulate(p.result, params)
        else:
            self.pending.append((p, params))

    def finish_grads(self) -> None:
        """Wait for the deferred reduce-scatters and accumulate their chunks."""
        for p, params in self.pending:
            self._accumulate(p.wait(), params)
        self.pending = []

    @staticmethod
    def _accumulate(chunk: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        off = 0
        for prm in params:
            g = chunk[off:off + prm.numel()].view_as(prm).to(prm.dtype)
            off += prm.numel()
            if prm.grad is None:
                prm.grad = g.clone()
            else:
                prm.grad.add_(g)
