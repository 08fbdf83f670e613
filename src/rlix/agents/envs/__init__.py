"""Environments shipped with rlix (resources servers for the generic ToolAgent)."""
