"""`tfdist_shapes`: 32x32 RGB images of ten geometric figures, made offline.

Every image shows one figure at a random position and size, in a random
foreground colour on a random background colour (dark-on-light or
light-on-dark), plus Gaussian pixel noise. Position, scale, colour and
polarity all vary, so no single pixel says much and the class lives in the
figure's form. A four-layer CNN of 70k parameters passes 99% test accuracy
within two epochs; an MLP on raw pixels reaches roughly 80-90% in fifteen.

Images are drawn with numpy, a chunk at a time, from generators seeded by
(split, chunk); two preparations therefore write identical data.
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

from tfdist.data.builders.offline import OfflineBuilder

CLASS_NAMES = (
    "square",
    "circle",
    "ring",
    "triangle",
    "plus",
    "cross",
    "horizontal_stripes",
    "vertical_stripes",
    "diagonal_line",
    "dot_grid",
)
IMAGE_SIZE = 32

_SPLIT_SIZES = {"train": 12_000, "test": 2_000}
_SPLIT_SEEDS = {"train": 0, "test": 1}  # distinct streams: no train/test overlap
_CHUNK = 1_000  # examples drawn per vectorised step; a multiple of 10 classes
_NOISE_STD = 20.0  # in 0..255 pixel units


def _masks(labels, cx, cy, radius, period):
    """Boolean (n, 32, 32) masks of each example's figure.

    The figure of class `labels[i]` is centred on (cx[i], cy[i]) and fits in
    a box of half-width `radius[i]`; `period[i]` spaces stripes and dots.
    """
    grid = np.arange(IMAGE_SIZE, dtype=np.float32)
    dx = grid[None, None, :] - cx[:, None, None]
    dy = grid[None, :, None] - cy[:, None, None]
    r = radius[:, None, None]
    p = period[:, None, None]
    dist = np.hypot(dx, dy)
    in_box = np.maximum(np.abs(dx), np.abs(dy)) <= r
    bar = 1.5  # half-thickness of strokes
    shapes = {
        "square": in_box,
        "circle": dist <= r,
        "ring": (dist <= r) & (dist >= r - 2.5),
        # Apex up: half-width grows from 0 at the top to r at the bottom.
        "triangle": (np.abs(dy) <= r) & (np.abs(dx) <= (dy + r) / 2),
        "plus": in_box & ((np.abs(dx) <= bar) | (np.abs(dy) <= bar)),
        "cross": in_box & ((np.abs(dx - dy) <= bar) | (np.abs(dx + dy) <= bar)),
        "horizontal_stripes": in_box & (np.mod(dy, p) < p / 2),
        "vertical_stripes": in_box & (np.mod(dx, p) < p / 2),
        "diagonal_line": in_box & (np.abs(dx - dy) <= bar),
        "dot_grid": in_box & (np.mod(dx, p) < 2) & (np.mod(dy, p) < 2),
    }
    masks = np.zeros((len(labels), IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
    for label, name in enumerate(CLASS_NAMES):
        rows = labels == label
        masks[rows] = shapes[name][rows]
    return masks


def _draw_chunk(rng: np.random.Generator, n: int):
    """Returns (uint8 images of shape (n, 32, 32, 3), int64 labels (n,))."""
    labels = rng.permutation(np.arange(n) % len(CLASS_NAMES))
    radius = rng.uniform(5.0, 12.0, n).astype(np.float32)
    cx = rng.uniform(radius, IMAGE_SIZE - 1 - radius).astype(np.float32)
    cy = rng.uniform(radius, IMAGE_SIZE - 1 - radius).astype(np.float32)
    period = rng.integers(4, 7, n).astype(np.float32)
    # Fore- and background channels come from opposite thirds of 0..255,
    # with a random polarity, so the figure always contrasts with its ground.
    light = rng.random(n) < 0.5
    dark_rgb = rng.uniform(0, 90, (n, 3))
    bright_rgb = rng.uniform(165, 255, (n, 3))
    fg = np.where(light[:, None], bright_rgb, dark_rgb)
    bg = np.where(light[:, None], dark_rgb, bright_rgb)

    mask = _masks(labels, cx, cy, radius, period)[..., None]
    images = np.where(mask, fg[:, None, None, :], bg[:, None, None, :])
    images += rng.normal(0.0, _NOISE_STD, images.shape)
    return np.clip(np.rint(images), 0, 255).astype(np.uint8), labels


class TfdistShapes(OfflineBuilder):
    """Ten-class geometric-figure classification, generated offline."""

    SPLIT_SIZES = _SPLIT_SIZES

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(IMAGE_SIZE, IMAGE_SIZE, 3)),
                    "label": tfds.features.ClassLabel(names=CLASS_NAMES),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _generate_examples(self, split: str):
        size = _SPLIT_SIZES[split]
        for start in range(0, size, _CHUNK):
            rng = np.random.default_rng((_SPLIT_SEEDS[split], start // _CHUNK))
            images, labels = _draw_chunk(rng, min(_CHUNK, size - start))
            for offset, (image, label) in enumerate(zip(images, labels)):
                yield start + offset, {"image": image, "label": int(label)}
