"""TF_CONFIG, composed in one place for tfdist (`cluster.py` from host lists,
`slurm.py` from a Slurm job step). `tfdist-launch` composes its own
(`launch/tfdist_launch/cluster_spec.py`): it runs without tfdist installed."""

from __future__ import annotations

import json


def compose(cluster: dict, task_type: str, index: int) -> str:
    """The TF_CONFIG JSON of task `task_type` `index` in `cluster` ({type: [host:port]})."""
    return json.dumps({"cluster": {kind: list(hosts) for kind, hosts in cluster.items()},
                       "task": {"type": task_type, "index": index}})
