"""The options only `dtensor` reads (no TensorFlow)."""

from __future__ import annotations

from tfdist import sharding
from tfdist.config.options import ENGINE, engine_options, option
from tfdist.errors import ConfigError, UsageError

ZERO_STAGES = (0, 1, 2, 3)


def _zero_stage(name, value):
    if value not in ZERO_STAGES:
        raise ConfigError(f"{name}={value!r} is not a ZeRO stage; valid: "
                          f"{', '.join(map(str, ZERO_STAGES))}")


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
    zero_stage: int = option(
        0, choices=ZERO_STAGES, check=_zero_stage, tunable=ZERO_STAGES, group=ENGINE,
        help="dtensor: what is also split over the mesh's batch axis (ZeRO). 0: nothing "
             "(each variable, gradient and optimizer slot is split by its layout rule only); "
             "1: optimizer slots; 2: slots and gradients (reduce-scattered out of the "
             "backward pass); 3: slots, gradients and the variables themselves, each layer's "
             "gathered just before it computes and again in the backward pass (FSDP; one "
             "more forward pass per step). Per-device bytes of parameters + gradients + "
             "optimizer state fall towards 1/(batch x model) of one device's.")
    shard_optimizer_state: bool = option(
        False, group=ENGINE,
        help="dtensor: the older name of --zero_stage=1 (split optimizer slots over the "
             "batch axis); with a higher --zero_stage, which includes it, the higher stage "
             "applies.")

    @property
    def zero(self) -> int:
        """The ZeRO stage in effect (`shard_optimizer_state` is stage 1)."""
        return max(self.zero_stage, 1 if self.shard_optimizer_state else 0)
