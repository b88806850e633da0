"""The op's benchmarks: how fast it is (bench), their shared shapes and timing (timing)."""
