"""What machine a figure came from: CPU model, cores, and the ISA features
that decide TensorFlow's CPU speed (AVX2, AVX-512, AVX-512 BF16, AMX).

The machines this project runs on differ: on an AVX2-only CPU bfloat16 is
emulated (slower than float32); with AVX-512 BF16 or AMX-BF16 oneDNN runs
bf16 matmuls natively (AMX ~4x float32). Every throughput figure tfdist
prints (start-up log, run summary, benchmarks) carries this description.
Pure Python (reads /proc/cpuinfo), no TensorFlow.
"""

from __future__ import annotations

import functools
import os
import platform

# /proc/cpuinfo flag -> the name users know, in the order they are shown.
_FEATURES = (
    ("avx2", "AVX2"),
    ("fma", "FMA"),
    ("avx512f", "AVX-512"),
    ("avx512_bf16", "AVX512-BF16"),
    ("avx512_fp16", "AVX512-FP16"),
    ("amx_bf16", "AMX-BF16"),
    ("amx_fp16", "AMX-FP16"),
)


def cache_dir() -> str:
    """Where tfdist keeps what it learned on this host (the measured peak, the
    planner's runtimes and plans, shared XLA executables): `$TFDIST_CACHE_DIR`,
    else `~/.cache/tfdist`."""
    return os.environ.get("TFDIST_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tfdist")


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> tuple[str, frozenset]:
    """(model, ISA flags) of the first CPU in /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            model, flags = parse_cpuinfo(f.read())
    except OSError:
        model, flags = "", frozenset()
    return model or platform.processor() or platform.machine(), flags


def parse_cpuinfo(text: str) -> tuple[str, frozenset]:
    """(model, ISA flags) of the first CPU of a /proc/cpuinfo text. The model
    is its name with the family and model numbers where the file gives them:
    a virtual machine's name is often only "AMD EPYC" or "Intel(R) Xeon(R)
    Processor", the same for generations years apart."""
    fields, flags = {}, frozenset()
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        elif key in ("model name", "cpu family", "model") and key not in fields:
            fields[key] = value
    name = fields.get("model name", "")
    if name and fields.get("cpu family") and fields.get("model"):
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name, flags


def cpu_model() -> str:
    return _cpuinfo()[0] or "unknown CPU"


def cpu_flags() -> frozenset:
    """Every ISA flag /proc/cpuinfo lists for this CPU."""
    return _cpuinfo()[1]


@functools.lru_cache(maxsize=None)
def cpu_vendor() -> str:
    """'AMD', 'Intel' or '' (another or unknown), from /proc/cpuinfo's vendor_id."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "vendor_id":
                    return {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(value, "")
    except OSError:
        pass
    return ""


def isa_features() -> list[str]:
    """The relevant ISA features this CPU has, e.g. ["AVX2", "FMA", "AVX-512"]."""
    flags = _cpuinfo()[1]
    return [name for flag, name in _FEATURES if flag in flags]


def isa_limit() -> str | None:
    """oneDNN's ISA cap if the user set one (ONEDNN_MAX_CPU_ISA, e.g. AVX2)."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below AVX-512. Under one of them on a
# CPU with AVX-512, TensorFlow (2.21) still routes bfloat16 matmuls to
# oneDNN, as it decides from the CPU's own flags, and oneDNN, capped, cannot
# create the primitive: the process aborts ("could not create a primitive
# descriptor for the matmul primitive"). On a CPU without AVX-512 TensorFlow
# takes its own bfloat16 kernels and nothing aborts.
_CAPS_BELOW_AVX512 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")


def bf16_refusal() -> str | None:
    """Why bfloat16 matmuls would abort this process, or None."""
    limit = (isa_limit() or "").upper()
    if limit not in _CAPS_BELOW_AVX512 or "AVX-512" not in isa_features():
        return None
    return (f"ONEDNN_MAX_CPU_ISA={limit} on this AVX-512 CPU aborts TensorFlow's bfloat16 "
            "matmuls (TensorFlow picks oneDNN's bf16 kernel from the CPU, which the cap "
            "forbids); unset the cap, or use --precision=float32")


def bf16_support() -> str:
    """How bfloat16 matmuls run here: 'AMX', 'AVX-512', or 'emulated'."""
    features = isa_features()
    limit = (isa_limit() or "").upper()
    if limit and not (limit.startswith("AVX512") or "AMX" in limit or limit == "ALL"):
        return "emulated"
    if "AMX-BF16" in features and (not limit or "AMX" in limit or limit == "ALL"):
        return "AMX"
    if "AVX512-BF16" in features:
        return "AVX-512"
    return "emulated"


def describe() -> str:
    """One line, e.g. 'Intel Xeon ... x2 cores; AVX2 FMA AVX-512 AMX-BF16; bf16: AMX'."""
    features = " ".join(isa_features()) or "no AVX2"
    limit = isa_limit()
    capped = f" (oneDNN capped at {limit})" if limit else ""
    return (f"{cpu_model()} x{os.cpu_count()} cores; {features}{capped}; "
            f"bf16 matmuls: {bf16_support()}")


def as_dict() -> dict:
    """For the run summary and benchmark reports."""
    return {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "isa": isa_features(),
            "isa_limit": isa_limit(), "bf16": bf16_support()}


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc/self/statm), or 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_limit_bytes() -> int:
    """The memory this process may use: its `tfdist-launch --worker_memory`
    cap (TFDIST_WORKER_MEMORY), else its memory cgroup's limit (v2
    memory.max, v1 memory.limit_in_bytes), else the machine's memory."""
    cap = os.environ.get("TFDIST_WORKER_MEMORY", "")
    if cap.isdigit():
        return int(cap)
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    candidate = f"/sys/fs/cgroup{path}/memory.max"
                elif "memory" in controllers.split(","):
                    candidate = f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"
                else:
                    continue
                try:
                    with open(candidate) as limit:
                        text = limit.read().strip()
                    if text.isdigit():
                        limits.append(int(text))
                except OSError:
                    pass
    except OSError:
        pass
    return min(limits)
