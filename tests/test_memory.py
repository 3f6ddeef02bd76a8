"""Memory per GPU: the breakdown behaves, and the smallest tensor-parallel size that fits agrees
with the source table of docs/reference/models.md (A100 40 GB, 4,096 GPUs)."""

import pytest

from twin import Grid, Options, TwinError, list_models, load_model
from twin.predict.memory import GIB, check_fits, memory_per_gpu

POW2 = [1, 2, 4, 8, 16]


def smallest_fitting_tensor_size(model, gpus=4096, capacity=40 * GIB):
    for t in [2**i for i in range(11)]:
        for x in POW2:
            for y in POW2:
                if t % (x * y):
                    continue
                g = Grid(x, y, t // (x * y), max(1, gpus // t))
                try:
                    g.validate(model)
                except TwinError:
                    continue
                if memory_per_gpu(model, g).total <= capacity:
                    return t
    return None


def test_smallest_fitting_size_matches_source_table():
    names = [n for n in list_models() if load_model(n).min_tensor_parallel > 1]
    exact = 0
    for n in names:
        m = load_model(n)
        t = smallest_fitting_tensor_size(m)
        assert t is not None and m.min_tensor_parallel / 2 <= t <= m.min_tensor_parallel * 2, n
        exact += t == m.min_tensor_parallel
    assert exact >= len(names) - 1


def test_breakdown_moves_the_right_way():
    m = load_model("gpt-40b")
    base = memory_per_gpu(m, Grid(2, 2, 8, 16))
    assert memory_per_gpu(m, Grid(2, 2, 16, 8)).parameters < base.parameters
    norec = memory_per_gpu(m, Grid(2, 2, 8, 16), Options(recompute=False))
    assert norec.activations > 5 * base.activations
    mb = memory_per_gpu(m, Grid(2, 2, 8, 16), Options(micro_batches=4))
    assert mb.activations < base.activations and mb.logits < base.logits
    cached = memory_per_gpu(m, Grid(2, 2, 8, 16), Options(cache_layers=10))
    assert cached.gathered_weights > base.gathered_weights
    assert base.total == sum(v for k, v in base.as_dict().items() if k != "total")
    # 18 bytes per parameter of the shard in bf16 mixed precision, 16 in fp32 (the backend on CPU)
    assert base.parameters + base.gradients + base.optimizer == pytest.approx(
        18 * m.parameters(m.padded_vocab(2)) / 32, rel=0.01)
    fp32 = memory_per_gpu(m, Grid(2, 2, 8, 16), activation_bytes=4)
    # the backend's fp32 policy: parameters and AdamW's moments (12 bytes), the gradients made so far
    assert fp32.parameters + fp32.optimizer == pytest.approx(12 * m.parameters(m.padded_vocab(2)) / 32, rel=0.01)
    assert 0 < fp32.gradients <= fp32.parameters
    assert fp32.activations > 1.9 * base.activations


def test_check_fits_says_by_how_much():
    m = load_model("gpt-320b")
    mem = memory_per_gpu(m, Grid(2, 2, 2, 4096))
    with pytest.raises(TwinError, match=r"over by \d+\.\d GiB"):
        check_fits(mem, 64 * GIB)
    check_fits(memory_per_gpu(m, Grid(8, 8, 4, 128)), 64 * GIB)


def test_what_the_executor_holds_at_the_backward_peak():
    """Term by term (twin/predict/memory.py): the GELU-output gradient with the last block's stash; on G_z > 1
    the block's gathered weights, the prefetch, mlp_down's full wgrad and gloo's copy of it."""
    m = load_model("gpt-small")
    tokens, ffn, h = 16 * 128, m.ffn, m.hidden
    one = memory_per_gpu(m, Grid(1, 1, 1, 1), activation_bytes=4)
    assert one.gathered_weights == 0
    norec = memory_per_gpu(m, Grid(1, 1, 1, 1), Options(recompute=False), activation_bytes=4)
    assert norec.activations > one.activations
    z = memory_per_gpu(m, Grid(1, 1, 2, 1), activation_bytes=4)
    nccl = memory_per_gpu(m, Grid(1, 1, 2, 1), activation_bytes=4, gloo=False)
    assert z.gathered_weights - nccl.gathered_weights == 4 * ffn * h  # gloo's copy of mlp_down's wgrad
    w = [k * n for _, k, n, _ in m.linear_shapes()]
    assert nccl.gathered_weights == 4 * (sum(w[:-1]) + max(w) + w[-1])
    assert z.activations >= 4 * (tokens // 2) * ffn  # the GELU-output gradient, tokens split over z


def test_gradient_reductions_peak_on_gloo():
    """With G_data > 1 on gloo the executor all-reduces flat copies of the gradients: the peak is
    the static state plus one fp32 copy when that beats the backward peak (measured: gpt-small on
    1x1x1x8 held 64.98 MB, 16 bytes per parameter + 4)."""
    m = load_model("gpt-small")
    dp = memory_per_gpu(m, Grid(1, 1, 1, 8), activation_bytes=4)
    static = dp.parameters + dp.gradients + dp.optimizer
    assert dp.total == static + dp.gradients and dp.reduction_buffers > 0
    assert memory_per_gpu(m, Grid(1, 1, 1, 8), activation_bytes=4, gloo=False).reduction_buffers == 0
    assert memory_per_gpu(m, Grid(1, 1, 1, 2), activation_bytes=4).reduction_buffers == 0  # backward peak higher
    assert memory_per_gpu(m, Grid(8, 1, 1, 1), activation_bytes=4).reduction_buffers == 0  # no data axis


def test_the_backend_peak_as_measured():
    """gpt-small in fp32 (the backend on CPU), torch's memory tracker (the CPU calibration loops,
    `twin validate`, 35 grids within 2.3 %; tests/fixtures/cpu-2026-12-03a): a GELU backward of the first layer on 8x1x1x1 (47.27
    MiB: gradients of layers 1-3, no logits), the layer norm backward of the last layer on 1x8x1x1
    (28.02 MiB: three saved block inputs, four residual-stream tensors)."""
    m = load_model("gpt-small")
    for grid, measured in (("8x1x1x1", 47.27), ("1x8x1x1", 28.02), ("1x4x1x2", 22.69), ("1x1x2x2", 39.79)):
        mem = memory_per_gpu(m, Grid.parse(grid), Options(), 16, 128, activation_bytes=4)
        assert mem.total / 2**20 == pytest.approx(measured, rel=0.025), grid
        assert mem.logits == 0 and mem.gradients < mem.parameters  # past the loss, before the first layer's wgrads
    full = memory_per_gpu(m, Grid(8, 1, 1, 1), Options(micro_batches=2), 16, 128, activation_bytes=4)
    assert full.gradients == full.parameters  # from the second micro-batch on every gradient exists


def test_the_measured_cpu_loop_memory():
    """The 35 gpt-small grids of the measured CPU loop (tests/fixtures/cpu-2026-12-03a, torch's memory
    tracker on each rank's second step): the fp32 model within 2.3 % on every grid (worst 1x1x4x2 and
    1x1x8x1, +2.2 %)."""
    import json
    from pathlib import Path

    report = Path(__file__).resolve().parent / "fixtures/cpu-2026-12-03a/report.json"
    runs = json.loads(report.read_text())["runs"]
    errors = {}
    for run in runs:
        spec = load_model(run["model"])
        options = Options(**{k: v for k, v in run["options"].items() if k in Options.__dataclass_fields__})
        mem = memory_per_gpu(spec, Grid.parse(run["grid"]), options, run["batch"], spec.seq_len, activation_bytes=4)
        errors[run["grid"]] = mem.total / run["memory"]["measured_bytes"] - 1
    assert len(errors) == 35
    assert max(map(abs, errors.values())) < 0.025, errors
