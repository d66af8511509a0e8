"""Model definitions the built-in tasks train."""
