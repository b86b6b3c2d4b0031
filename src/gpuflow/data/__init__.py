"""What becomes of a corpus on its way to training, in two wings over one format.

- ``prepare/``: a corpus made into a token folder (read, cut, tokenized, encoded, written).
- ``resident/``: datasets and batches drawn in device memory, and the batch sources a
  training step reads.
- ``shards``, ``tokens``, ``token_bytes``: the token folder itself, which ``prepare`` writes
  and training reads: its ``.bin`` shards, the folder opened with its tokenizer, and the
  bytes each token stands for.
"""
