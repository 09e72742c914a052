"""The examples, importable as a package from the repository root (the benchmarks and the
tests use the demo's evaluations: ``from examples import demo_evaluate``)."""
