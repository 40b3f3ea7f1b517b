WRITE_WAIT = 60.0
"""Seconds a test waits for a tier's background writes (`puts.flush`): a hang guard, not a deadline.
Alone a write takes milliseconds, but a CI lane beside the vLLM engines has run 30x slower."""
