"""The inference runtime: sampling math, draft-block encoding, models, KV caches, the model thread."""
