"""Small shared helpers: argument validation and plain config values."""
