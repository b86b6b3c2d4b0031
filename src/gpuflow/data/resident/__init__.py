"""Where each training step's batch comes from: datasets and token corpora kept in device
memory, their batches drawn and augmented there, and the batch sources that feed a step."""
