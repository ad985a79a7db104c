"""Copies between the host and the device (worker/runner/transfers/host_copies.py)."""
