"""Compiled kernels radixserve builds for itself (see :mod:`radixserve.kernels.cpu`)."""
