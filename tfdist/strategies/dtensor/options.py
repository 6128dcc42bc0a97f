"""The options only `dtensor` reads (no TensorFlow)."""

from __future__ import annotations

from tfdist import sharding
from tfdist.config.options import ENGINE, engine_options, option
from tfdist.errors import ConfigError, UsageError

def _mesh(name, value):
    try:
        sharding.parse_mesh(value)
    except UsageError as error:
        raise ConfigError(str(error)) from None


@engine_options("dtensor")
class DTensorOptions:
    mesh: str = option(
        "batch:1,model:2", check=_mesh, group=ENGINE,
        help="dtensor: the device mesh, batch:B,model:M (B-way data parallel x M-way tensor "
             "sharding; B*M devices, e.g. --virtual_devices=B*M on a CPU host).")
    shard_optimizer_state: bool = option(
        False, group=ENGINE,
        help="dtensor: the older name of --zero_stage=1 (split optimizer slots over the "
             "batch axis); with a higher --zero_stage, which includes it, the higher stage "
             "applies.")

    @property
    def zero(self) -> int:
        """The ZeRO stage in effect (`shard_optimizer_state` is stage 1;
        `zero_stage` is shared with the pipeline engine: `tfdist.config.engine`)."""
        return max(self.zero_stage, 1 if self.shard_optimizer_state else 0)
