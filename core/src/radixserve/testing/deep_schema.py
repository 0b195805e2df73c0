"""A JSON schema that is slow to compile: a deep tree of objects.

Compile time grows faster than the square of the depth (xgrammar, here: depth 200 at width 2
about 2 s, at width 32 about 30 s, for a schema of about 190 KB); tests use it to hold a
compile worker past ``--grammar-compile-timeout``.
"""

from __future__ import annotations

DEPTH, WIDTH = 200, 32


def deep_tree_schema(tag: int = 0, depth: int = DEPTH, width: int = WIDTH) -> str:
    """An object whose first property is an object ... ``depth`` levels deep, each level with
    ``width - 1`` integer siblings named after ``tag`` (distinct tags: distinct schemas).
    Built as text: ``json.dumps`` of the nested dicts would recurse too deep."""
    siblings = "".join(f', "p{tag}_{i}": {{"type": "integer"}}' for i in range(1, width))
    text = '{"type": "string"}'
    for _ in range(depth):
        text = ('{"type": "object", "properties": {"k": ' + text + siblings
                + '}, "required": ["k"], "additionalProperties": false}')
    return text
