"""Input data for tfdist: bundled TFDS datasets and their pipelines."""
