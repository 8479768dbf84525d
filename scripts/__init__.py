"""Scripts run from a checkout (not installed): the `make serve` launcher and the local
process helpers the integration tests and benchmarks share."""
