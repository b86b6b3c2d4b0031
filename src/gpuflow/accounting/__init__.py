"""The accounting layer: the transfer ledger, budgets, the profiler cross-check, the
seeds' transfer metrics, and the pytest plugin built on them."""
