"""Target worker: the large model; verifies draft blocks in one forward pass with rejection sampling."""
