"""Helpers and fixtures the test modules share (a test module never imports another)."""
