"""Shared by every layer: the error type, atomic file writes, the consoles."""
