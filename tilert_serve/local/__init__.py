"""local."""
