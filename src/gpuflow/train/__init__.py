"""Configuration, optimizer, training loop, checkpoints and run folders."""
