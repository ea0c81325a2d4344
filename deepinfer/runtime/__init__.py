"""Device side: jitted step functions, sampling, the on-device generate loop."""
