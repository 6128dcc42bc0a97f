"""What a model builder needs to know about a dataset."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Shapes and sizes of one supervised dataset, independent of batching.

    `kind` is "image" for (H, W, C) float inputs with one label per example,
    "tokens" for (T,) integer inputs with one target token per position,
    "text" for (T,) integer token ids of a text (padded with 0) with one label
    per example. `vocab_size` (text only) is the number of token ids, padding
    and out-of-vocabulary included.
    """

    name: str
    kind: str
    input_shape: tuple
    num_classes: int
    train_examples: Optional[int] = None
    eval_examples: Optional[int] = None
    vocab_size: Optional[int] = None
