"""The hardware line printed with every figure: CPU model and ISA features."""

from tfdist.observe import hardware


def _fake_cpu(monkeypatch, flags, limit=None):
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Test CPU 9000", frozenset(flags)))
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    if limit:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)


def test_avx2_only_cpu_emulates_bf16(monkeypatch):
    _fake_cpu(monkeypatch, ["sse4_2", "avx", "avx2", "fma"])
    assert hardware.isa_features() == ["AVX2", "FMA"]
    assert hardware.bf16_support() == "emulated"
    assert hardware.describe().startswith("Test CPU 9000 x")
    assert "AVX2 FMA;" in hardware.describe()


def test_amx_cpu_runs_bf16_on_amx_unless_onednn_is_capped(monkeypatch):
    flags = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    _fake_cpu(monkeypatch, flags)
    assert hardware.isa_features() == ["AVX2", "FMA", "AVX-512", "AVX512-BF16", "AMX-BF16"]
    assert hardware.bf16_support() == "AMX"
    _fake_cpu(monkeypatch, flags, limit="AVX2")
    assert hardware.bf16_support() == "emulated"
    assert "oneDNN capped at AVX2" in hardware.describe()
    _fake_cpu(monkeypatch, flags, limit="AVX512_CORE_BF16")
    assert hardware.bf16_support() == "AVX-512"


def test_the_model_names_its_family_and_model_where_the_name_is_generic():
    """Two generations of "AMD EPYC" differ by family and model, which every
    figure's hardware line then carries."""
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n\n"
            "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n")
    assert hardware.parse_cpuinfo(text) == ("AMD EPYC (family 26 model 2)",
                                            frozenset({"fpu", "avx2", "avx512f"}))
    # An ARM /proc/cpuinfo: no model name or family, "Features" for flags.
    assert hardware.parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd\n") == (
        "", frozenset({"fp", "asimd"}))


def test_this_machine_is_described():
    info = hardware.as_dict()
    assert info["cpu"] and info["cpu_cores"] >= 1
    assert info["bf16"] in ("AMX", "AVX-512", "emulated")


def test_bf16_under_a_onednn_cap_below_avx512_is_refused_where_it_would_abort(monkeypatch):
    """On an AVX-512 CPU, TensorFlow routes bf16 matmuls to oneDNN, which a cap
    below AVX-512 forbids (the process aborts: checked by hand on TF 2.21);
    caps at AVX-512 and CPUs without it (TensorFlow's own kernels) are fine."""
    import pytest
    from tfdist.errors import UsageError
    from tfdist.observe import peak
    avx512 = ["avx2", "fma", "avx512f", "avx512_bf16"]
    _fake_cpu(monkeypatch, avx512)
    assert hardware.bf16_refusal() is None                      # the control: no cap
    for limit in ("AVX512_CORE", "AVX512_CORE_BF16", "ALL"):
        _fake_cpu(monkeypatch, avx512, limit=limit)
        assert hardware.bf16_refusal() is None, limit
    _fake_cpu(monkeypatch, ["avx2", "fma"], limit="AVX2")
    assert hardware.bf16_refusal() is None                      # no AVX-512: TF's kernels
    _fake_cpu(monkeypatch, avx512, limit="avx2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in hardware.bf16_refusal()
    with pytest.raises(UsageError, match="ONEDNN_MAX_CPU_ISA=AVX2"):
        peak.matmul_peak_tflops("bfloat16", refresh=True)        # never probed: it would abort
