"""Per-rank log lines: every line says which process wrote it.

In a multi-worker job the logs of all processes end up interleaved (a
terminal, `kubectl logs`, a Slurm output file), so each line carries
`[worker i/n]` (`[rank i/n]` under Horovod), with the chief marked. Only the
chief logs progress by default; `--log_all_ranks` lets every process speak.
Warnings and errors show from every process either way.
"""

from __future__ import annotations

import contextlib
import logging as std_logging

from absl import logging


class _Prefix(std_logging.Filter):
    def __init__(self):
        super().__init__()
        self.prefix = ""

    def filter(self, record: std_logging.LogRecord) -> bool:
        if self.prefix and not getattr(record, "_tfdist_prefixed", False):
            record.msg = f"{self.prefix} {record.msg}"
            record._tfdist_prefixed = True
        return True


_FILTER = _Prefix()


def label(strategy) -> str:
    """e.g. '[worker 1/2]', '[worker 0/2 chief]', '[rank 0/4 chief]'."""
    unit = getattr(strategy, "process_unit", "worker")
    chief = " chief" if strategy.is_chief else ""
    return f"[{unit} {strategy.worker_index}/{strategy.num_workers}{chief}]"


def configure(strategy, *, log_all_ranks: bool) -> None:
    """Prefix this process's log lines with its rank; quiet non-chief INFO."""
    _FILTER.prefix = label(strategy)
    for handler in (logging.get_absl_handler(), *std_logging.getLogger().handlers):
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    if not strategy.is_chief and not log_all_ranks:
        logging.set_verbosity(logging.WARNING)


@contextlib.contextmanager
def quiet_absl():
    """absl INFO off for a block: engines that log their whole set-up there
    (DTensor's server definition and mesh, ParameterServerStrategy's session
    ConfigProto: dozens of lines per process) are described in one line instead."""
    previous = logging.get_verbosity()
    logging.set_verbosity(logging.WARNING)
    try:
        yield
    finally:
        logging.set_verbosity(previous)
