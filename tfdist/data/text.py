"""Text inputs: a vocabulary adapted on the train split, and token ids from it.

A Keras 3 `TextVectorization` (lower-case, punctuation stripped, split on
whitespace) maps each text to `sequence_length` int32 token ids: 0 pads, 1 is
out-of-vocabulary, the rest are the most frequent train tokens (ties broken by
the token, so adapting is deterministic whatever the read order). With a
`model_dir` the vocabulary is cached there as one token per line, so a resumed
run (and every worker sharing the directory) keeps the same token ids.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

import keras
import tensorflow as tf
from absl import logging

from tfdist.errors import UsageError

PAD, OOV = "", "[UNK]"  # TextVectorization's first two token ids (0 and 1)
_ADAPT_BATCH = 1024


def vocabulary_path(model_dir: str, dataset: str, vocab_size: int) -> str:
    """`model_dir/vocabulary/<dataset>-<vocab_size>.txt` (`/` in names replaced)."""
    safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", dataset)
    return os.path.join(model_dir, "vocabulary", f"{safe}-{vocab_size}.txt")


def adapt(texts: tf.data.Dataset, vocab_size: int) -> list:
    """The vocabulary (at most `vocab_size` entries, PAD and OOV first) of `texts`,
    a dataset of scalar strings."""
    layer = keras.layers.TextVectorization(max_tokens=vocab_size)
    layer.adapt(texts.batch(_ADAPT_BATCH))
    return [str(token) for token in layer.get_vocabulary()]


def write_vocabulary(path: str, vocabulary: list) -> None:
    """Write one token per line, atomically (a temporary file, then rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8", newline="") as f:
        f.write("\n".join(vocabulary))
    os.replace(temporary, path)


def read_vocabulary(path: str, vocab_size: int) -> list:
    """A vocabulary `write_vocabulary` wrote; `UsageError` if it is not one."""
    with open(path, encoding="utf-8", newline="") as f:
        # split("\n"), not splitlines(): tokens may hold other line breaks (\x85, \u2028).
        vocabulary = f.read().split("\n")
    if vocabulary[:2] != [PAD, OOV] or len(vocabulary) > vocab_size \
            or len(set(vocabulary)) != len(vocabulary):
        raise UsageError(f"the cached vocabulary {path} is not a vocabulary of at most "
                         f"--vocab_size={vocab_size} tokens; delete it to adapt a new one")
    return vocabulary


def load_or_adapt(texts_fn: Callable[[], tf.data.Dataset], vocab_size: int, *,
                  cache_path: Optional[str] = None) -> list:
    """The cached vocabulary at `cache_path` if there is one; else adapt it on
    `texts_fn()` (and write it to `cache_path`, when given)."""
    if cache_path and os.path.exists(cache_path):
        vocabulary = read_vocabulary(cache_path, vocab_size)
        logging.info("Text vocabulary: %d tokens from %s", len(vocabulary), cache_path)
        return vocabulary
    logging.info("Text vocabulary: adapting up to %d tokens on the train split", vocab_size)
    vocabulary = adapt(texts_fn(), vocab_size)
    if cache_path:
        try:
            write_vocabulary(cache_path, vocabulary)
        except OSError as error:
            raise UsageError(f"cannot write the vocabulary to {cache_path}: "
                             f"{error.strerror or error}") from None
        logging.info("Text vocabulary: %d tokens, written to %s", len(vocabulary), cache_path)
    return vocabulary


class Vectorizer:
    """Maps a scalar string to int32 token ids of shape (sequence_length,)."""

    def __init__(self, vocabulary: list, sequence_length: int):
        self.vocabulary = list(vocabulary)
        self.sequence_length = sequence_length
        self.layer = keras.layers.TextVectorization(
            max_tokens=len(self.vocabulary), output_sequence_length=sequence_length,
            vocabulary=self.vocabulary)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, PAD and OOV included."""
        return len(self.vocabulary)

    def __call__(self, text: tf.Tensor) -> tf.Tensor:
        ids = tf.cast(self.layer(text), tf.int32)
        return tf.ensure_shape(ids, [self.sequence_length])
