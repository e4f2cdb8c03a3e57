"""Tools off the serving path: training, evaluation and calibration fitting, the demo and its models, the
memory report, an embedded Redis, tiny models for tests and benchmarks."""
