"""Sources and I/O: the ``Source`` protocol, Hugging Face and webdataset sources, tar reading and
safe member decoding, remote (http/s3) reads, reads with a deadline, sizes from headers alone.

Layer rules (which layer may import which): ``loaders/README.md``."""
