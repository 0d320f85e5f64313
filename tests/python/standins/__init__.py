"""Stand-ins with the signatures of the engines' base classes, for testing the adapters without
the engines (written from the engines' public interfaces; no engine code)."""
