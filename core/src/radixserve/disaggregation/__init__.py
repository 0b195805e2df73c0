"""Prefill-decode disaggregation: a prefill server computes a prompt's KV and writes its pages
into a decode server's KV pool through a KV transfer engine (the ``kv_transfer`` plugin
kind, :mod:`radixserve.disaggregation.transfer`)."""
