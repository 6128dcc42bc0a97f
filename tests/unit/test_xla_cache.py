"""XLA executables shared by this host's processes (tfdist/training/xla_cache.py):
where a process points TensorFlow, what it shares, what it removes."""

import os
import subprocess

import pytest

from tfdist.observe import hardware
from tfdist.training import xla_cache

FLAG = "--tf_xla_persistent_cache_directory="


def _unconfigured(monkeypatch):
    """This process as before `configure` (both names restored after the test)."""
    monkeypatch.setattr(xla_cache, "_configured", False)
    monkeypatch.setattr(xla_cache, "_cache", None)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not configured its cache yet, with its own cache root."""
    _unconfigured(monkeypatch)
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TFDIST_XLA_CACHE", "1")   # on whatever the CPU (the default: below)
    monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_auto_jit=0")
    monkeypatch.setattr(xla_cache.atexit, "register", lambda f: None)
    return tmp_path


def _directory(flags):
    return [f for f in flags.split() if f.startswith(FLAG)][-1][len(FLAG):]


def test_a_process_compiles_into_its_own_directory_beside_the_shared_one(fresh):
    xla_cache.configure()
    flags = os.environ["TF_XLA_FLAGS"]
    private = _directory(flags)
    assert "--tf_xla_auto_jit=0" in flags.split()
    assert os.path.dirname(private) == xla_cache.shared_dir()
    assert xla_cache.shared_dir().startswith(str(fresh / "xla"))
    assert os.path.basename(private).startswith(f"tfdist-xla-{os.uname().nodename}-{os.getpid()}-")
    assert os.listdir(private) == []   # made (TensorFlow fails where it cannot write), empty


def test_no_sharing_where_tensorflow_could_not_write(fresh, monkeypatch):
    """A disk without room, or a cache folder that cannot be made: the flag
    is not set (TensorFlow would fail the step). The control: with room, set."""
    monkeypatch.setattr(xla_cache, "MIN_FREE_BYTES", 2**62)
    xla_cache.configure()
    assert os.environ["TF_XLA_FLAGS"] == "--tf_xla_auto_jit=0" and xla_cache.start() is None
    assert not [n for n in os.listdir(xla_cache.shared_dir()) if n.startswith("tfdist-xla-")]
    _unconfigured(monkeypatch)
    monkeypatch.setenv("TFDIST_CACHE_DIR", "/proc/no-such-folder")
    xla_cache.configure()
    assert os.environ["TF_XLA_FLAGS"] == "--tf_xla_auto_jit=0"
    _unconfigured(monkeypatch)
    monkeypatch.setattr(xla_cache, "MIN_FREE_BYTES", 0)
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(fresh))
    xla_cache.configure()
    assert FLAG in os.environ["TF_XLA_FLAGS"]


def test_a_step_failing_to_write_its_executable_is_named(fresh):
    xla_cache.configure()
    private = xla_cache.start().private
    reason = xla_cache.caused(OSError(f"{private}/xla_compile_cache__1__2.pb; No space left"))
    assert reason.startswith("TensorFlow could not write a compiled XLA executable to " + private)
    assert "TFDIST_XLA_CACHE=0" in reason
    assert xla_cache.caused(OSError("/data/model_dir: No space left")) is None   # the control


def test_a_parents_directory_is_replaced_and_the_users_own_is_kept(fresh, monkeypatch):
    inherited = os.path.join(str(fresh), "xla", "k", "tfdist-xla-host-1-ab")
    monkeypatch.setenv("TF_XLA_FLAGS", FLAG + inherited)
    xla_cache.configure()
    assert _directory(os.environ["TF_XLA_FLAGS"]) not in ("", inherited)
    assert os.environ["TF_XLA_FLAGS"].count(FLAG) == 1
    # The user's own cache, and sharing turned off: left alone (the controls).
    for env in ({"TF_XLA_FLAGS": FLAG + "/data/my-xla"},
                {"TF_XLA_FLAGS": "", "TFDIST_XLA_CACHE": "0"}):
        _unconfigured(monkeypatch)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        xla_cache.configure()
        assert os.environ["TF_XLA_FLAGS"] == env["TF_XLA_FLAGS"]
        assert xla_cache.start() is None


def test_the_shared_directory_is_one_per_cpu_and_xla_setting(fresh, monkeypatch):
    first = xla_cache.shared_dir()
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Other CPU", frozenset({"avx2"})))
    assert xla_cache.shared_dir() != first
    monkeypatch.undo()
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(fresh))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    assert xla_cache.shared_dir() != first


def test_a_run_links_the_shared_entries_and_publishes_only_what_it_compiled(fresh):
    shared = xla_cache.shared_dir()
    os.makedirs(shared)
    xla_cache.configure()
    with open(os.path.join(shared, "a.pb"), "wb") as f:
        f.write(b"old")
    cache = xla_cache.start()
    assert os.path.samefile(os.path.join(cache.private, "a.pb"), os.path.join(shared, "a.pb"))
    with open(os.path.join(cache.private, "b.pb"), "wb") as f:   # as TensorFlow writes one
        f.write(b"new")
    assert cache.publish() == 1 and cache.publish() == 0
    assert sorted(xla_cache._entries(shared)) == ["a.pb", "b.pb"]
    assert open(os.path.join(shared, "b.pb"), "rb").read() == b"new"
    assert not [n for n in os.listdir(shared) if n.startswith(".tmp-")]
    cache.close()
    assert not os.path.exists(cache.private)


def test_prune_removes_the_oldest_entries_over_the_limit(tmp_path):
    for i, name in enumerate(["old.pb", "mid.pb", "new.pb"]):
        (tmp_path / name).write_bytes(b"x" * 100)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    xla_cache.prune(str(tmp_path), max_bytes=250)
    assert sorted(os.listdir(tmp_path)) == ["mid.pb", "new.pb"]
    xla_cache.prune(str(tmp_path), max_bytes=250)   # the control: within the limit, kept
    assert sorted(os.listdir(tmp_path)) == ["mid.pb", "new.pb"]


def test_the_directories_of_ended_processes_are_removed(fresh):
    xla_cache.configure()
    shared = xla_cache.shared_dir()
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead = os.path.join(shared, f"{xla_cache._private_prefix(ended.pid)}x")
    alive = os.path.join(shared, f"{xla_cache._private_prefix(os.getppid())}x")
    other_host = os.path.join(shared, f"tfdist-xla-elsewhere-{ended.pid}-x")
    for directory in (dead, alive, other_host):
        os.makedirs(directory)
    xla_cache.start()
    assert not os.path.exists(dead)
    assert os.path.exists(alive) and os.path.exists(other_host)


def test_entries_are_copied_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    (tmp_path / "a.pb").write_bytes(b"entry")

    def no_links(source, destination):
        raise PermissionError("hard links not supported")

    monkeypatch.setattr(xla_cache.os, "link", no_links)
    assert xla_cache._place(str(tmp_path / "a.pb"), str(tmp_path / "b.pb"))
    assert (tmp_path / "b.pb").read_bytes() == b"entry"
    assert not os.path.samefile(tmp_path / "a.pb", tmp_path / "b.pb")
    assert not xla_cache._place(str(tmp_path / "gone.pb"), str(tmp_path / "c.pb"))
    assert not (tmp_path / "c.pb").exists()


def test_sharing_is_on_by_default_only_where_xla_loads_executables_silently(monkeypatch):
    """XLA logs two false errors per executable it loads on CPUs with
    AVX-512: sharing is on by default without it, and as the variable says."""
    monkeypatch.delenv("TFDIST_XLA_CACHE", raising=False)
    for flags, on in ((["avx2", "fma"], True), (["avx2", "avx512f", "avx512_bf16"], False)):
        monkeypatch.setattr(xla_cache.hardware, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert xla_cache.enabled() is on
        for setting in ("0", "1"):
            monkeypatch.setenv("TFDIST_XLA_CACHE", setting)
            assert xla_cache.enabled() is (setting == "1")
        monkeypatch.delenv("TFDIST_XLA_CACHE")
