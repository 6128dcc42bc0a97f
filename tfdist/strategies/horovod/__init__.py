"""`horovod`: Horovod ranks under horovodrun, elastic or not.

`engine` is the adapter (TensorFlow and Horovod, loaded when chosen);
`options` declares the options only this engine reads (no TensorFlow)."""
