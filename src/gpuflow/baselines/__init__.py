"""The pipelines gpuflow replaces, kept to measure against: the naive and standard data paths."""
