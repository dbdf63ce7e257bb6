"""The offline build: raw sources -> normalized, filtered, deduplicated, tokenized .bin/.idx per source + manifest
(`run.py` runs the stages; one stage per module)."""
