"""What the pipeline measures and reports: eval, the benchmark, the PyTorch peer, the report page."""
