"""Small TFDS builders in the feature layouts of real catalog datasets, made offline.

Importing this module registers them with TFDS (in this process only: a fresh
`tfdist-train` process cannot import them, so it reads their prepared files,
as it would a dataset built on another machine and copied over).

- `tfdist_test_mnist`: exactly `mnist`'s layout: {"image": Image((28, 28, 1)),
  "label": ClassLabel(10)}, supervised ("image", "label"), train/test. Digits
  are drawn as seven-segment figures near the centre at a random size, stroke and brightness,
  plus noise: learnable by an MLP in ~100 steps.
- `tfdist_test_imdb`: exactly `imdb_reviews`' layout: {"text": Text(),
  "label": ClassLabel(["neg", "pos"])}, supervised ("text", "label"),
  train/test. Reviews mix filler words with words of their sentiment.
- `tfdist_test_validation`: mnist's layout, but train/validation splits.
- `tfdist_test_train_only`: mnist's layout, only a train split.
- `tfdist_test_varied`: RGB images of differing sizes (Image((None, None, 3))).
- `tfdist_test_unsupervised`: images without supervised_keys.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

SIZES = {"train": 600, "test": 200}

# Seven-segment digits: segments a (top), b (top right), c (bottom right),
# d (bottom), e (bottom left), f (top left), g (middle).
_SEGMENTS = {0: "abcdef", 1: "bc", 2: "abged", 3: "abgcd", 4: "fgbc", 5: "afgcd",
             6: "afgedc", 7: "abc", 8: "abcdefg", 9: "abcdfg"}


def draw_digits(rng: np.random.Generator, labels: np.ndarray, size: int = 28) -> np.ndarray:
    """uint8 (n, size, size, 1) seven-segment images of `labels`."""
    images = np.zeros((len(labels), size, size), np.float32)
    for i, label in enumerate(labels):
        width, height = rng.integers(10, 14), rng.integers(16, 21)
        left = (size - width) // 2 + rng.integers(-2, 3)  # centred, as mnist's digits are
        top = (size - height) // 2 + rng.integers(-2, 3)
        thick = rng.integers(2, 4)
        right, bottom, middle = left + width, top + height, top + height // 2
        boxes = {  # (row0, row1, col0, col1) of each segment
            "a": (top, top + thick, left, right), "d": (bottom - thick, bottom, left, right),
            "g": (middle - thick // 2, middle - thick // 2 + thick, left, right),
            "f": (top, middle, left, left + thick), "e": (middle, bottom, left, left + thick),
            "b": (top, middle, right - thick, right), "c": (middle, bottom, right - thick, right),
        }
        brightness = rng.uniform(150, 255)
        for segment in _SEGMENTS[int(label)]:
            r0, r1, c0, c1 = boxes[segment]
            images[i, r0:r1, c0:c1] = brightness
    images += rng.normal(0, 25, images.shape)
    return np.clip(np.rint(images), 0, 255).astype(np.uint8)[..., None]


POSITIVE = ("great", "excellent", "wonderful", "loved", "brilliant", "superb", "enjoyable",
            "masterpiece", "charming", "moving")
NEGATIVE = ("awful", "boring", "terrible", "hated", "dull", "worst", "waste", "poor",
            "tedious", "mess")
FILLER = ("the", "movie", "film", "plot", "actors", "was", "and", "a", "story", "really", "i",
          "it", "this", "scenes", "music", "director", "of", "with", "café", "ending", "cast",
          "screen", "two", "hours", "watching", "felt", "quite", "some", "at", "times")


def write_reviews(rng: np.random.Generator, labels: np.ndarray) -> list:
    """Reviews of 8-20 words: filler and 2-4 words of the label's sentiment (1 =
    positive), sometimes one of the other, with capitals and punctuation."""
    reviews = []
    for label in labels:
        own, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        words = list(rng.choice(FILLER, rng.integers(6, 17)))
        words += list(rng.choice(own, rng.integers(2, 5)))
        if rng.random() < 0.3:
            words.append(rng.choice(other))
        words = [str(w) for w in rng.permutation(words)]
        words[0] = words[0].capitalize()
        reviews.append(" ".join(words) + rng.choice([".", "!", "...", " :)"]))
    return reviews


def _labels(rng, n, classes):
    return rng.permutation(np.arange(n) % classes)


class _Base(tfds.core.GeneratorBasedBuilder):
    """Generates `SPLITS` {name: size} locally (still abstract: not registered)."""

    VERSION = tfds.core.Version("1.0.0")
    SPLITS: dict = SIZES
    # Where TFDS looks for metadata files (README, checksums): set, because TFDS
    # infers it from the module's package and `tests` is not one.
    pkg_dir_path = epath.Path(os.path.dirname(os.path.abspath(__file__)))

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {split: self._generate_examples(split, n) for split, n in self.SPLITS.items()}


class _Digits(_Base):
    """mnist's layout."""

    SUPERVISED = True

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(28, 28, 1)),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
            supervised_keys=("image", "label") if self.SUPERVISED else None)

    def _generate_examples(self, split, n):
        rng = np.random.default_rng(list(self.SPLITS).index(split))
        labels = _labels(rng, n, 10)
        for i, (image, label) in enumerate(zip(draw_digits(rng, labels), labels)):
            yield i, {"image": image, "label": int(label)}


class TfdistTestMnist(_Digits):
    """Seven-segment digits in mnist's exact layout."""


class TfdistTestValidation(_Digits):
    """mnist's layout with train and validation splits (no test)."""

    SPLITS = {"train": 100, "validation": 40}


class TfdistTestTrainOnly(_Digits):
    """mnist's layout with only a train split."""

    SPLITS = {"train": 100}


class TfdistTestUnsupervised(_Digits):
    """mnist's features without supervised_keys."""

    SUPERVISED = False
    SPLITS = {"train": 20, "test": 10}


class TfdistTestVaried(_Base):
    """RGB images of differing sizes, as many catalog datasets have."""

    SPLITS = {"train": 20, "test": 10}

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(None, None, 3)),
                "label": tfds.features.ClassLabel(num_classes=2),
            }),
            supervised_keys=("image", "label"))

    def _generate_examples(self, split, n):
        rng = np.random.default_rng(list(self.SPLITS).index(split))
        for i in range(n):
            shape = (rng.integers(20, 40), rng.integers(20, 40), 3)
            yield i, {"image": rng.integers(0, 256, shape, dtype=np.uint8),
                      "label": i % 2}


class TfdistTestImdb(_Base):
    """Generated reviews in imdb_reviews' exact layout."""

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "text": tfds.features.Text(),
                "label": tfds.features.ClassLabel(names=["neg", "pos"]),
            }),
            supervised_keys=("text", "label"))

    def _generate_examples(self, split, n):
        rng = np.random.default_rng(10 + list(self.SPLITS).index(split))
        labels = _labels(rng, n, 2)
        for i, (review, label) in enumerate(zip(write_reviews(rng, labels), labels)):
            yield i, {"text": review, "label": int(label)}


ALL = {cls.name: cls for cls in (TfdistTestMnist, TfdistTestImdb, TfdistTestValidation,
                                 TfdistTestTrainOnly, TfdistTestUnsupervised, TfdistTestVaried)}


def prepare_all(data_dir: str) -> None:
    """Prepare every fixture dataset into `data_dir` (two files per split, so
    sharding by file is possible too)."""
    config = tfds.download.DownloadConfig(num_shards=2)
    for cls in ALL.values():
        builder = cls(data_dir=data_dir)
        if not builder.is_prepared():
            builder.download_and_prepare(download_config=config)
