"""How a corpus becomes a token folder: read in bounded parts, cut into pieces, tokenized and
encoded on every core, and written as train/val shards (``pipeline``), or appended to one."""
