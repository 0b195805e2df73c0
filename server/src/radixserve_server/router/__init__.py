"""Data parallelism and request routing.

- :mod:`.tree`: the approximate prefix tree the cache-aware policy keeps per worker.
- :mod:`.policy`: the routing policies (``cache_aware``, ``round_robin``,
  ``shortest_queue``, ``random``) and their flags, shared by both users below.
- :mod:`.dp`: ``radixserve serve --dp-size N``: N engine processes behind one HTTP server,
  each request routed to one of them on its token ids.
- :mod:`.proxy` and :mod:`.launch`: ``radixserve router --worker-urls ...``: a standalone
  HTTP router in front of several ``radixserve serve`` instances, routing on the request
  text, with health checks.
"""
