"""radixserve's HTTP server (OpenAI-compatible and SGLang-native endpoints) and the
``radixserve bench`` serving benchmark. Adds ``serve`` and ``bench`` to the ``radixserve``
command through the command hook."""
