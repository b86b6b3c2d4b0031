"""What users run: the command line, reports, sampling and profiling."""
