"""Deployments beyond this machine: `gemmax serve` on a host reached over SSH, or on an EC2 instance.

One interface for every target (`service.Deployer`): launch, status with the boot timeline, logs,
benchmark from this machine, push / restore the compile cache, terminate, and for AWS cleanup of
orphans and cost. Every remote resource is recorded in an on-disk registry (`registry`), so a
restarted MCP server or a second CLI sees and terminates what another started. The `local` target
(processes on this machine) stays in `gemmax.mcp.deployments`; the MCP and CLI layers route to it.

  records    the state directory and its record files (a file lock, an atomic replace)
  registry   remote deployments in `remote.json` under the state directory
  cost       on-demand prices, spot price history, instance-hours and the guard rails
  aws        EC2 through boto3: zone fallback on capacity errors, user data, tags, terminate, cleanup
  ssh        a host over asyncssh: install, start, stop, status, logs, tunnel
  timeline   the boot timeline: running -> reachable -> /health 200 with compile-cache hits
  cache      the compile cache at an fsspec URL, with a clear error when s3fs is missing
"""
