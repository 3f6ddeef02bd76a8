"""Kernel profiles and the kernel time model."""

import tomllib

import pytest

from twin.costs.profile import PROFILES_DIR, list_profiles, load_profile, profile_for_gpu
from topologies.common import TwinError
from twin.costs.kernels import KernelModel
from twin.program.program import Op


def test_every_profile_loads_and_every_number_has_a_source():
    assert {"mi250x-gcd", "a100", "gh200", "h200", "cpu"} <= set(list_profiles())
    for name in list_profiles():
        p = load_profile(name)
        assert 0 < p.gemm_efficiency <= 1
        data = tomllib.loads((PROFILES_DIR / f"{name}.toml").read_text())
        for key, entry in data.items():
            if isinstance(entry, dict):
                assert entry.get("source"), f"{name}: {key} has no source"


def test_reached_gemm_figures_from_the_reference():
    assert load_profile("mi250x-gcd").gemm_flops == 125e12
    assert load_profile("a100").gemm_flops == 280e12
    assert load_profile("gh200").gemm_flops == 813e12
    assert load_profile("h200").gemm_flops == 790e12


@pytest.mark.parametrize("gpu,profile", [("AMD MI250X GCD", "mi250x-gcd"), ("NVIDIA A100 40GB", "a100"),
                                         ("NVIDIA GH200 (H100 96GB)", "gh200"), ("NVIDIA H200", "h200"),
                                         ("CPU rank (1/8 of 2 Zen 4 cores)", "cpu")])
def test_profile_by_gpu_name(gpu, profile):
    assert profile_for_gpu(gpu).name == profile


def test_unknown_profile_is_a_twin_error():
    with pytest.raises(TwinError):
        load_profile("tpu-v9")
    with pytest.raises(TwinError):
        profile_for_gpu("Some Accelerator 3000")


def test_large_gemm_reaches_the_profile_rate():
    km = KernelModel(load_profile("a100"))
    m = n = k = 16384
    t = km.gemm_time(m, n, k, "NN")
    rate = 2.0 * m * n * k / t
    assert 0.9 * 280e12 < rate <= 280e12


def test_small_and_thin_gemms_are_less_efficient():
    km = KernelModel(load_profile("mi250x-gcd"))
    big = 2.0 * 8192**3 / km.gemm_time(8192, 8192, 8192, "NN")
    thin_k = 2.0 * 8192 * 8192 * 64 / km.gemm_time(8192, 8192, 64, "NN")
    small = 2.0 * 512**3 / km.gemm_time(512, 512, 512, "NN")
    assert thin_k < 0.5 * big and small < 0.5 * big


def test_wave_quantization():
    p = load_profile("a100")
    km = KernelModel(p)
    full_wave = p.compute_units * p.tile_m          # tiles == SMs: one full wave
    one_more = full_wave + p.tile_m                  # one tile more: a second, nearly empty wave
    e1 = km.shape_efficiency(full_wave, p.tile_n, 4096)
    e2 = km.shape_efficiency(one_more, p.tile_n, 4096)
    assert e2 < 0.55 * e1


def test_layout_tuning_on_mi250x():
    prof = load_profile("mi250x-gcd")
    tuned, untuned = KernelModel(prof, tuning=True), KernelModel(prof, tuning=False)
    m, n, k = 16384, 16384, 16384
    nn = untuned.gemm_time(m, n, k, "NN")
    tn = untuned.gemm_time(m, n, k, "TN")
    assert 6 < tn / nn <= 8.5          # rocBLAS TN up to ~8x slower on large shapes
    assert tuned.gemm_time(m, n, k, "TN") == pytest.approx(nn)
    # on an A100 the layouts hardly differ
    a100 = KernelModel(load_profile("a100"), tuning=False)
    assert a100.gemm_time(m, n, k, "TN") / a100.gemm_time(m, n, k, "NN") < 1.1


def test_measured_table_is_used_near_its_points():
    km = KernelModel(load_profile("h200"), tuning=False)
    t = km.gemm_time(8192, 8192, 8192, "NN")
    assert 2.0 * 8192**3 / t == pytest.approx(790e12, rel=0.01)


def test_attention_and_elementwise():
    p = load_profile("gh200")
    km = KernelModel(p)
    fwd = Op(0, "L0.attn.fwd", "attention", "compute", flops=1e12, bytes=1e6)
    bwd = Op(1, "L0.attn.bwd", "attention", "compute", flops=1e12, bytes=1e6)
    assert km.kernel_time(fwd) == pytest.approx(1e12 / (p.peak_flops * p.attention_fwd_efficiency) + p.launch_s)
    assert km.kernel_time(bwd) > km.kernel_time(fwd)
    ew = Op(2, "L0.gelu.fwd", "elementwise", "compute", flops=1e6, bytes=4e9)
    assert km.kernel_time(ew) == pytest.approx(4e9 / p.hbm_bandwidth + p.launch_s)


def test_one_peak_per_machine():
    """A system and the kernel profile of its GPU state the same peak; a disagreement is refused."""
    import dataclasses

    from topologies.system import list_systems, load_system
    from twin.predict.study import prepare

    for name in list_systems():
        study = prepare(name)
        assert study.profile.peak_flops == pytest.approx(study.system.gpu.peak_flops, rel=1e-6), name
    cpu = load_system("cpu")
    other = dataclasses.replace(cpu, gpu=dataclasses.replace(cpu.gpu, peak_flops=2 * cpu.gpu.peak_flops))
    with pytest.raises(TwinError, match="one machine has one peak"):
        prepare(other)


def test_profile_for_gpu_reads_the_heads_as_the_whole_files_say():
    """profile_for_gpu chooses from each file's top-level keys; the choice equals the loaded files'."""
    for name in list_profiles():
        whole = load_profile(name)
        assert profile_for_gpu(whole.name).name == whole.name
        for alias in whole.gpus:
            assert alias in profile_for_gpu(alias.upper()).gpus
