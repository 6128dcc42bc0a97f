"""How gradient compression sees a tensor, without TensorFlow: shared by the
compressions (`training.compression`) and the planner's cost of them
(`strategies.data_parallel_cost`)."""

from __future__ import annotations

import math
from typing import Optional, Sequence


def matrix_shape(shape: Sequence[int]) -> Optional[list]:
    """[n, m] a tensor of 2 or more dimensions is treated as (None for 1-D and
    scalars): its dimensions split in two where the matrix is most nearly
    square (an attention kernel [width, heads, head size] as [width, heads x
    head size]; a convolution [h, w, in, out] as [h x w x in, out]), which
    leaves a low rank the most room."""
    shape = [int(d) for d in shape]
    if len(shape) < 2:
        return None
    splits = [[math.prod(shape[:j]), math.prod(shape[j:])] for j in range(1, len(shape))]
    return max(splits, key=min)
