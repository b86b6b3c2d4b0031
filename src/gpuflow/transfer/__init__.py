"""The memory and transfer layers: pinned pools, packing, DeviceLoader, HostMirror,
AsyncScalars and snapshots. With data/, the only code that moves bytes across the bus."""
