"""Template specs and the root filesystem builder."""
