"""Two hosts for real: multi_worker across a link that goes down.

Two `tfdist-train --strategy=multi_worker` workers run in two network
namespaces joined by a veth pair (10.231.0.1/24 <-> 10.231.0.2/24), so their
traffic crosses a real (virtual) link with its own addresses, not loopback.
Once the chief has written a checkpoint, one end of the link is set down:

- every worker must end, non-zero, within --collective_timeout_s + MARGIN_S,
  with one `tfdist-train: fault:` line naming the peer it cannot reach;
- with the link back up, the same two commands resume from the last
  checkpoint and finish at exactly --train_steps, the checkpoint steps never
  going backwards.

Needs root and iproute2 (`ip netns`); the module is skipped otherwise. The
namespaces are named after this process (parallel runs do not collide) and
deleted, with the link inside them, however the tests end.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tfdist import checkpointing

import netns

ADDRESSES = ("10.231.0.1", "10.231.0.2")
PORT = 23456                # inside the namespaces: nothing else listens there
# The cut lands at the first checkpoint (step 40); the 160 steps and 4
# checkpoints after it (each save ~0.3-1.5 s) keep the workers mid-run, and
# the resumed run only has those to make (it was 1000 steps, 49 saves: most
# of the module's time; then 200 steps with a save every 20, 9 after the cut).
STEPS = 200
CHECKPOINT_EVERY = 40
COLLECTIVE_TIMEOUT_S = 15
# Time from the cut to a worker's exit: TensorFlow's detection, the fault's
# reachability probe (<= 2 s) and the exit. Measured 5.6-9.7 s on a loaded
# 2-core machine: TF's coordination-service heartbeats notice the dead link
# in about 10 s, before --collective_timeout_s (the same 9 s with 60).
# Asserted: --collective_timeout_s + MARGIN_S.
MARGIN_S = 15
PREFIX = f"tfd{os.getpid()}"  # <= 15-character interface names: tfd<pid>v0

_WHY = netns.why_not(PREFIX)
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]


class Workers(netns.Workers):
    """The two tfdist-train processes of one run (output in files)."""

    def __init__(self, link, directory, model_dir, data_dir):
        self.model_dir, self.data_dir = model_dir, data_dir
        super().__init__(link, directory, [
            "--model=mlp", "--model_width=16", "--model_depth=1",
            "--global_batch_size=32", "--steps_per_loop=10",
            f"--checkpoint_every={CHECKPOINT_EVERY}",
            "--keep_checkpoints=100", f"--train_steps={STEPS}", "--shuffle_buffer=1000",
            f"--data_dir={data_dir}", f"--model_dir={model_dir}",
            f"--collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
            # A cut link, not the step's arithmetic: no XLA compile.
            "--jit_compile=off"], port=PORT)


def _faults(stderr):
    return [line for line in stderr.splitlines() if line.startswith("tfdist-train: fault:")]


@pytest.fixture(scope="module")
def link():
    made = netns.Link(PREFIX, ADDRESSES)
    try:
        made.create()
        yield made
    finally:
        made.delete()


@pytest.fixture(scope="module")
def cut_run(link, prepared_data_dir, tmp_path_factory):
    """Train on both workers, cut the link at the first checkpoint, and
    record how every worker ended (the link stays down)."""
    directory = str(tmp_path_factory.mktemp("netns"))
    workers = Workers(link, directory, os.path.join(directory, "run"), prepared_data_dir)
    try:
        workers.start("cut")
        deadline = time.monotonic() + 150
        while not checkpointing.saved_steps(workers.model_dir):
            assert all(p.poll() is None for p in workers.procs), \
                "a worker ended before the first checkpoint\n" + workers.tails()
            assert time.monotonic() < deadline, "no checkpoint within 150 s\n" + workers.tails()
            time.sleep(0.05)
        link.set(0, "down")
        cut_at = time.monotonic()
        running_at_cut = [p.poll() is None for p in workers.procs]
        steps_at_cut = checkpointing.saved_steps(workers.model_dir)
        ended_after = [None, None]
        limit = COLLECTIVE_TIMEOUT_S + MARGIN_S + 30   # beyond the asserted bound: a hang
        while None in ended_after and time.monotonic() - cut_at < limit:
            for i, proc in enumerate(workers.procs):
                if ended_after[i] is None and proc.poll() is not None:
                    ended_after[i] = time.monotonic() - cut_at
            time.sleep(0.05)
    finally:
        workers.kill()
    return {"workers": workers, "running_at_cut": running_at_cut, "ended_after": ended_after,
            "steps_at_cut": steps_at_cut, "returncodes": [p.returncode for p in workers.procs],
            "steps_after": checkpointing.saved_steps(workers.model_dir)}


@pytest.mark.timeout(240)
def test_cut_link_ends_every_worker_with_a_fault_naming_the_peer(cut_run):
    workers = cut_run["workers"]
    assert all(cut_run["running_at_cut"]), \
        f"training ended before the cut (raise STEPS)\n{workers.tails()}"
    print(f"worker exits after the cut (s): {cut_run['ended_after']}")
    for index, ended_after in enumerate(cut_run["ended_after"]):
        assert ended_after is not None, f"worker {index} hangs after the cut\n{workers.tails()}"
        assert ended_after < COLLECTIVE_TIMEOUT_S + MARGIN_S, workers.tails()
        assert cut_run["returncodes"][index] != 0, workers.tails()
        faults = _faults(workers.text(index, "err"))
        assert len(faults) == 1, workers.tails()
        print(faults[0])
        peer = 1 - index
        me, them = f"worker {index} ({ADDRESSES[index]}:{PORT})", \
            f"worker {peer} ({ADDRESSES[peer]}:{PORT})"
        assert faults[0].startswith(f"tfdist-train: fault: {me}: "), faults[0]
        # Named by the probe after the failed collective, whatever TF's error said.
        assert f"unreachable: {them}: " in faults[0], faults[0]
    # Training stopped where it was: no checkpoint beyond those of the run so far.
    assert cut_run["steps_after"][:len(cut_run["steps_at_cut"])] == cut_run["steps_at_cut"]
    assert cut_run["steps_after"][-1] < STEPS


@pytest.mark.timeout(300)
def test_relinked_workers_resume_and_finish_exactly(cut_run, link):
    before = cut_run["steps_after"]
    assert before and before[-1] < STEPS, cut_run["workers"].tails()
    link.set(0, "up")
    workers = cut_run["workers"]
    seen = [before]
    try:
        workers.start("resume")   # the very same commands
        deadline = time.monotonic() + 200
        while any(p.poll() is None for p in workers.procs):
            assert time.monotonic() < deadline, "the resumed run did not end\n" + workers.tails()
            steps = checkpointing.saved_steps(workers.model_dir)
            if steps != seen[-1]:
                seen.append(steps)
            time.sleep(0.2)
    finally:
        workers.kill()
    seen.append(checkpointing.saved_steps(workers.model_dir))
    assert [p.returncode for p in workers.procs] == [0, 0], workers.tails()
    summary = json.loads(workers.text(0, "out").strip().splitlines()[-1])
    assert summary["steps"] == STEPS and summary["workers"] == 2, summary
    assert f"restored {os.path.join(workers.model_dir, 'checkpoints', f'ckpt-{before[-1]}')}" \
        in workers.text(0, "err"), workers.tails()
    # Never backwards: every listing extends the one before, strictly increasing.
    for earlier, later in zip(seen, seen[1:]):
        assert later[:len(earlier)] == earlier, seen
    final = seen[-1]
    assert final == sorted(set(final)) and final[-1] == STEPS, final
    assert final == list(range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY)), final
