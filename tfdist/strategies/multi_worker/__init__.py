"""`multi_worker`: MultiWorkerMirroredStrategy over a TF_CONFIG cluster.

`engine` is the adapter (TensorFlow, loaded when chosen); `options` declares
the options only this engine reads (no TensorFlow: flags and `--help` stay
instant)."""
