"""Device-side decode state per V4 layer type, and the pure functions that read and write it."""
