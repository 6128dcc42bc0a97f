"""Slurm: each task's cluster from Slurm's variables (tfdist/slurm.py), fed
synthetic SLURM_* environments (jobs on a real one-node Slurm:
tests/integration/test_slurm_runs.py)."""

import json
import socket

import pytest
from hypothesis import given, settings, strategies as st

from tfdist import cluster, slurm
from tfdist.errors import UsageError
from tfdist.strategies.horovod import engine as horovod_strategy

from conftest import free_port


def step_env(rank, *, nodes="node[9-10]", tasks_per_node="2(x2)", job=41, step=0, **changes):
    """The SLURM_* variables srun gives task `rank` of a step (block
    distribution); `changes` replace some (None: unset)."""
    counts = slurm.expand_tasks_per_node(tasks_per_node)
    node, local = slurm.block_placement(rank, counts)
    env = {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step), "SLURM_PROCID": str(rank),
           "SLURM_STEP_NUM_TASKS": str(sum(counts)), "SLURM_NTASKS": str(sum(counts)),
           "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes,
           "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_TASKS_PER_NODE": tasks_per_node,
           "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local), **changes}
    return {name: value for name, value in env.items() if value is not None}


# -- Slurm's notations ------------------------------------------------------------
@pytest.mark.parametrize("text, hosts", [
    ("node[9-10]", ["node9", "node10"]),                        # Slurm's order, not sorted
    ("n[01-03,7],gpu5", ["n01", "n02", "n03", "n7", "gpu5"]),   # zero padding kept
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("vm", ["vm"]),
    ("a[1-2]b,c", ["a1b", "a2b", "c"]),
])
def test_host_lists_expand_in_slurms_order(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


def test_tasks_per_node_expand():
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_tasks_per_node("1") == [1]


# -- the cluster every task builds --------------------------------------------------
def test_every_task_builds_the_same_cluster_in_slurms_rank_order():
    """node[9-10], 2 tasks each: ranks 0-1 on node9, 2-3 on node10 (TensorFlow's
    resolver sorts node10 first); each task is the worker SLURM_PROCID says."""
    tasks = [slurm.task_from_environ(step_env(rank)) for rank in range(4)]
    addresses = tasks[0].addresses
    base = tasks[0].port_base
    assert addresses == [f"node9:{base}", f"node9:{base + 1}",
                         f"node10:{base}", f"node10:{base + 1}"]
    for rank, task in enumerate(tasks):
        assert task.addresses == addresses
        config = json.loads(task.tf_config())
        assert config == {"cluster": {"worker": addresses},
                          "task": {"type": "worker", "index": rank}}


def test_uneven_tasks_per_node():
    env = step_env(4, nodes="n[01-03]", tasks_per_node="2(x2),1")
    task = slurm.task_from_environ(env)
    assert [a.rpartition(":")[0] for a in task.addresses] == ["n01", "n01", "n02", "n02", "n03"]
    assert task.address == f"n03:{task.port_base}"


def _ports(job, step=0, rank=0, **changes):
    task = slurm.task_from_environ(step_env(rank, job=job, step=step, **changes))
    return {int(a.rpartition(":")[2]) for a in task.addresses}


def test_two_jobs_on_one_node_get_different_ports():
    assert _ports(41).isdisjoint(_ports(42))
    assert _ports(41, step=0).isdisjoint(_ports(41, step=1))    # two steps of one job
    # No two of 375 consecutive job ids share a window (up to 16 tasks a node).
    windows = {min(_ports(job)) for job in range(1000, 1375)}
    assert len(windows) == 375
    assert all(slurm.PORT_LOW <= port < slurm.PORT_HIGH < 32768 for port in windows)


def test_port_base_can_be_chosen():
    assert _ports(41, TFDIST_SLURM_PORT_BASE="30000") == {30000, 30001}


def test_one_task_is_a_one_worker_cluster():
    task = slurm.task_from_environ(step_env(0, nodes="vm", tasks_per_node="1"))
    assert len(task.addresses) == 1 and task.rank == 0
    # The batch script itself (no srun) of a one-task job: the same.
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
             "SLURM_JOB_NODELIST": "vm", "SLURM_NODEID": "0"}
    assert slurm.task_from_environ(batch).addresses == [f"vm:{slurm.task_from_environ(batch).port_base}"]
    with pytest.raises(UsageError, match=r"SLURM_NTASKS=2.*start it with srun"):
        slurm.task_from_environ({**batch, "SLURM_NTASKS": "2"})


