"""Corpus, tokenizer, token shards and batch sampling."""
