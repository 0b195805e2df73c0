"""Data parallelism and request routing.

- :mod:`.tree`: the approximate prefix tree the cache-aware policy keeps per worker.
- :mod:`.policy`: the routing policies (``cache_aware``, ``round_robin``,
  ``shortest_queue``, ``random``) and their flags (``--load-balance-method``).
- :mod:`.dp`: ``radixserve serve --dp-size N``: N engine processes behind one HTTP server,
  each request routed to one of them on its token ids.
- :mod:`.launch`: ``radixserve router ...`` runs SGLang's own router (``sglang-router``) in
  front of several servers; radixserve keeps no router of its own.
"""
