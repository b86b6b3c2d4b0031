"""The suite on a real accelerator, by layer: run with `pytest -m gpu` on a GPU machine."""
