"""Command-line tools: the specdec command, local launcher, benchmark, model fetch, stub generation."""
