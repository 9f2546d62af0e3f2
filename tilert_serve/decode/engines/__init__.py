"""decode/engines."""
