"""Tool calling (``tools``, ``tool_choice``, ``--tool-call-parser``): formats in
:mod:`.parsers`, the request and reply side in :mod:`.request`."""

from radixserve_server.tool_calling import formats  # noqa: F401 - registers the in-tree formats
from radixserve_server.tool_calling.parsers import (
    TOOL_PARSERS,
    ToolParser,
    get_tool_parser,
    parse_tool_calls,
    register_tool_parser,
    tool_parser_names,
)
from radixserve_server.tool_calling.request import (
    ChoiceStreams,
    ToolCalling,
    ToolCallStream,
    check_tools,
    required_schema,
)

__all__ = [
    "ChoiceStreams",
    "TOOL_PARSERS",
    "ToolCallStream",
    "ToolCalling",
    "ToolParser",
    "check_tools",
    "get_tool_parser",
    "parse_tool_calls",
    "register_tool_parser",
    "required_schema",
    "tool_parser_names",
]
