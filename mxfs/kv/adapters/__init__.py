"""Serving-engine backends over `KVStore`; each module imports its engine, so import it
only where that engine is installed (the engine loads it by module path)."""
