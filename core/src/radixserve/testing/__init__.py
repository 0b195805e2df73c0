"""Test helpers that plugin packages can reuse (no pytest dependency at import time)."""
