"""The cachegate benchmark: a mock upstream, load generators and one runner (``python -m bench.run``)."""
