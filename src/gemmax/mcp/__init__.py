"""MCP tools for operators: start, inspect and stop deployments, check the device, plan memory, query
a model, run and compare benchmark sweeps, move the compile cache (docs/mcp.md).

server       the MCPServer and its tools (`gemmax mcp`), thin wrappers over the CLI's own code
deployments  rig processes started in the background, remembered in an on-disk registry
local        this server's manager of those processes
remote       the deploy_* tools: deployments on a target (local, ssh, aws) through gemmax.deploy
device       the device policy plus real matrix products checked against numpy

Imports of the SDK are absolute (`mcp.server.mcpserver`), so this package never shadows it.
"""
