"""TFDS builders for the datasets tfdist bundles, generated offline.

Importing this package registers every bundled builder with TFDS, so
`tfds.builder(name, data_dir=...)` and `tfds.load(name, ...)` find them.
Each builder writes several files per split (`OfflineBuilder.NUM_SHARDS`)
from a plain `download_and_prepare()`, because input pipelines shard by file.
"""

from tfdist.data.builders import shapes, tokens

BUNDLED = ("tfdist_shapes", "tfdist_tokens")

__all__ = ["BUNDLED", "shapes", "tokens"]
