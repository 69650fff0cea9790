"""The GPU benchmarks of `mode=bench` (and of the scripts in bench/): timing, inputs, and one module per table."""