def test_outside_slurm_there_is_no_slurm_cluster():
    assert slurm.task_from_environ({}) is None
    assert cluster.resolve(environ={}) is None


def test_cyclic_distribution_is_refused_naming_the_variables():
    # Under --distribution=cyclic rank 1 is on node 1, local 0; block puts it on node 0.
    env = step_env(1, SLURM_NODEID="1", SLURM_LOCALID="0", SLURM_DISTRIBUTION="cyclic")
    with pytest.raises(UsageError) as error:
        slurm.task_from_environ(env)
    message = str(error.value)
    assert "\n" not in message
    for part in ("SLURM_PROCID=1", "SLURM_NODEID=1", "SLURM_LOCALID=0",
                 "SLURM_DISTRIBUTION='cyclic'", "--distribution=block"):
        assert part in message


MALFORMED = [
    ({"SLURM_STEP_NODELIST": "node[9-"}, "SLURM_STEP_NODELIST", "never closed"),
    ({"SLURM_STEP_NODELIST": "node]9"}, "SLURM_STEP_NODELIST", "unbalanced"),
    ({"SLURM_STEP_NODELIST": "node[10-9]"}, "SLURM_STEP_NODELIST", "empty"),
    ({"SLURM_STEP_NODELIST": "node[a-b]"}, "SLURM_STEP_NODELIST", "bad range"),
    ({"SLURM_STEP_NODELIST": "node9,,node10"}, "SLURM_STEP_NODELIST", "bad host entry"),
    ({"SLURM_STEP_NODELIST": "node9,node9"}, "SLURM_STEP_NODELIST", "more than once"),
    ({"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST", "bad host entry"),
    ({"SLURM_STEP_NODELIST": "node[9-11]"}, "SLURM_STEP_TASKS_PER_NODE", "must match"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, "SLURM_STEP_NODELIST",
     "is not set"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE", "bad entry"),
    ({"SLURM_STEP_TASKS_PER_NODE": "0,4"}, "SLURM_STEP_TASKS_PER_NODE", "bad entry"),
    ({"SLURM_STEP_TASKS_PER_NODE": "two"}, "SLURM_STEP_TASKS_PER_NODE", "bad entry"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,2"}, "SLURM_STEP_NUM_TASKS", "must match"),
    ({"SLURM_STEP_NUM_TASKS": "four"}, "SLURM_STEP_NUM_TASKS", "whole number"),
    ({"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS", "whole number"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID", "whole number"),
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID", "out of range"),
    ({"SLURM_NODEID": "one"}, "SLURM_NODEID", "whole number"),
    ({"SLURM_NODEID": None}, "SLURM_NODEID", "is not set"),
    ({"SLURM_LOCALID": "1.5"}, "SLURM_LOCALID", "whole number"),
    ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID", "whole number"),
    ({"SLURM_STEP_ID": "batch"}, "SLURM_STEP_ID", "whole number"),
    ({"TFDIST_SLURM_PORT_BASE": "http"}, "TFDIST_SLURM_PORT_BASE", "whole number"),
    ({"TFDIST_SLURM_PORT_BASE": "0"}, "TFDIST_SLURM_PORT_BASE", "whole number"),
    ({"TFDIST_SLURM_PORT_BASE": "65535"}, "TFDIST_SLURM_PORT_BASE", "beyond 65535"),
]


@pytest.mark.parametrize("changes, variable, problem", MALFORMED,
                         ids=[f"{v}-{c}" for c, v, _ in MALFORMED])
def test_a_malformed_variable_is_one_line_naming_it(changes, variable, problem):
    with pytest.raises(UsageError) as error:
        slurm.task_from_environ(step_env(1, **changes))
    message = str(error.value)
    assert "\n" not in message and variable in message and problem in message, message


STEP_VARIABLES = sorted(step_env(1)) + ["TFDIST_SLURM_PORT_BASE", "SLURM_DISTRIBUTION"]
SLURM_LIKE = st.text(alphabet="node0123456789[]-,()x \n", max_size=24)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STEP_VARIABLES), SLURM_LIKE | st.text(max_size=16))
def test_any_value_is_a_cluster_or_one_line_naming_the_variable(variable, value):
    """Fuzzed: whatever one variable holds, the result is a consistent cluster
    or a UsageError on one line that names that variable; never a traceback."""
    try:
        task = slurm.task_from_environ(step_env(1, **{variable: value}))
    except UsageError as error:
        assert "\n" not in str(error) and variable in str(error), str(error)
        return
    assert len(set(task.addresses)) == len(task.addresses) == task.num_tasks
    assert task.address == task.addresses[task.rank]
    assert all(0 < int(a.rpartition(":")[2]) < 65536 for a in task.addresses)


# -- the hook in cluster.resolve ------------------------------------------------------

def test_resolve_writes_the_slurm_cluster_to_tf_config():
    port = free_port()   # rank 1 listens on base + 1
    env = step_env(1, nodes="localhost", tasks_per_node="2", TFDIST_SLURM_PORT_BASE=str(port - 1))
    spec = cluster.resolve(environ=env)
    assert (spec.num_workers, spec.worker_index, spec.address) == (2, 1, f"localhost:{port}")
    assert json.loads(env["TF_CONFIG"])["cluster"]["worker"] == [f"localhost:{port - 1}",
                                                               f"localhost:{port}"]
    # TF_CONFIG, once set (by the user or a launcher), wins over Slurm.
    mine = {"cluster": {"worker": ["localhost:1234"]}, "task": {"type": "worker", "index": 0}}
    assert cluster.resolve(environ={**env, "TF_CONFIG": json.dumps(mine)}).num_workers == 1


def test_a_port_in_use_is_named_before_tensorflow_starts():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = step_env(0, nodes="localhost", tasks_per_node="2",
                       TFDIST_SLURM_PORT_BASE=str(port))
        with pytest.raises(UsageError, match=rf"port {port} is in use.*TFDIST_SLURM_PORT_BASE"):
            cluster.resolve(environ=env)
    assert "TF_CONFIG" not in env


def test_a_node_name_that_is_not_this_machine_is_named():
    env = step_env(0, nodes="192.0.2.1", tasks_per_node="1")   # TEST-NET-1, never local
    with pytest.raises(UsageError, match=r"node name '192.0.2.1' is not an address of this"):
        cluster.resolve(environ=env)


# -- Horovod under srun without horovodrun --------------------------------------------
class FakeHorovod:
    def __init__(self, *, mpi=False, size=1):
        self.mpi, self._size, self.shut_down = mpi, size, False

    def mpi_built(self):
        return self.mpi

    def size(self):
        return self._size

    def shutdown(self):
        self.shut_down = True


def test_horovod_split_by_srun_is_a_usage_error_naming_horovodrun():
    env = step_env(0, tasks_per_node="1(x2)")
    check = horovod_strategy._check_not_split_by_srun
    with pytest.raises(UsageError) as error:
        check(FakeHorovod(mpi=False), env, initialised=False)   # before hvd.init
    message = str(error.value)
    assert "\n" not in message
    for part in ("SLURM_STEP_NUM_TASKS=2", "horovodrun -np 2 -H node9:1,node10:1",
                 "--strategy=multi_worker"):
        assert part in message
    # With MPI, judged after init by the ranks MPI found.
    check(FakeHorovod(mpi=True), env, initialised=False)
    alone = FakeHorovod(mpi=True, size=1)
    with pytest.raises(UsageError, match="sees 1 rank"):
        check(alone, env, initialised=True)
    assert alone.shut_down
    check(FakeHorovod(mpi=True, size=2), env, initialised=True)


@pytest.mark.parametrize("env", [
    {},                                                        # not Slurm
    step_env(0, nodes="vm", tasks_per_node="1"),               # one task
    {**step_env(0, tasks_per_node="1(x2)"), "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"},
    {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},   # the batch script
], ids=["no-slurm", "one-task", "horovodrun", "batch-script"])
def test_horovod_is_left_alone_when_it_is_not_split(env):
    horovod_strategy._check_not_split_by_srun(FakeHorovod(), env, initialised=False)
    horovod_strategy._check_not_split_by_srun(FakeHorovod(), env, initialised=True)


# -- a real one-node Slurm (integration) ------------------------------------------------
