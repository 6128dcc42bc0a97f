"""What an engine declares about itself without TensorFlow: `Engine`.

Each engine is one `Engine` record: its name, its adapter (imported only when
chosen), a one-line summary, how its processes start and what cluster it
needs. The `--strategy` help, the engine table of the docs, the cluster
checks that run before TensorFlow loads, `tfdist-compare`'s launchers and the
house rules all read these records (`tfdist.strategies.engines()`); what an
engine can do once running is declared by its adapter class through the
capability interfaces (`capabilities.py`).

An engine outside tfdist declares an `Engine` in a module of its own
(importing no TensorFlow) and names it in its package's entry points:

    [options.entry_points]
    tfdist.engines =
        toy = toy_engine:ENGINE
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from typing import Callable, Optional, Union

from tfdist.errors import UsageError

ENTRY_POINT_GROUP = "tfdist.engines"
# How an engine's processes start.
ONE_PROCESS = "one process"            # the local devices of one process
WORKERS = "workers"                    # a TF_CONFIG cluster (tfdist-launch --workers=N, Slurm)
ONE_OR_WORKERS = "one process or workers"
HOROVODRUN = "horovodrun"              # horovodrun -np N
PS_CLUSTER = "workers and parameter servers"   # tfdist-launch --workers=N --ps=P
LAUNCHES = (ONE_PROCESS, WORKERS, ONE_OR_WORKERS, HOROVODRUN, PS_CLUSTER)


@dataclasses.dataclass(frozen=True)
class Engine:
    """An engine's declaration (see the module docstring)."""

    name: str
    adapter: Union[str, type]   # "package.module:Class", or the class itself
    summary: str                # one line: what it is, for help and the docs
    launch: str = ONE_PROCESS   # one of LAUNCHES
    synchronous: bool = True    # every replica applies the same update each step
    # A plain-Python check of the cluster (config, environ) -> None or
    # UsageError, run before TensorFlow loads; None: no cluster to check.
    cluster: Optional[Callable] = None
    processes: int = 1          # processes a comparison or an example starts by default
    # Its cost model for the planner, "package.module:OBJECT" (see
    # `tfdist.planner.costs`), imported only when planning; None: the
    # planner never proposes the engine.
    cost: Optional[str] = None

    def __post_init__(self):
        if self.launch not in LAUNCHES:
            raise ValueError(f"engine {self.name!r}: launch={self.launch!r} is not one of "
                             f"{LAUNCHES}")


_COMMANDS = {
    ONE_PROCESS: "tfdist-train --strategy={name}",
    WORKERS: "one process per worker with TF_CONFIG; here: tfdist-launch --workers=N -- "
             "tfdist-train --strategy={name}",
    ONE_OR_WORKERS: "tfdist-train --strategy={name}; across processes: tfdist-launch "
                    "--workers=N -- tfdist-train --strategy={name}",
    HOROVODRUN: "horovodrun -np N --gloo tfdist-train --strategy={name}",
    PS_CLUSTER: "a chief, workers and parameter servers with TF_CONFIG; here: tfdist-launch "
                "--workers=N --ps=P -- tfdist-train --strategy={name}",
}


def command(engine: Engine) -> str:
    """How a user starts `engine` (for the docs)."""
    return _COMMANDS[engine.launch].format(name=engine.name)


def local_launcher(launch: str, processes: int) -> list:
    """The command words before a process's own that start `processes`
    processes on this host the way `launch` says ([] for one process)."""
    if processes <= 1 or launch == ONE_PROCESS:
        return []
    if launch == HOROVODRUN:
        return ["horovodrun", "-np", str(processes), "-H", f"localhost:{processes}", "--gloo"]
    ps = ["--ps=1"] if launch == PS_CLUSTER else []
    return ["tfdist-launch", f"--workers={processes}", *ps, "--"]


def executable(name: str, remedy: str) -> str:
    """The path of the console script `name` (a launcher of `local_launcher`,
    `tfdist-train`): this environment's, beside its Python, else the PATH's.
    A `UsageError` saying `remedy` where there is none."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    found = here if os.access(here, os.X_OK) else shutil.which(name)
    if not found:
        raise UsageError(f"cannot find {name} next to {sys.executable} or on PATH; {remedy}")
    return found


def local_command(engine: Engine, processes: int, arguments: str) -> str:
    """The command starting `engine` with `processes` processes on this host
    for tfdist-train `arguments` (e.g. a plan's --flagfile)."""
    return " ".join([*local_launcher(engine.launch, processes), f"tfdist-train {arguments}"])


def of(name: str, entry) -> Engine:
    """`entry` as an Engine: a record, or an adapter (class or "module:Class")
    registered on its own (its summary the first line of its docstring)."""
    if isinstance(entry, Engine):
        return entry
    doc = "" if isinstance(entry, str) else (entry.__doc__ or "").strip().splitlines()
    return Engine(name=name, adapter=entry, summary=doc[0] if doc else "")
