"""Reading MCP tool results in tests: the structured content of a success, the text of an error."""

from __future__ import annotations


def ok(result) -> dict:
    assert not result.is_error, result.content[0].text
    return result.structured_content


def error(result) -> str:
    assert result.is_error, result.structured_content
    return result.content[0].text
