"""Helpers the bench scripts share (progress, GPU bounds); not benchmarks themselves."""
