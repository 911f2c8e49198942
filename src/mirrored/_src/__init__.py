"""Private implementation of :mod:`mirrored`; import from the public modules instead."""
