"""Draft worker: the small model; proposes blocks of tokens for the target to verify."""
