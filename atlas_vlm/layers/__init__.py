"""Building blocks of the decoder: attention over KV blocks, rotary embeddings, norms."""
