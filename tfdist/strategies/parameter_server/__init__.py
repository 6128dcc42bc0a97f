"""`parameter_server`: asynchronous training with ParameterServerStrategy.

`engine` is the adapter (TensorFlow, loaded when chosen); `options` declares
the options only this engine reads (no TensorFlow)."""
