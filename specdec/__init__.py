"""specdec: exact, distributed, pipelined speculative decoding."""
