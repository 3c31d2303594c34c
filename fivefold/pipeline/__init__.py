"""Pipeline parallelism: schedules as data (IR, generators, verifier, simulator, renderer) and their executor."""
