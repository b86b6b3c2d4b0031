"""The device layer: one API over CUDA, XPU, MPS and the CPU; the host-device link probe."""
