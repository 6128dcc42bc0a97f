"""The base of the bundled builders: generated offline, several files per split."""

import tensorflow_datasets as tfds


class OfflineBuilder(tfds.core.GeneratorBasedBuilder):
    """Generates `SPLIT_SIZES` examples per split locally, into `NUM_SHARDS` files.

    Subclasses define `_info`, `SPLIT_SIZES` and `_generate_examples(split)`.
    (Still abstract, so TFDS does not register this class as a dataset.)
    """

    NUM_SHARDS = 4  # files per split; downstream input pipelines shard by file
    SPLIT_SIZES: dict = {}

    def download_and_prepare(self, *, download_config=None, **kwargs) -> None:
        """As the base method, but writes `NUM_SHARDS` files per split.

        TFDS sizes shards at 64 MiB or more, which would put each split of
        these small datasets in one file. A caller's explicit
        `DownloadConfig(num_shards=...)` still wins.
        """
        config = download_config or tfds.download.DownloadConfig()
        if config.num_shards is None:
            config = config.replace(num_shards=self.NUM_SHARDS)
        super().download_and_prepare(download_config=config, **kwargs)

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {split: self._generate_examples(split) for split in self.SPLIT_SIZES}
